"""FP8 element type, scale formats and the amax -> scale rule.

The rules (DESIGN.md, "Formats that must be exactly right"):

* element type ``torch.float8_e4m3fn``, largest finite value 448;
* ``scale_inv = amax / 448`` in float32, correctly rounded on every device (a *multiplier*:
  ``x ~= q * scale_inv``; the divisor is a tensor on the device, :func:`fp8_max_on`);
* an all-zero block (``amax == 0``) gets ``scale_inv = 1.0``, never inf/NaN;
* ``scale_format="ue8m0"`` rounds the scale up to a power of two,
  ``2 ** ceil(log2(amax / 448))``, so it is exactly representable as UE8M0
  (what DeepGEMM wants on Blackwell, and TransformerEngine's blockwise default);
* a scale is never smaller than float32's smallest normal number (2**-126), so a
  block of tiny but non-zero values neither divides by zero nor loses itself to
  a subnormal scale.

The quantized value is ``q = fp8(clamp(x_fp32 / scale_inv, -448, 448))`` with a
correctly rounded float32 division and round-to-nearest-even into e4m3: the
quotient is rounded to float32 *first* (what every GPU kernel does). This is
not always the e4m3 value nearest the exact quotient: when the float32 rounding
lands exactly on an e4m3 midpoint, ties-to-even decides (e.g. a block with
amax ``448 + 2**-15`` has scale ``1 + 2**-23`` and maps ``1.1875 + 2**-23`` to
1.25, though the exact quotient lies just below the midpoint 1.1875). The tests
check the bytes against a float64 reference of this two-step rule
(:mod:`megatron_fp8.quant.reference`) and pin that example.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Literal, TypeAlias

import torch

from megatron_fp8 import vocab
from megatron_fp8.errors import QuantInputError

FP8_DTYPE: torch.dtype = getattr(torch, vocab.FP8_DTYPE_NAME)
"""The FP8 element type vLLM, DeepGEMM and TransformerEngine use for weights."""

FP8_MAX: float = float(torch.finfo(FP8_DTYPE).max)  # 448.0
"""Largest finite e4m3fn value."""

MIN_SCALE: float = float(torch.finfo(torch.float32).tiny)  # 2**-126
"""Smallest scale_inv ever produced (float32's smallest normal number)."""

ScaleFormat: TypeAlias = str
"""Name of a scale format: a key of :data:`megatron_fp8.vocab.SCALE_FORMATS` (checked by :func:`check_scale_format`)."""

FLOAT_INPUT_DTYPES: tuple[torch.dtype, ...] = tuple(getattr(torch, n) for n in vocab.FLOAT_INPUT_DTYPES)
"""Input dtypes the quantizers (and the engines, for unquantized tensors) accept."""

WIRE_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in vocab.WIRE_DTYPES if hasattr(torch, n)}
"""Dtypes a refit bucket can carry, by the name stored in its metadata (those this torch has)."""

PARAM_DTYPES: dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in vocab.PARAM_DTYPES.items()}
"""Trainer parameter dtypes by config short name (``bf16``, ``fp32``)."""

KV_CACHE_DTYPES: dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in vocab.KV_CACHE_DTYPES.items()}
"""vLLM ``kv_cache_dtype`` name -> element type of the cache."""

NonFinitePolicy = Literal["raise", "sanitize", "defer"]
"""What a quantizer does with NaN/Inf input: raise :class:`~megatron_fp8.errors.NonFiniteError` (one host read of
the per-block amax), replace by 0, or ``defer``: no check and no host sync; a block holding NaN/Inf gets a ``+inf``
scale (both backends), so the caller finds it in the scales later, batched with other checks (the refit packer's
:class:`~megatron_fp8.refit.integrity.finite.FiniteProbe` does, naming the scale tensor and the block's index)."""

SCALE_SUFFIX: str = vocab.SCALE_SUFFIX
"""Re-exported from :mod:`megatron_fp8.vocab`."""

SCALE_FORMATS = vocab.SCALE_FORMATS
"""Re-exported from :mod:`megatron_fp8.vocab`: scale format name -> description (the rules are :data:`SCALE_RULES`)."""


_FP8_MAX_ON: dict[torch.device, torch.Tensor] = {}


def fp8_max_on(device: torch.device | str) -> torch.Tensor:
    """448.0 as a 0-d float32 tensor on ``device`` (cached): the divisor of every ``amax / 448``.

    Not the Python number: PyTorch's CUDA ``div`` computes ``a * (1 / b)`` when ``b`` is a CPU scalar (a Python
    number, or any one-element CPU tensor; ``aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu``: "this may lose one
    bit of precision"), and ``amax * RN(1/448)`` is not the correctly rounded ``RN(amax / 448)`` for about half
    of all amax values, so the torch backend on CUDA gave other scales (and codes) than on a CPU and than the Triton
    kernel (``div_rn``). A divisor on the device makes CUDA divide; CPU float32 division always divides
    (``tests/quant/test_scale_division.py`` reproduces it on a CPU).
    """
    key = torch.device(device)
    t = _FP8_MAX_ON.get(key)
    if t is None:
        t = _FP8_MAX_ON[key] = torch.full((), FP8_MAX, dtype=torch.float32, device=key)
    return t


def _fp32_scale(amax: torch.Tensor) -> torch.Tensor:
    scale = (amax / fp8_max_on(amax.device)).clamp_min_(MIN_SCALE)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def _ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    ratio = (amax / fp8_max_on(amax.device)).clamp_min_(MIN_SCALE)
    # ratio = m * 2**e with m in [0.5, 1): ceil(log2(ratio)) is e - 1 when m == 0.5
    # (ratio is already a power of two) and e otherwise. Exact, unlike log2().
    mantissa, exponent = torch.frexp(ratio)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    scale = torch.ldexp(torch.ones_like(ratio), exponent)
    scale = torch.where(torch.isinf(ratio), ratio, scale)  # frexp(inf) is (inf, 0): keep +inf, as the kernel does
    return torch.where(amax == 0, torch.ones_like(scale), scale)


SCALE_RULES: MappingProxyType[str, Callable[[torch.Tensor], torch.Tensor]] = MappingProxyType(
    {"fp32": _fp32_scale, "ue8m0": _ue8m0_scale}
)
"""Registry: scale format name (a key of :data:`megatron_fp8.vocab.SCALE_FORMATS`) -> ``amax -> scale_inv``
(both float32, same shape)."""


def check_scale_format(scale_format: str) -> None:
    """Raise :class:`QuantInputError` listing the valid names for an unknown format."""
    if scale_format not in SCALE_RULES:
        raise QuantInputError(f"unknown scale_format {scale_format!r}; valid names: {sorted(SCALE_RULES)}")


def scale_from_amax(amax: torch.Tensor, *, scale_format: ScaleFormat = "fp32") -> torch.Tensor:
    """Turn per-block absolute maxima into ``scale_inv`` multipliers.

    Args:
        amax: float tensor of non-negative block maxima, any shape. NaN/Inf
            entries propagate (the callers check them and name the block).
        scale_format: ``"fp32"`` (``amax / 448``) or ``"ue8m0"`` (rounded up to
            a power of two).

    Returns:
        float32 tensor of ``amax``'s shape; 1.0 where ``amax == 0``.
    """
    check_scale_format(scale_format)
    return SCALE_RULES[scale_format](amax.to(torch.float32))


def is_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Elementwise: is each (positive, finite) float32 value an exact power of two."""
    mantissa, _ = torch.frexp(scale.to(torch.float32))
    return mantissa == 0.5
