"""Megatron-Core through Megatron-Bridge: build, forward, train step and HF-named export.

* :mod:`~megatron_fp8.megatron._patches`: private; what Megatron-Core needs on a CPU-only machine;
* :mod:`~megatron_fp8.megatron.parallel`: gloo process group + Megatron parallel state;
* :mod:`~megatron_fp8.megatron.build`: :func:`build_megatron_model` from a Hugging Face folder (through
  :mod:`bridge_mappings.adapter`) and :func:`export_hf_weights`, its HF-named weight stream;
* :mod:`~megatron_fp8.megatron.step`: logits, token log-probs, optimizer, one training step;

Importing this package imports torch but not Megatron; the submodules import Megatron lazily.
"""

from __future__ import annotations

from megatron_fp8.errors import TransformerEngineMissingError
from megatron_fp8.megatron.build import DTYPES, FUSIONS_OFF, MegatronModel, build_megatron_model, export_hf_weights
from megatron_fp8.megatron.parallel import ParallelState, find_free_port, megatron_parallel
from megatron_fp8.megatron.step import (
    StepResult,
    build_attention_mask,
    forward_logits,
    logprobs_from_logits,
    make_optimizer,
    position_ids_for,
    token_logprobs,
    train_step,
)

__all__ = [
    "DTYPES",
    "FUSIONS_OFF",
    "MegatronModel",
    "ParallelState",
    "StepResult",
    "TransformerEngineMissingError",
    "build_attention_mask",
    "build_megatron_model",
    "export_hf_weights",
    "find_free_port",
    "forward_logits",
    "logprobs_from_logits",
    "make_optimizer",
    "megatron_parallel",
    "position_ids_for",
    "token_logprobs",
    "train_step",
]
