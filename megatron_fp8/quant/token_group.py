"""Dynamic per-token-group activation quantization (1 x 128 groups along K).

This is what vLLM's blockwise W8A8 path does to activations at run time: each
row (token) is cut into groups of ``group_size`` consecutive elements along the
last axis, and each group gets ``scale_inv = amax / 448`` (the same rule and
formats as the weights, :mod:`megatron_fp8.quant.formats`). A partial last
group uses only its real elements.
"""

from __future__ import annotations

import math

import torch

from megatron_fp8 import vocab
from megatron_fp8.layout import ceil_div
from megatron_fp8.quant import _checks
from megatron_fp8.quant.blockwise import Backend, resolve_backend
from megatron_fp8.quant.formats import FP8_DTYPE, FP8_MAX, SCALE_RULES, NonFinitePolicy, ScaleFormat

_CHUNK_ELEMS = 1 << 20


def _token_group_torch(
    x2: torch.Tensor, g: int, scale_format: str, *, name: str | None, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x2.shape
    ng = ceil_div(k, g)
    kp = ng * g
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x2.device)
    amax = torch.empty((m, ng), dtype=torch.float32, device=x2.device)
    scale = torch.empty_like(amax)
    rows_per_chunk = max(1, _CHUNK_ELEMS // kp)
    buf = torch.empty((min(m, rows_per_chunk), kp), dtype=torch.float32, device=x2.device)
    if kp != k:
        buf[:, k:] = 0
    scale_fn = SCALE_RULES[scale_format]
    for r0 in range(0, m, rows_per_chunk):
        r1 = min(m, r0 + rows_per_chunk)
        work = buf[: r1 - r0]
        work[:, :k].copy_(x2[r0:r1])
        groups = work.view(r1 - r0, ng, g)
        grp_amax = torch.maximum(groups.amax(dim=2), groups.amin(dim=2).neg_())
        grp_amax.nan_to_num_(nan=math.inf, posinf=math.inf)  # NaN group -> +inf amax and scale (as the kernel)
        amax[r0:r1] = grp_amax
        grp_scale = scale_fn(grp_amax)
        scale[r0:r1] = grp_scale
        groups.div_(grp_scale[:, :, None]).clamp_(-FP8_MAX, FP8_MAX)
        q[r0:r1].copy_(work[:, :k])
    if not check:
        return q, scale
    _checks.raise_on_nonfinite_amax(
        x2, amax, block_size=(1, g), axis_names=("token", "group"), name=name, what="quantize_per_token_group"
    )
    return q, scale


def quantize_per_token_group(
    x: torch.Tensor,
    *,
    group_size: int = vocab.DEFAULT_BLOCK,
    scale_format: ScaleFormat = "fp32",
    nonfinite: NonFinitePolicy = "raise",
    name: str | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations to FP8 with one scale per token and group of ``group_size``.

    Args:
        x: ``[..., K]`` activations (any leading shape, rank >= 1); bfloat16,
            float16 or float32; CPU or CUDA.
        group_size: elements per group along the last axis.
        scale_format: ``"fp32"`` or ``"ue8m0"``.
        nonfinite: ``"raise"``, ``"sanitize"`` (NaN/Inf -> 0) or ``"defer"`` (no check, no host
            sync: a group holding NaN/Inf gets a ``+inf`` scale), as for weights.
        name: tensor name used in error messages.
        backend: ``"auto"`` (Triton for CUDA tensors), ``"torch"`` or ``"triton"``.

    Returns:
        ``(q, scale_inv)``: ``q`` float8_e4m3fn of ``x``'s shape; ``scale_inv``
        float32 ``[..., ceil(K / group_size)]``.
    """
    _checks.check_input(
        x,
        ranks=tuple(range(1, 9)),
        what="quantize_per_token_group",
        name=name,
        scale_format=scale_format,
        nonfinite=nonfinite,
    )
    if not isinstance(group_size, int) or group_size <= 0:
        raise _checks.QuantInputError(f"group_size must be a positive int, got {group_size!r}")
    if nonfinite == "sanitize":
        x = _checks.sanitize(x, name=name)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    x2 = x.reshape(-1, k)
    if resolve_backend(x, backend) == "triton":
        from megatron_fp8.quant import triton_kernels  # lazy: imports Triton (optional) only when it runs

        q, scale = triton_kernels.quantize_per_token_group_triton(
            x2, group_size, scale_format, name=name, check=nonfinite != "defer"
        )
    else:
        q, scale = _token_group_torch(x2.contiguous(), group_size, scale_format, name=name, check=nonfinite != "defer")
    return q.view(*lead, k), scale.view(*lead, scale.shape[-1])


def dequantize_per_token_group(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    group_size: int = vocab.DEFAULT_BLOCK,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_per_token_group` (``q * scale_inv`` per group)."""
    k = q.shape[-1]
    expected = (*q.shape[:-1], ceil_div(k, group_size))
    if tuple(scale_inv.shape) != expected:
        raise _checks.QuantInputError(
            f"dequantize_per_token_group: scale_inv has shape {tuple(scale_inv.shape)}, q {tuple(q.shape)} "
            f"with group_size {group_size} needs {expected}"
        )
    full = scale_inv.to(torch.float32).repeat_interleave(group_size, dim=-1)[..., :k]
    return (q.to(torch.float32) * full).to(out_dtype)
