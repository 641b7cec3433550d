"""Naive, float64-accurate reference quantizers: the test oracle and the benchmark baseline.

These are written the textbook way (pad, view, permute, reduce, divide, permute
back) and do every step in float64 with an independent float -> e4m3 rounding,
so they share no arithmetic with the fast paths in
:mod:`megatron_fp8.quant.blockwise` / :mod:`megatron_fp8.quant.token_group`
except the final bit-exact float64 -> fp8 store of already representable values.

The rule they implement (:mod:`megatron_fp8.quant.formats`):

* ``amax``: the largest ``|x|`` over the block's real elements (float64, exact);
* ``ratio = float32(amax / 448)``: the float64 quotient rounded once to float32.
  This is the correctly rounded float32 division, because float64 carries more
  than ``2 * 24 + 2`` bits, so rounding the float64 quotient of two float32
  values to float32 never double-rounds;
* ``scale_inv = max(ratio, 2**-126)``, 1.0 for ``amax == 0``; ``ue8m0`` takes
  ``2 ** ceil(log2(scale_inv))`` from the exact binary exponent;
* ``q = e4m3(float32(x / scale_inv))`` clamped to +-448: the quotient is
  rounded to float32 first (what a float32 division does), then to the nearest
  e4m3 value, ties to even (:func:`round_to_e4m3`).

They are slow (several full-size float64 temporaries); use them on small tensors.
"""

from __future__ import annotations

import torch

from megatron_fp8.errors import QuantInputError
from megatron_fp8.layout import ceil_div
from megatron_fp8.quant.formats import FP8_DTYPE, FP8_MAX, MIN_SCALE, check_scale_format
from megatron_fp8.vocab import DEFAULT_BLOCK

__all__ = [
    "E4M3_MIN_NORMAL_EXP",
    "quantize_blockwise_naive",
    "quantize_blockwise_reference",
    "quantize_per_token_group_reference",
    "round_to_e4m3",
    "scale_reference",
]

E4M3_MIN_NORMAL_EXP = -6
"""Binary exponent of the smallest normal e4m3 value (2**-6); below it the spacing stays 2**-9."""

_E4M3_MANTISSA_BITS = 3


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the nearest e4m3fn value, ties to even, saturating at +-448.

    Independent of torch's float8 cast: the spacing of e4m3 values around
    ``|v|`` is ``2 ** (max(floor(log2|v|), -6) - 3)``; ``v / spacing`` is exact
    (a power-of-two scaling) and ``torch.round`` rounds half to even.

    Args:
        v: float64 tensor, finite, any shape.

    Returns:
        float64 tensor of e4m3-representable values (signed zeros kept).
    """
    if v.dtype != torch.float64:
        raise QuantInputError(f"round_to_e4m3 expects float64 values, got {v.dtype}")
    mag = v.abs()
    _, exp = torch.frexp(mag)  # mag = m * 2**exp, m in [0.5, 1): floor(log2(mag)) = exp - 1
    exp = torch.clamp(exp - 1, min=E4M3_MIN_NORMAL_EXP)
    spacing = torch.ldexp(torch.ones_like(v), exp - _E4M3_MANTISSA_BITS)
    r = torch.round(v / spacing) * spacing
    return r.clamp(-FP8_MAX, FP8_MAX)


def scale_reference(amax: torch.Tensor, *, scale_format: str = "fp32") -> torch.Tensor:
    """``scale_inv`` from per-block maxima, computed in float64 (see module docstring).

    Args:
        amax: non-negative finite block maxima (any float dtype), any shape.
        scale_format: ``"fp32"`` or ``"ue8m0"``.

    Returns:
        float32 tensor of ``amax``'s shape.
    """
    check_scale_format(scale_format)
    a = amax.to(torch.float64)
    ratio = (a / FP8_MAX).to(torch.float32).to(torch.float64).clamp_min(MIN_SCALE)
    if scale_format == "ue8m0":
        mantissa, exp = torch.frexp(ratio)  # ratio = m * 2**exp, m in [0.5, 1)
        ceil_log2 = torch.where(mantissa == 0.5, exp - 1, exp)
        ratio = torch.ldexp(torch.ones_like(ratio), ceil_log2)
    return torch.where(a == 0, torch.ones_like(ratio), ratio).to(torch.float32)


def _quantize_values(x64: torch.Tensor, scale64: torch.Tensor) -> torch.Tensor:
    quotient = (x64 / scale64).to(torch.float32).to(torch.float64)
    return round_to_e4m3(quotient.clamp(-FP8_MAX, FP8_MAX)).to(FP8_DTYPE)


def quantize_blockwise_reference(
    x: torch.Tensor, *, block_size: tuple[int, int] = (DEFAULT_BLOCK, DEFAULT_BLOCK), scale_format: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook blockwise quantization: pad, view, permute, amax, divide, permute back.

    Args:
        x: ``[N, K]`` or ``[E, N, K]`` float tensor (finite values; no checks
            beyond rank).
        block_size: ``(bn, bk)``.
        scale_format: ``"fp32"`` or ``"ue8m0"``.

    Returns:
        ``(q, scale_inv)`` exactly as :func:`megatron_fp8.quant.quantize_blockwise`
        defines them: float8_e4m3fn of ``x``'s shape and float32
        ``[..., ceil(N/bn), ceil(K/bk)]``.
    """
    if x.dim() not in (2, 3):
        raise QuantInputError(f"quantize_blockwise_reference expects [N, K] or [E, N, K], got shape {tuple(x.shape)}")
    bn, bk = block_size
    x3 = (x if x.dim() == 3 else x.unsqueeze(0)).to(torch.float64)
    e, n, k = x3.shape
    nb, kb = ceil_div(n, bn), ceil_div(k, bk)
    padded = torch.zeros((e, nb * bn, kb * bk), dtype=torch.float64)
    padded[:, :n, :k] = x3
    tiles = padded.view(e, nb, bn, kb, bk).permute(0, 1, 3, 2, 4).contiguous()  # [E, nb, kb, bn, bk]
    amax = tiles.abs().amax(dim=(3, 4))
    scale = scale_reference(amax, scale_format=scale_format)
    q_tiles = _quantize_values(tiles, scale.to(torch.float64)[..., None, None])
    q = q_tiles.view(torch.uint8).permute(0, 1, 3, 2, 4).reshape(e, nb * bn, kb * bk)[:, :n, :k]
    q = q.contiguous().view(FP8_DTYPE)
    if x.dim() == 2:
        return q[0], scale[0]
    return q, scale


