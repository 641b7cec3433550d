"""Embedded tiny Qwen3 / Qwen3-MoE checkpoints, generated locally on first use.

See :mod:`megatron_fp8.models.tiny` for the cache layout and
:mod:`megatron_fp8.models.tokenizer` for the character-level vocabulary.
"""

from __future__ import annotations

from megatron_fp8.models.tiny import (
    CACHE_ENV_VAR,
    MODEL_ALIASES,
    TINY_MODELS,
    TinyModelSpec,
    default_cache_dir,
    get_spec,
    resolve_model,
    spec_hash,
    tiny_model_path,
)
from megatron_fp8.models.tokenizer import SPECIAL_TOKENS, TOKENIZER_SIZE, build_char_tokenizer, special_token_ids

__all__ = [
    "CACHE_ENV_VAR",
    "MODEL_ALIASES",
    "SPECIAL_TOKENS",
    "TINY_MODELS",
    "TOKENIZER_SIZE",
    "TinyModelSpec",
    "build_char_tokenizer",
    "default_cache_dir",
    "get_spec",
    "resolve_model",
    "spec_hash",
    "special_token_ids",
    "tiny_model_path",
]
