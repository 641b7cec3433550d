"""Quantize-into-the-bucket stream items: a BF16 weight that the refit packer quantizes straight into its bucket.

A refit stream normally carries finished tensors: an FP8 weight quantized into its own tensors, then copied into
a bucket and probed for NaN/Inf there (three passes over the FP8 bytes). :func:`blockwise_items` yields the same
two stream items instead as *pending parts* of one :class:`BlockwiseFP8` job::

    (name, job.codes)                 # float8_e4m3fn, the weight's shape
    (name + "_scale_inv", job.scales) # float32 [ceil(N/128), ceil(K/128)]

Each part has the shape, dtype, device and byte count of the tensor it stands for, so the packer lays it out
exactly as it would lay out the finished tensor (same offsets, metadata, checksums: the wire bytes do not
change), and a stream filter that only looks at ``.dtype``/``.shape`` sees no difference. When the bucket holding
the job's first part is finished, every job of that bucket is quantized in one group
(:func:`~megatron_fp8.quant.grouped.quantize_blockwise_into`) straight into the bucket's views; a part that lands
in a later bucket is copied there from the job's own output. The job's block scales are its NaN/Inf flag (a
non-finite block gets a ``+inf`` scale): the packer probes the scales, never the FP8 bytes.

Outside a packer a part is turned into a tensor with :meth:`PendingPart.materialize`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from megatron_fp8.errors import NonFiniteError, RefitError
from megatron_fp8.layout import block_scale_shape
from megatron_fp8.quant.formats import FP8_DTYPE, ScaleFormat
from megatron_fp8.quant.grouped import BlockwiseTarget, quantize_blockwise_into
from megatron_fp8.vocab import DEFAULT_BLOCK, SCALE_SUFFIX

logger = logging.getLogger(__name__)

__all__ = ["BlockwiseFP8", "BucketJobs", "PendingPart", "blockwise_items", "blockwise_parts"]


@dataclass(frozen=True, eq=False)
class BlockwiseFP8:
    """One weight to be quantized blockwise where its parts are packed.

    Attributes:
        name: the weight's HF name (its codes travel under it, its scales under ``name + "_scale_inv"``).
        source: ``[N, K]`` or ``[E, N, K]`` bfloat16/float16/float32 weight; read when its bucket is finished, so
            the stream must not change it before then.
        block_size: ``(bn, bk)``.
        scale_format: ``"fp32"`` or ``"ue8m0"``.
    """

    name: str
    source: torch.Tensor
    block_size: tuple[int, int] = (DEFAULT_BLOCK, DEFAULT_BLOCK)
    scale_format: ScaleFormat = "fp32"
    _outputs: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _places: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def codes(self) -> PendingPart:
        """The FP8 codes part (float8_e4m3fn, ``source``'s shape)."""
        return PendingPart(self, "codes")

    @property
    def scales(self) -> PendingPart:
        """The block scales part (float32 ``[ceil(N/bn), ceil(K/bk)]``)."""
        return PendingPart(self, "scales")

    @property
    def done(self) -> bool:
        """Whether the job has been quantized (its outputs exist)."""
        return bool(self._outputs)

    def shape_of(self, kind: str) -> tuple[int, ...]:
        """Shape of the ``"codes"`` or ``"scales"`` part."""
        shape = tuple(self.source.shape)
        return shape if kind == "codes" else block_scale_shape(shape, self.block_size)

    def target(self) -> BlockwiseTarget:
        """Its :class:`BlockwiseTarget`: the placed bucket views, fresh tensors for the parts not placed (kept)."""
        out = {}
        for kind in ("codes", "scales"):
            out[kind] = self._places.get(kind)
            if out[kind] is None:
                dtype = FP8_DTYPE if kind == "codes" else torch.float32
                out[kind] = torch.empty(self.shape_of(kind), dtype=dtype, device=self._device())
            self._outputs[kind] = out[kind]
        self._places.clear()
        return BlockwiseTarget(self.source, out["codes"], out["scales"], self.name)

    def _device(self) -> torch.device:
        placed = next(iter(self._places.values()), None)
        return placed.device if placed is not None else self.source.device

    def raise_nonfinite(self, *, version: int | None) -> None:
        """Raise :class:`NonFiniteError` naming this weight and its first NaN/Inf element (reads the source)."""
        from megatron_fp8.refit.integrity.finite import check_finite

        check_finite(self.name, self.source, version=version)
        where = f" of version {version}" if version is not None else ""
        raise NonFiniteError(
            f"tensor {self.name!r}{where}: a block scale is not finite though the source reads finite (it changed "
            "while it was quantized?); refusing to refit it",
            name=self.name,
        )


@dataclass(frozen=True)
class PendingPart:
    """One part (``"codes"`` or ``"scales"``) of a :class:`BlockwiseFP8` job, standing in for a tensor in a stream.

    Attributes:
        job: the job.
        kind: ``"codes"`` or ``"scales"``.
    """

    job: BlockwiseFP8
    kind: str

    @property
    def shape(self) -> torch.Size:
        """The tensor's shape."""
        return torch.Size(self.job.shape_of(self.kind))

    @property
    def dtype(self) -> torch.dtype:
        """float8_e4m3fn (codes) or float32 (scales)."""
        return FP8_DTYPE if self.kind == "codes" else torch.float32

    @property
    def device(self) -> torch.device:
        """The source's device."""
        return self.job.source.device

    def numel(self) -> int:
        """Elements of the tensor."""
        return self.shape.numel()

    def element_size(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    def materialize(self) -> torch.Tensor:
        """The tensor itself (quantizes the job on first use, in tensors of its own)."""
        if not self.job.done:
            quantize_blockwise_into(
                [self.job.target()], block_size=self.job.block_size, scale_format=self.job.scale_format
            )
        return self.job._outputs[self.kind]


def blockwise_items(
    name: str,
    source: torch.Tensor,
    *,
    block_size: tuple[int, int] = (DEFAULT_BLOCK, DEFAULT_BLOCK),
    scale_format: ScaleFormat = "fp32",
) -> Iterator[tuple[str, PendingPart]]:
    """The two refit stream items of one weight to quantize in its bucket: codes, then scales.

    Args:
        name: HF name of the weight.
        source: the BF16 (or float16/float32) weight, ``[N, K]`` or ``[E, N, K]``.
        block_size: ``(bn, bk)``.
        scale_format: ``"fp32"`` or ``"ue8m0"``.

    Yields:
        ``(name, codes part)`` and ``(name + "_scale_inv", scales part)``.
    """
    codes, scales = blockwise_parts(name, source, block_size=block_size, scale_format=scale_format)
    yield name, codes
    yield name + SCALE_SUFFIX, scales


def blockwise_parts(
    name: str,
    source: torch.Tensor,
    *,
    block_size: tuple[int, int] = (DEFAULT_BLOCK, DEFAULT_BLOCK),
    scale_format: ScaleFormat = "fp32",
) -> tuple[PendingPart, PendingPart]:
    """The codes and scales parts of one weight to quantize in its bucket (a drop-in for a quantizer's
    ``(codes, scales)`` result, e.g. the bridge adapter's ``quant_fn``).

    Args:
        name: HF name of the weight.
        source: the BF16 (or float16/float32) weight, ``[N, K]`` or ``[E, N, K]`` (detached: a parameter's
            autograd history is not the refit's).
        block_size: ``(bn, bk)``.
        scale_format: ``"fp32"`` or ``"ue8m0"``.

    Returns:
        ``(codes part, scales part)``: float8_e4m3fn ``source``'s shape, float32 ``[ceil(N/bn), ceil(K/bk)]``.
    """
    job = BlockwiseFP8(name, source.detach(), (int(block_size[0]), int(block_size[1])), scale_format)
    return job.codes, job.scales


class BucketJobs:
    """The pending parts of one bucket being filled, and the group quantization that finishes them."""

    def __init__(self) -> None:
        self.jobs: list[BlockwiseFP8] = []

    def place(self, part: PendingPart, view: torch.Tensor) -> torch.Tensor | None:
        """Record that ``part`` goes to ``view`` (its typed, shaped place in the bucket).

        Returns:
            ``None`` when the part is written by this bucket's quantization; else (its job ran in an earlier
            bucket) the tensor to copy into ``view``.

        Raises:
            RefitError: the same part placed twice.
        """
        job = part.job
        if job.done:
            return job._outputs[part.kind]
        if part.kind in job._places:
            raise RefitError(f"the {part.kind} of {job.name!r} appear twice in one refit stream")
        if not job._places:
            self.jobs.append(job)
        job._places[part.kind] = view
        return None

    def run(self, copies: tuple[list[torch.Tensor], list[torch.Tensor]]) -> list[tuple[BlockwiseFP8, torch.Tensor]]:
        """Quantize every job of the bucket into its places, with ``copies`` in the same first multi-tensor copy.

        Returns:
            ``[(job, its scales)]``: a non-finite scale flags a NaN/Inf in the job's source.
        """
        groups: dict[tuple, list[BlockwiseTarget]] = {}
        flags = []
        for job in self.jobs:
            target = job.target()
            groups.setdefault((job.block_size, job.scale_format, target.codes.device), []).append(target)
            flags.append((job, target.scales))
        if not groups:
            if copies[0]:
                torch._foreach_copy_(copies[0], copies[1])
        for i, ((block_size, scale_format, _), targets) in enumerate(groups.items()):
            quantize_blockwise_into(
                targets, block_size=block_size, scale_format=scale_format, copies=copies if i == 0 else None
            )
        self.jobs = []
        return flags
