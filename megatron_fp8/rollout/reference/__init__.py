"""The CPU reference FP8 engine: an emulator and oracle of vLLM's FP8 W8A8 blockwise numerics.

This is NOT a serving engine; on GPU use vLLM. It computes what vLLM computes
in FP8 (dynamic W8A8 blockwise GEMMs, an emulated FP8 KV cache), holds its
weights the way vLLM does and accepts the same refit stream, so refit and
rollout can be tested, and vLLM's results checked, on machines where vLLM's
FP8 kernels do not run.

Modules:

* :mod:`~megatron_fp8.rollout.reference.config`: model / quantization config, parameter specs, FP8 manifest rules;
* :mod:`~megatron_fp8.rollout.reference.linear`: the W8A8 blockwise and BF16 GEMMs;
* :mod:`~megatron_fp8.rollout.reference.weights`: the weight store (refit versions, checkpoints);
* :mod:`~megatron_fp8.rollout.reference.forward`: the model forward with its KV cache;
* :mod:`~megatron_fp8.rollout.reference.sampler`: sampling, generation loop, logprobs;
* :mod:`~megatron_fp8.rollout.reference.engine`: :class:`ReferenceFP8Engine`, the facade composing them;
* :mod:`~megatron_fp8.rollout.reference.applier`: :class:`ReferenceEngineApplier`, the refit applier.
"""

from megatron_fp8.exports import lazy_exports

_EXPORTS = {  # exported name -> the module that defines it (resolved on first use: megatron_fp8.exports)
    "ReferenceEngineApplier": "megatron_fp8.rollout.reference.applier",
    "ReferenceFP8Engine": "megatron_fp8.rollout.reference.engine",
    "GenerationResult": "megatron_fp8.rollout.reference.sampler",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
