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

from megatron_fp8.exports import lazy_exports

_EXPORTS = {  # exported name -> the module that defines it (resolved on first use: megatron_fp8.exports)
    "TransformerEngineMissingError": "megatron_fp8.errors",
    "DTYPES": "megatron_fp8.megatron.build",
    "FUSIONS_OFF": "megatron_fp8.megatron.build",
    "MegatronModel": "megatron_fp8.megatron.build",
    "build_megatron_model": "megatron_fp8.megatron.build",
    "export_hf_weights": "megatron_fp8.megatron.build",
    "build_attention_mask": "megatron_fp8.megatron.logits",
    "logprobs_from_logits": "megatron_fp8.megatron.logits",
    "position_ids_for": "megatron_fp8.megatron.logits",
    "StepOptimizer": "megatron_fp8.megatron.optim",
    "ParallelState": "megatron_fp8.megatron.parallel",
    "megatron_parallel": "megatron_fp8.megatron.parallel",
    "StepResult": "megatron_fp8.megatron.step",
    "forward_logits": "megatron_fp8.megatron.step",
    "make_optimizer": "megatron_fp8.megatron.step",
    "sequence_logprobs": "megatron_fp8.megatron.step",
    "token_logprobs": "megatron_fp8.megatron.step",
    "train_step": "megatron_fp8.megatron.step",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
