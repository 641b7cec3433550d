"""Megatron-Core through Megatron-Bridge: build, forward, train step and HF-named export.

* :mod:`~megatron_fp8.megatron.parallel`: gloo process group + Megatron parallel state
  (:func:`megatron_parallel`);
* :mod:`~megatron_fp8.megatron.build`: :func:`build_megatron_model` from a Hugging Face folder and
  :func:`export_hf_weights`, its HF-named weight stream (both through :mod:`bridge_mappings.adapter`,
  the only importer of ``megatron.bridge``);
* :mod:`~megatron_fp8.megatron.logits`: masks, positions, next-token log-probs of (vocab-parallel) logits;
* :mod:`~megatron_fp8.megatron.schedule`: micro-batches through Megatron-Core's forward-backward schedules
  (pipeline stages included), values from the last stage to every stage;
* :mod:`~megatron_fp8.megatron.step`: logits, token log-probs, :func:`make_optimizer`, one
  :func:`train_step`;
* :mod:`~megatron_fp8.megatron.optim`: :class:`~megatron_fp8.megatron.optim.MegatronDDPAdam`, the CPU
  optimizer over Megatron-Core DDP grad buffers, and the :class:`StepOptimizer` protocol;

Every patch the Megatron stack needs (TE import stand-ins, Megatron-Bridge's expert export,
Megatron-Core's CPU device answer and RNG tracker) lives in the private ``bridge_mappings._patches``
and is reached only through :mod:`bridge_mappings.adapter`.

Importing this package imports torch (and :mod:`bridge_mappings.adapter`) but not Megatron; the
submodules import Megatron-Core lazily.
"""

from __future__ import annotations

from megatron_fp8.errors import TransformerEngineMissingError
from megatron_fp8.megatron.build import DTYPES, FUSIONS_OFF, MegatronModel, build_megatron_model, export_hf_weights
from megatron_fp8.megatron.logits import build_attention_mask, logprobs_from_logits, position_ids_for
from megatron_fp8.megatron.optim import StepOptimizer
from megatron_fp8.megatron.parallel import ParallelState, find_free_port, megatron_parallel
from megatron_fp8.megatron.step import (
    StepResult,
    forward_logits,
    make_optimizer,
    sequence_logprobs,
    token_logprobs,
    train_step,
)

__all__ = [
    "DTYPES",
    "FUSIONS_OFF",
    "MegatronModel",
    "ParallelState",
    "StepOptimizer",
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
    "sequence_logprobs",
    "token_logprobs",
    "train_step",
]
