"""A fused tensor as its checkpoint shards, stacked along rows without a copy.

vLLM fuses checkpoint shards into one Parameter (``q``/``k``/``v`` into ``qkv_proj``, ``gate``/``up`` into
``gate_up_proj``: this TP rank's rows of each, one after the other). Building the fused tensor with ``torch.cat``
copies every byte of the version once more where the shards live: for a version staged in host memory, on the
host's CPU, in pageable memory that then crosses to the GPU at pageable speed (the pinned staging is lost).
:class:`RowParts` stands for that concatenation: each part is copied into (:meth:`RowParts.copy_into`) or compared
with (:func:`same_rows`) its own rows of the Parameter, straight from where it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowParts:
    """``torch.cat(parts, dim=0)``, not materialized.

    Attributes:
        parts: two or more tensors of one dtype and device, equal in every dimension but the first.
    """

    parts: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2:
            raise ValueError(f"RowParts needs 2 or more parts, got {len(self.parts)} (use the tensor itself)")
        first = self.parts[0]
        for p in self.parts[1:]:
            if p.dtype != first.dtype or p.device != first.device or tuple(p.shape[1:]) != tuple(first.shape[1:]):
                raise ValueError(
                    f"RowParts: parts differ beyond their rows: {first.dtype}{list(first.shape)} on {first.device} "
                    f"and {p.dtype}{list(p.shape)} on {p.device}"
                )

    @property
    def shape(self) -> tuple[int, ...]:
        """The concatenation's shape."""
        return (sum(p.shape[0] for p in self.parts), *self.parts[0].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def dim(self) -> int:
        return self.parts[0].dim()

    def rows(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(rows of the concatenation, part)`` for each part, in order."""
        at = 0
        for p in self.parts:
            yield slice(at, at + p.shape[0]), p
            at += p.shape[0]

    def copy_into(self, dst: torch.Tensor) -> None:
        """``dst.copy_(torch.cat(parts))`` without the concatenation: each part into its rows of ``dst``.

        Raises:
            ValueError: ``dst`` has another shape.
        """
        if tuple(dst.shape) != self.shape:
            raise ValueError(f"RowParts of shape {list(self.shape)} copied into {list(dst.shape)}")
        with torch.no_grad():
            for rows, part in self.rows():
                dst[rows].copy_(part)

    def materialize(self) -> torch.Tensor:
        """The concatenation itself (for a re-quantization that needs it whole, or an error message)."""
        return torch.cat(self.parts, dim=0)


def stacked(parts: Sequence[torch.Tensor]) -> torch.Tensor | RowParts:
    """The row-concatenation of ``parts``: the tensor itself for one part, else a :class:`RowParts` (no copy)."""
    return parts[0] if len(parts) == 1 else RowParts(tuple(parts))


def materialized(t: torch.Tensor | RowParts) -> torch.Tensor:
    """``t`` as one tensor (a copy only for :class:`RowParts`)."""
    return t.materialize() if isinstance(t, RowParts) else t


def same_rows(
    held: torch.Tensor, want: torch.Tensor | RowParts, same: Callable[[torch.Tensor, torch.Tensor], bool]
) -> bool:
    """``same(held, want)``, part by part for :class:`RowParts` (``held``'s rows against each part).

    Args:
        held: what the engine holds (any strides: a transposed view is sliced by rows as it is).
        want: what it should hold.
        same: the comparison of one tensor pair (e.g. byte equality after moving ``want`` to ``held``'s device).
    """
    if not isinstance(want, RowParts):
        return same(held, want)
    return tuple(held.shape) == want.shape and all(same(held[rows], part) for rows, part in want.rows())
