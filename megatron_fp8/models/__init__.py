"""Embedded tiny Qwen3 / Qwen3-MoE checkpoints, generated locally on first use.

See :mod:`megatron_fp8.models.tiny` for the cache layout,
:mod:`megatron_fp8.models.tokenizer` for the character-level vocabulary and
:mod:`megatron_fp8.models.dims` for the dimensions of every model megatron-fp8 knows.
"""

from __future__ import annotations

from megatron_fp8.exports import lazy_exports

_EXPORTS = {  # exported name -> the module that defines it (resolved on first use: megatron_fp8.exports)
    "KNOWN_MODELS": "megatron_fp8.models.dims",
    "ModelDims": "megatron_fp8.models.dims",
    "known_dims": "megatron_fp8.models.dims",
    "model_key": "megatron_fp8.models.dims",
    "CACHE_ENV_VAR": "megatron_fp8.models.tiny",
    "MODEL_ALIASES": "megatron_fp8.models.tiny",
    "TINY_MODELS": "megatron_fp8.models.tiny",
    "TinyModelSpec": "megatron_fp8.models.tiny",
    "default_cache_dir": "megatron_fp8.models.tiny",
    "get_spec": "megatron_fp8.models.tiny",
    "resolve_model": "megatron_fp8.models.tiny",
    "spec_hash": "megatron_fp8.models.tiny",
    "tiny_model_path": "megatron_fp8.models.tiny",
    "SPECIAL_TOKENS": "megatron_fp8.models.tokenizer",
    "TOKENIZER_SIZE": "megatron_fp8.models.tokenizer",
    "build_char_tokenizer": "megatron_fp8.models.tokenizer",
    "special_token_ids": "megatron_fp8.models.tokenizer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
