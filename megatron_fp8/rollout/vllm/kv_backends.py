"""Per-step FP8 KV-cache scales on every vLLM 0.11 attention backend: refresh what a backend derived from them, and
refuse the layout where a changed scale cannot reach the kernel.

A refit writes each attention layer's ``_q/_k/_v_scale`` tensors in place and reassigns ``_q/_k/_v_scale_float``
(:func:`~megatron_fp8.rollout.vllm.layouts.write_kv_scales`). FlashAttention, Triton and Flex attention read
those on every call. vLLM 0.11's FlashInfer (``v1/attention/backends/flashinfer.py``) and FlashInfer-MLA
(``mla/flashinfer_mla.py``) impls instead derive ``bmm1_scale = q * k * scale`` and ``bmm2_scale = v`` (host
floats) on their first forward and keep them (``if self.bmm1_scale is None``), and FlashInfer's wrappers take
``k_scale`` / ``v_scale`` as host floats: under a captured full CUDA graph those arguments are frozen at capture
time. So a refit must recompute the impl's cached floats (:func:`refresh_derived_kv_scales`), and per-step
calibration is refused at setup where a host float sits inside a full decode graph (:func:`kv_scale_problem`).
``docs/kv_cache.md`` has the table per backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megatron_fp8.errors import ConfigError, RefitError

HOST_FLOAT_BACKENDS = frozenset({"FLASHINFER", "FLASHINFER_MLA"})
"""Backends whose kernels take KV scales as host floats (frozen inside a captured full CUDA graph)."""

UNAPPLIED_BACKENDS = frozenset({"TRITON_ATTN"})
"""Backends that cannot use per-step scales in any graph mode: vLLM 0.11's Triton attention asserts
``_q_scale_float == 1.0`` and, with the FP8 query it makes on CUDA, reads the cache without the k/v scales
(``v1/attention/backends/triton_attn.py``, ``attention/ops/triton_unified_attention.py``)."""

_IMPL_BACKENDS = {
    "FlashInferImpl": "FLASHINFER",
    "FlashInferMLAImpl": "FLASHINFER_MLA",
    "FlashAttentionImpl": "FLASH_ATTN",
    "TritonAttentionImpl": "TRITON_ATTN",
}


@dataclass(frozen=True)
class OldScales:
    """A layer's host-float KV scales before a refit rewrote them (to recompute what the backend derived)."""

    q: float | None
    k: float | None
    v: float | None


def old_scales(module: torch.nn.Module) -> OldScales:
    """The layer's ``_q/_k/_v_scale_float`` as they are now."""
    return OldScales(*(getattr(module, f"_{x}_scale_float", None) for x in ("q", "k", "v")))


def backend_name(module: torch.nn.Module) -> str | None:
    """The attention backend of a built vLLM ``Attention`` layer (``"FLASHINFER"``, ``"FLASH_ATTN"``, ...)."""
    backend = getattr(module, "attn_backend", None)
    if backend is not None and hasattr(backend, "get_name"):
        return str(backend.get_name())
    impl = getattr(module, "impl", None)
    return _IMPL_BACKENDS.get(type(impl).__name__) if impl is not None else None


def refresh_derived_kv_scales(module: torch.nn.Module, old: OldScales) -> None:
    """Recompute the host floats a FlashInfer impl derived from the layer's KV scales, as its forward would.

    ``bmm1_scale = _q_scale_float * _k_scale_float * impl.scale`` (the same float operations in the same order);
    ``bmm2_scale = _v_scale_float``, divided by ``_o_scale_float`` when the forward divided it (attention + FP8
    output quantization fused). Floats not derived yet (``None``) stay so: the next forward derives them from
    the new scales. Other backends keep nothing: no-op.

    Raises:
        RefitError: the impl then holds other values than its forward would derive (checked after writing).
    """
    impl = getattr(module, "impl", None)
    if impl is None or not hasattr(impl, "bmm1_scale"):
        return
    q, k, v = module._q_scale_float, module._k_scale_float, module._v_scale_float
    if impl.bmm1_scale is not None:
        impl.bmm1_scale = q * k * impl.scale
    if impl.bmm2_scale is not None:
        o = getattr(module, "_o_scale_float", None)
        divided = o is not None and old.v is not None and impl.bmm2_scale != old.v
        impl.bmm2_scale = v / o if divided else v
    want1 = q * k * impl.scale
    if impl.bmm1_scale not in (None, want1):
        raise RefitError(f"{type(impl).__name__}.bmm1_scale holds {impl.bmm1_scale}, the new scales give {want1}")


def kv_scale_problem(backends: Iterable[str | None], *, full_decode_graphs: bool, per_step: bool) -> str | None:
    """Why per-step KV scales cannot reach the attention kernel here, ``None`` when they can.

    Args:
        backends: the attention backend of each layer (:func:`backend_name`).
        full_decode_graphs: decode batches run as captured full CUDA graphs (vLLM's ``cudagraph_mode``).
        per_step: the trainer recalibrates the KV scales every step (an FP8 KV cache in a megatron-fp8 run).
    """
    names = {b for b in backends if b is not None}
    if not per_step:
        return None
    unapplied = sorted(names & UNAPPLIED_BACKENDS)
    if unapplied:
        return (
            f"the FP8 KV cache's per-step scales cannot reach the {'/'.join(unapplied)} attention kernels: vLLM 0.11's "
            "Triton attention requires a q scale of 1.0 and, on CUDA, does not apply the k/v scales when it reads "
            "the cache. Use FlashAttention (VLLM_ATTENTION_BACKEND=FLASH_ATTN, the Hopper default) or a BF16 KV "
            "cache (vllm_cfg.kv_cache_dtype: auto)"
        )
    host = sorted(names & HOST_FLOAT_BACKENDS)
    if not (full_decode_graphs and host):
        return None
    return (
        f"the FP8 KV cache's per-step scales cannot reach the {'/'.join(host)} attention kernels: they take the "
        "scales as host floats, frozen inside vLLM's captured full decode CUDA graphs. Use FlashAttention "
        "(VLLM_ATTENTION_BACKEND=FLASH_ATTN, the Hopper default), or compilation_config.cudagraph_mode without "
        "full decode graphs (PIECEWISE or NONE), or a BF16 KV cache (vllm_cfg.kv_cache_dtype: auto)"
    )


def full_decode_graphs(cudagraph_mode: object) -> bool:
    """Whether vLLM's ``CompilationConfig.cudagraph_mode`` captures full graphs for decode batches."""
    if cudagraph_mode is None:
        return False
    decode = getattr(cudagraph_mode, "decode_mode", None)
    if callable(decode):
        return str(getattr(decode(), "name", decode())) == "FULL"
    has_full = getattr(cudagraph_mode, "has_full_cudagraphs", None)
    return bool(has_full()) if callable(has_full) else "FULL" in str(cudagraph_mode)


def refuse_stale_kv_scales(model: torch.nn.Module, cudagraph_mode: object, *, per_step: bool) -> None:
    """Raise :class:`ConfigError` at setup, before any rollout, when :func:`kv_scale_problem` has one."""
    backends = [backend_name(m) for m in model.modules() if hasattr(m, "impl") and hasattr(m, "_k_scale")]
    problem = kv_scale_problem(backends, full_decode_graphs=full_decode_graphs(cudagraph_mode), per_step=per_step)
    if problem is not None:
        raise ConfigError(problem)
