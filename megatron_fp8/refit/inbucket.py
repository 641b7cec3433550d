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

import numpy as np
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
    _outputs: dict[str, torch.Tensor | tuple[torch.Tensor, int]] = field(default_factory=dict, repr=False)
    _places: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict, repr=False)  # kind -> (bucket, offset)
    _sizes: dict[str, torch.Size] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:  # the parts' shapes, computed once (the packer asks for them several times)
        shape = tuple(self.source.shape)
        self._sizes["codes"] = torch.Size(shape)
        self._sizes["scales"] = torch.Size(block_scale_shape(shape, self.block_size))

    @property
    def codes(self) -> PendingPart:
        """The FP8 codes part (float8_e4m3fn, ``source``'s shape)."""
        return PendingPart(self, "codes")

    @property
    def scales(self) -> PendingPart:
        """The block scales part (float32 ``[ceil(N/bn), ceil(K/bk)]``)."""
        return PendingPart(self, "scales")

    def output(self, kind: str) -> torch.Tensor:
        """The quantized ``"codes"`` or ``"scales"`` (a view of the bucket it was quantized into, or its own tensor)."""
        out = self._outputs[kind]
        if isinstance(out, tuple):  # (bucket, byte offset) of the grouped launch
            buffer, offset = out
            dtype = FP8_DTYPE if kind == "codes" else torch.float32
            out = (
                buffer[offset : offset + self._sizes[kind].numel() * dtype.itemsize].view(dtype).view(self._sizes[kind])
            )
            self._outputs[kind] = out
        return out

    @property
    def done(self) -> bool:
        """Whether the job has been quantized (its outputs exist)."""
        return bool(self._outputs)

    def shape_of(self, kind: str) -> torch.Size:
        """Shape of the ``"codes"`` or ``"scales"`` part."""
        return self._sizes[kind]

    def target(self) -> BlockwiseTarget:
        """Its :class:`BlockwiseTarget`: views of its places in the bucket, fresh tensors for the parts not placed
        (kept, for the bucket that holds them)."""
        out = {}
        for kind in ("codes", "scales"):
            dtype = FP8_DTYPE if kind == "codes" else torch.float32
            place = self._places.get(kind)
            if place is None:
                out[kind] = torch.empty(self._sizes[kind], dtype=dtype, device=self._device())
            else:
                buffer, offset = place
                nbytes = self._sizes[kind].numel() * dtype.itemsize
                out[kind] = buffer[offset : offset + nbytes].view(dtype).view(self._sizes[kind])
            self._outputs[kind] = out[kind]
        self._places.clear()
        return BlockwiseTarget(self.source, out["codes"], out["scales"], self.name)

    def _device(self) -> torch.device:
        placed = next(iter(self._places.values()), None)
        return placed[0].device if placed is not None else self.source.device

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
        return self.job._sizes[self.kind]

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
        return self.job.output(self.kind)


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

    def place(self, part: PendingPart, buffer: torch.Tensor, offset: int) -> torch.Tensor | None:
        """Record that ``part`` goes to byte ``offset`` of the bucket ``buffer`` (1-D uint8).

        Returns:
            ``None`` when the part is written by this bucket's quantization; else (its job ran in an earlier
            bucket) the tensor to copy there.

        Raises:
            RefitError: the same part placed twice.
        """
        job = part.job
        if job.done:
            return job.output(part.kind)
        if part.kind in job._places:
            raise RefitError(f"the {part.kind} of {job.name!r} appear twice in one refit stream")
        if not job._places:
            self.jobs.append(job)
        job._places[part.kind] = (buffer, offset)
        return None

    def run(self, copies: tuple[list[torch.Tensor], list[torch.Tensor]], *, fused: bool = False) -> list:
        """Quantize every job of the bucket into its places, with ``copies`` in the same first multi-tensor copy.

        Args:
            copies: ``(dst, src)`` tensors to copy as well (the torch path's plain tensors).
            fused: the bucket is filled by the CUDA fused path: jobs whose two parts both lie in this bucket go
                through one grouped Triton launch per (block size, scale format) that reads offsets of the bucket
                and raises one NaN/Inf flag per job (:func:`~megatron_fp8.quant.triton_grouped.launch_into_bucket`).

        Returns:
            Verdicts: objects with ``tensors`` (int32 tensors to read with the bucket's host read) and
            ``check(host_int32, version=...)`` (their values, in that order), raising :class:`NonFiniteError` for
            a job whose source holds NaN/Inf.
        """
        verdicts: list = []
        rest = self.jobs
        if fused:
            from megatron_fp8.quant.triton_grouped import launch_into_bucket

            whole = [j for j in self.jobs if len(j._places) == 2 and _fast_source(j.source)]
            rest = [j for j in self.jobs if not (len(j._places) == 2 and _fast_source(j.source))]
            groups: dict[tuple, list[BlockwiseFP8]] = {}
            for job in whole:
                groups.setdefault((job.block_size, job.scale_format, job.source.dtype), []).append(job)
            for (block_size, scale_format, _), jobs in groups.items():
                buffer = jobs[0]._places["codes"][0]
                items = [(j.source, j._places["codes"][1], j._places["scales"][1]) for j in jobs]
                flags = launch_into_bucket(buffer, items, block_size, scale_format)
                for j in jobs:  # outputs as (bucket, offset): a view is made only if one is asked for
                    j._outputs.update(j._places)
                    j._places.clear()
                verdicts.append(_FlagVerdict(jobs, flags))
        groups_t: dict[tuple, list[BlockwiseTarget]] = {}
        pairs = []
        for job in rest:
            target = job.target()
            groups_t.setdefault((job.block_size, job.scale_format, target.codes.device), []).append(target)
            pairs.append((job, target.scales))
        if not groups_t and copies[0]:
            torch._foreach_copy_(copies[0], copies[1])
        for i, ((block_size, scale_format, _), targets) in enumerate(groups_t.items()):
            quantize_blockwise_into(
                targets, block_size=block_size, scale_format=scale_format, copies=copies if i == 0 else None
            )
        if pairs:
            verdicts.append(_ScaleVerdict(pairs))
        self.jobs = []
        return verdicts


def _fast_source(x: torch.Tensor) -> bool:
    return x.dim() in (2, 3) and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.is_contiguous()


class _FlagVerdict:
    """One NaN/Inf flag per job (int32, 1 where a block's amax was not finite), from the grouped launch."""

    def __init__(self, jobs: list[BlockwiseFP8], flags: torch.Tensor):
        self.jobs, self.tensors = jobs, [flags]

    def check(self, host: np.ndarray, *, version: int | None) -> None:
        for i in np.flatnonzero(host > 0).tolist():
            self.jobs[i].raise_nonfinite(version=version)


class _ScaleVerdict:
    """The jobs' block scales themselves (a non-finite scale flags a NaN/Inf in its block), read as int32 bits."""

    def __init__(self, pairs: list[tuple[BlockwiseFP8, torch.Tensor]]):
        self.pairs = pairs
        self.tensors = [s.reshape(-1).view(torch.int32) for _, s in pairs]

    def check(self, host: np.ndarray, *, version: int | None) -> None:
        at = 0
        scales = host.astype(np.int32).view(np.float32)
        for job, s in self.pairs:
            if not np.isfinite(scales[at : at + s.numel()]).all():
                job.raise_nonfinite(version=version)
            at += s.numel()