def quantize_per_token_group_reference(
    x: torch.Tensor, *, group_size: int = DEFAULT_BLOCK, scale_format: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook per-token-group quantization (pad K, view groups, amax, divide).

    Args:
        x: ``[..., K]`` float tensor (finite values).
        group_size: elements per group along the last axis.
        scale_format: ``"fp32"`` or ``"ue8m0"``.

    Returns:
        ``(q, scale_inv)``: float8_e4m3fn of ``x``'s shape and float32
        ``[..., ceil(K / group_size)]``.
    """
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    ng = ceil_div(k, group_size)
    x2 = x.reshape(-1, k).to(torch.float64)
    padded = torch.zeros((x2.shape[0], ng * group_size), dtype=torch.float64)
    padded[:, :k] = x2
    groups = padded.view(-1, ng, group_size)
    scale = scale_reference(groups.abs().amax(dim=2), scale_format=scale_format)
    q = _quantize_values(groups, scale.to(torch.float64)[..., None])
    q = q.view(torch.uint8).reshape(-1, ng * group_size)[:, :k].contiguous().view(FP8_DTYPE)
    return q.view(*lead, k), scale.view(*lead, ng)


def quantize_blockwise_naive(
    x: torch.Tensor, *, block_size: tuple[int, int] = (DEFAULT_BLOCK, DEFAULT_BLOCK)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook float32 version a user would write: the CPU benchmark's baseline.

    ``x.float()`` -> pad -> view -> permute -> contiguous -> ``abs().amax`` ->
    divide -> permute back -> cast. Same rule as :mod:`megatron_fp8.quant.formats`
    (fp32 scales), so it yields the same bytes as :func:`~megatron_fp8.quant.quantize_blockwise`;
    it is only slower (several full-size float32 temporaries, two permute copies).

    Args:
        x: ``[N, K]`` bfloat16/float16/float32 weight.

    Returns:
        ``(q, scale_inv)`` as :func:`~megatron_fp8.quant.quantize_blockwise`.
    """
    bn, bk = block_size
    n, k = x.shape
    xf = torch.nn.functional.pad(x.float(), (0, (-k) % bk, 0, (-n) % bn))
    nb, kb = xf.shape[0] // bn, xf.shape[1] // bk
    tiles = xf.view(nb, bn, kb, bk).permute(0, 2, 1, 3).contiguous()
    amax = tiles.abs().amax(dim=(-1, -2))
    scale = torch.where(amax == 0, torch.ones_like(amax), (amax / FP8_MAX).clamp_min(MIN_SCALE))
    q = (tiles / scale[..., None, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.permute(0, 2, 1, 3).contiguous().view(nb * bn, kb * bk)[:n, :k].to(FP8_DTYPE)
    return q, scale
