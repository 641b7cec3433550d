"""Input validation and non-finite handling shared by every quantizer."""

from __future__ import annotations

import logging
import typing

import torch

from megatron_fp8.errors import NonFiniteError, QuantInputError
from megatron_fp8.quant.formats import FLOAT_INPUT_DTYPES, NonFinitePolicy, check_scale_format

logger = logging.getLogger(__name__)

NONFINITE_POLICIES: tuple[str, ...] = typing.get_args(NonFinitePolicy)
"""The values of :data:`~megatron_fp8.quant.formats.NonFinitePolicy`, for run-time checks."""


def _label(name: str | None) -> str:
    return f"tensor {name!r}" if name else "tensor"


def check_input(
    x: torch.Tensor,
    *,
    ranks: tuple[int, ...],
    what: str,
    name: str | None,
    scale_format: str,
    nonfinite: str,
) -> None:
    """Validate a quantizer's input; raise :class:`QuantInputError` naming the problem."""
    if not isinstance(x, torch.Tensor):
        raise QuantInputError(f"{what} expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_INPUT_DTYPES:
        raise QuantInputError(
            f"{what}: {_label(name)} has dtype {x.dtype}; expected one of "
            f"{[str(d) for d in FLOAT_INPUT_DTYPES]} (cast integer or FP8 tensors to bfloat16 first)"
        )
    if x.dim() not in ranks:
        raise QuantInputError(
            f"{what}: {_label(name)} has rank {x.dim()} (shape {tuple(x.shape)}); expected rank "
            f"{' or '.join(str(r) for r in ranks)}"
        )
    if x.numel() == 0:
        raise QuantInputError(f"{what}: {_label(name)} is empty (shape {tuple(x.shape)}); nothing to quantize")
    check_scale_format(scale_format)
    if nonfinite not in NONFINITE_POLICIES:
        raise QuantInputError(f"unknown nonfinite policy {nonfinite!r}; valid names: {list(NONFINITE_POLICIES)}")


def sanitize(x: torch.Tensor, *, name: str | None) -> torch.Tensor:
    """Return ``x`` with NaN and +-Inf replaced by 0 (a copy only when needed)."""
    bad = ~torch.isfinite(x)
    count = int(bad.sum())
    if count == 0:
        return x
    logger.warning("%s: replaced %d non-finite values with 0 (nonfinite='sanitize')", _label(name), count)
    return x.masked_fill(bad, 0)


def raise_on_nonfinite_amax(
    x: torch.Tensor,
    amax: torch.Tensor,
    *,
    block_size: tuple[int, ...],
    axis_names: tuple[str, ...],
    name: str | None,
    what: str,
) -> None:
    """Raise :class:`NonFiniteError` naming the first block whose amax is NaN/Inf.

    NaN and Inf propagate through ``amax``, so checking the small per-block
    maximum tensor finds them without another pass over ``x``.

    Args:
        x: the quantizer input (only read on the error path, to count elements).
        amax: per-block maxima, shape ``[..., blocks along each blocked axis]``.
        block_size: block extent along each trailing axis of ``amax``.
        axis_names: one name per axis of ``amax`` (e.g. ``("row_block", "col_block")``).
    """
    finite = torch.isfinite(amax)
    if bool(finite.all()):
        return
    first = tuple(int(i) for i in (~finite).nonzero()[0].tolist())
    lead = len(first) - len(block_size)
    ranges = []
    for axis, (idx, size) in enumerate(zip(first[lead:], block_size, strict=True)):
        dim = x.dim() - len(block_size) + axis
        lo, hi = idx * size, min((idx + 1) * size, x.shape[dim])
        ranges.append(f"dim {dim} [{lo}:{hi}]")
    where = ", ".join(f"{n}={i}" for n, i in zip(axis_names, first, strict=True))
    count = int((~torch.isfinite(x)).sum())
    raise NonFiniteError(
        f"{what}: {_label(name)} (shape {tuple(x.shape)}) has NaN/Inf in block ({where}) "
        f"covering {', '.join(ranges)}; {count} non-finite value(s) in total, "
        f"{int((~finite).sum())} block(s) affected. Nothing was quantized. Find where the "
        "weights diverged (loss scale, learning rate) or pass nonfinite='sanitize' to replace "
        "them with 0.",
        name=name,
        block=first,
    )
