"""Per-tensor and per-channel (per output row) FP8 quantization.

Same scale rule as the blockwise formats (:mod:`megatron_fp8.quant.formats`):
``scale_inv = amax / 448`` over the whole tensor (tensorwise) or over each
output row (per-channel); ``x ~= q * scale_inv``.
"""

from __future__ import annotations

import torch

from megatron_fp8.quant import _checks
from megatron_fp8.quant.formats import FP8_DTYPE, FP8_MAX, NonFinitePolicy, ScaleFormat, scale_from_amax


def _abs_max(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    if dim is None:
        return torch.maximum(x.amax(), x.amin().neg()).to(torch.float32)
    return torch.maximum(x.amax(dim=dim, keepdim=True), x.amin(dim=dim, keepdim=True).neg()).to(torch.float32)


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.div(x.to(torch.float32), scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_tensorwise(
    x: torch.Tensor,
    *,
    scale_format: ScaleFormat = "fp32",
    nonfinite: NonFinitePolicy = "raise",
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with one float32 scale for the whole tensor.

    Args:
        x: any-rank (>= 1) bfloat16/float16/float32 tensor.

    Returns:
        ``(q, scale_inv)``: float8_e4m3fn of ``x``'s shape, and a 0-d float32 scale.
    """
    _checks.check_input(
        x,
        ranks=tuple(range(1, 9)),
        what="quantize_tensorwise",
        name=name,
        scale_format=scale_format,
        nonfinite=nonfinite,
    )
    if nonfinite == "sanitize":
        x = _checks.sanitize(x, name=name)
    amax = _abs_max(x, None)
    _checks.raise_on_nonfinite_amax(
        x, amax.reshape(1), block_size=(x.shape[-1],), axis_names=("tensor",), name=name, what="quantize_tensorwise"
    )
    scale = scale_from_amax(amax, scale_format=scale_format)
    return _cast(x, scale), scale


def dequantize_tensorwise(
    q: torch.Tensor, scale_inv: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_tensorwise`."""
    if scale_inv.numel() != 1:
        raise _checks.QuantInputError(
            f"dequantize_tensorwise: scale_inv must hold one value, got shape {tuple(scale_inv.shape)}"
        )
    return (q.to(torch.float32) * scale_inv.to(torch.float32)).to(out_dtype)


def quantize_per_channel(
    x: torch.Tensor,
    *,
    scale_format: ScaleFormat = "fp32",
    nonfinite: NonFinitePolicy = "raise",
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a ``[N, K]`` weight with one scale per output row.

    Returns:
        ``(q, scale_inv)``: float8_e4m3fn ``[N, K]`` and float32 ``[N, 1]``
        (the channelwise weight-scale layout vLLM uses).
    """
    _checks.check_input(
        x, ranks=(2,), what="quantize_per_channel", name=name, scale_format=scale_format, nonfinite=nonfinite
    )
    if nonfinite == "sanitize":
        x = _checks.sanitize(x, name=name)
    amax = _abs_max(x, 1)
    _checks.raise_on_nonfinite_amax(
        x, amax, block_size=(1, x.shape[1]), axis_names=("row", "col_block"), name=name, what="quantize_per_channel"
    )
    scale = scale_from_amax(amax, scale_format=scale_format)
    return _cast(x, scale), scale


def dequantize_per_channel(
    q: torch.Tensor, scale_inv: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_per_channel`."""
    if q.dim() != 2 or tuple(scale_inv.shape) != (q.shape[0], 1):
        raise _checks.QuantInputError(
            f"dequantize_per_channel: q {tuple(q.shape)} needs scale_inv [{q.shape[0]}, 1], got {tuple(scale_inv.shape)}"
        )
    return (q.to(torch.float32) * scale_inv.to(torch.float32)).to(out_dtype)
