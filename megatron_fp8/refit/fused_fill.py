"""Fill a CUDA bucket and flag NaN/Inf in the same pass: one Triton launch per element width.

The torch path of the packer copies a bucket's plain tensors with one multi-tensor copy and then reads them
again for the NaN/Inf probe (``torch._foreach_norm``): two passes over the bytes, and the copy itself runs at
about half of the device's copy bandwidth (an H200 profile, 2026-11-26: 15.3 ms copy + 6.9 ms probe for the
16 GB Llama-3.1-8B set). :func:`fill_and_flag` does both in one pass: each program copies one chunk of one
tensor (16 KiB) with vector loads and stores and tests every element it moved against its dtype's NaN/Inf bit
pattern (:data:`PATTERNS`), raising that tensor's flag with an atomic max. The bytes written are the source's
(a copy); a flagged tensor is then named by the exact per-tensor rule
(:func:`~megatron_fp8.refit.integrity.finite.check_finite`), as the torch path does.

A launch reads an int64 table (one host -> device copy): the first chunk of each segment (a prefix sum, padded
to a power of two), then per segment its source and destination offsets from two typed base pointers, its
length, its NaN/Inf bit mask and pattern, and its flag's index. Segments whose offsets and lengths are all
multiples of 16 bytes (every tensor of a bucket laid out at 16-byte offsets with a length that is a multiple of
16 bytes) go in an ``ALIGNED`` launch whose table holds them divided by 16 bytes, so the compiler proves the
alignment and issues 16-byte accesses; the rest (alignment gaps, odd lengths) go in a plain launch.

Testing without a GPU: under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors
(``tests/refit/test_fused_fill.py`` compares bytes and flags with the torch path).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_fp8.errors import NonFiniteError, RefitError
from megatron_fp8.quant.triton_grouped import work_table
from megatron_fp8.refit.wire import DTYPES, TensorMeta

try:  # Triton is optional: the torch path runs everywhere
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install raising at import time
    triton = None
    tl = None

__all__ = ["PATTERNS", "FlagProbe", "Segment", "available", "fill_and_flag", "interpreter_active"]

PATTERNS: dict[torch.dtype, tuple[int, int]] = {
    torch.bfloat16: (0x7F80, 0x7F80),
    torch.float16: (0x7C00, 0x7C00),
    torch.float32: (0x7F800000, 0x7F800000),
    torch.float64: (0x7FF0000000000000, 0x7FF0000000000000),
    torch.float8_e4m3fn: (0x7F, 0x7F),  # NaN: 0x7f / 0xff (no Inf)
    torch.float8_e5m2: (0x7C, 0x7C),  # Inf/NaN: exponent all ones
    torch.float8_e8m0fnu: (0xFF, 0xFF),  # NaN: 0xff
}
"""dtype -> ``(mask, pattern)``: an element is NaN/Inf exactly when ``bits & mask == pattern``."""

_NEVER = (0, 1)  # bits & 0 is never 1: a segment that is copied, not probed
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK_BYTES = 16384  # bytes per program
_ROW = 6  # words per segment in the table: src, dst offsets, words, NaN/Inf mask, pattern, flag index


def available() -> bool:
    """Whether Triton imports here."""
    return triton is not None


def interpreter_active() -> bool:
    """Whether the kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1`` before import)."""
    return triton is not None and type(_fill_kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class Segment:
    """One contiguous source copied to a byte offset of the bucket.

    Attributes:
        offset: byte offset in the bucket (where the source's first byte goes).
        src: the source, contiguous, any dtype (read as raw words of its element size).
        probe: test its elements against :data:`PATTERNS` of its dtype (``False``: copy only).
    """

    offset: int
    src: torch.Tensor
    probe: bool = False


if triton is not None:
    from megatron_fp8.quant.triton_grouped import table_row

    @triton.jit
    def _fill_kernel(
        table_ptr,
        src_base,
        dst_base,
        flag_ptr,
        W_P2: tl.constexpr,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
        VEC: tl.constexpr,
    ):
        row, _, chunk = table_row(table_ptr, W_P2, ROW)
        s_off = tl.load(row)
        d_off = tl.load(row + 1)
        n = tl.load(row + 2)
        if ALIGNED:  # the table holds these divided by 16 bytes: multiplying back proves the alignment
            s_off = s_off * VEC
            d_off = d_off * VEC
            n = n * VEC
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        x = tl.load(src_base + s_off + offs, mask=inside, other=0)
        tl.store(dst_base + d_off + offs, x, mask=inside)
        bits_mask = tl.load(row + 3).to(x.dtype)
        pattern = tl.load(row + 4).to(x.dtype)
        bad = tl.max(((x & bits_mask) == pattern).to(tl.int32), axis=0)  # masked-off lanes are 0: never bad
        tl.atomic_max(flag_ptr + tl.load(row + 5), bad, mask=bad > 0)


def _launch(buffer: torch.Tensor, group: list[tuple[int, Segment]], size: int, flags: torch.Tensor) -> None:
    word = _WORDS[size]
    vec = 16 // size
    srcs = [seg.src.reshape(-1).view(word) for _, seg in group]
    src_base, dst_base = srcs[0], buffer[: buffer.numel() // size * size].view(word)
    rows: list[list[int]] = []
    starts: list[int] = []
    chunk = _CHUNK_BYTES // size
    total = 0
    for (index, seg), src in zip(group, srcs, strict=True):
        delta = src.data_ptr() - src_base.data_ptr()
        if delta % size:
            raise RefitError(
                f"fill_and_flag: segment {index} ({seg.src.dtype} at bucket offset {seg.offset}) starts at an address "
                f"that is not a multiple of its {size}-byte elements; pass a contiguous copy of it"
            )
        mask, pattern = PATTERNS.get(seg.src.dtype, _NEVER) if seg.probe else _NEVER
        rows.append([delta // size, seg.offset // size, src.numel(), mask, pattern, index])
        starts.append(total)
        total += math.ceil(src.numel() / chunk)
    if total == 0:
        return
    aligned = (
        src_base.data_ptr() % 16 == 0
        and dst_base.data_ptr() % 16 == 0
        and all(r[0] % vec == 0 and r[1] % vec == 0 and r[2] % vec == 0 for r in rows)
    )
    if aligned:
        rows = [[r[0] // vec, r[1] // vec, r[2] // vec, *r[3:]] for r in rows]
    table, w_p2 = work_table(starts, rows, buffer.device)
    _fill_kernel[(total,)](table, src_base, dst_base, flags, W_P2=w_p2, ROW=_ROW, BLOCK=chunk, ALIGNED=aligned, VEC=vec)


def fill_and_flag(buffer: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
    """Copy every segment's source into ``buffer`` at its offset; flag the probed ones holding NaN/Inf.

    Args:
        buffer: the bucket, 1-D uint8, on the sources' device; its size a multiple of 8 bytes.
        segments: what goes where (:class:`Segment`); ``offset`` must be a multiple of the source's element size.

    Returns:
        int32 ``[len(segments)]`` on the buffer's device: 1 where a probed segment holds a NaN/Inf, else 0
        (nothing is read back here: no host sync).

    Raises:
        RefitError: Triton missing, a non-contiguous source, an offset not aligned to its element size, or a
            segment outside the buffer.
    """
    if triton is None:
        raise RefitError("fill_and_flag needs Triton; the packer uses its torch path without it")
    flags = torch.zeros(len(segments), dtype=torch.int32, device=buffer.device)
    groups: dict[tuple[int, bool], list[tuple[int, Segment]]] = {}
    segments = _on_device(buffer, segments)
    for i, seg in enumerate(segments):
        size = seg.src.element_size()
        nbytes = seg.src.numel() * size
        if not seg.src.is_contiguous() or seg.offset % size or seg.offset + nbytes > buffer.numel():
            raise RefitError(
                f"fill_and_flag: segment {i} ({seg.src.dtype}, {nbytes} bytes at offset {seg.offset}) must be "
                f"contiguous, aligned to its {size}-byte elements and inside the {buffer.numel()}-byte bucket"
            )
        if nbytes:
            whole = seg.offset % 16 == 0 and nbytes % 16 == 0
            groups.setdefault((size, whole), []).append((i, seg))
    for (size, _), group in groups.items():
        _launch(buffer, group, size, flags)
    return flags


def _on_device(buffer: torch.Tensor, segments: Sequence[Segment]) -> list[Segment]:
    """Segments whose source lives on another device (host memory) are copied into the bucket first (one
    multi-tensor copy) and then pass through the kernel from their place in the bucket (a copy onto itself, for the
    flags): the kernel only reads device memory."""
    out = list(segments)
    moved = [i for i, seg in enumerate(out) if seg.src.device != buffer.device and seg.src.numel()]
    if not moved:
        return out
    dst, src = [], []
    for i in moved:
        seg = out[i]
        nbytes = seg.src.numel() * seg.src.element_size()
        place = buffer[seg.offset : seg.offset + nbytes]
        dst.append(place)
        src.append(seg.src.reshape(-1).view(torch.uint8))
        out[i] = Segment(seg.offset, place.view(seg.src.dtype), seg.probe)
    torch._foreach_copy_(dst, src)
    return out


class FlagProbe:
    """The NaN/Inf verdict of a :func:`fill_and_flag` pass, read with the bucket's one host read.

    Args:
        entries: the metadata record of each segment's tensor, in the order given to :func:`fill_and_flag`
            (``None`` for a segment that was not probed: a part, an alignment gap).
        buffer: the bucket (a flagged tensor is read back from it by its record).
        flags: :func:`fill_and_flag`'s result.
    """

    def __init__(self, entries: Sequence[TensorMeta | None], buffer: torch.Tensor, flags: torch.Tensor):
        self.entries = list(entries)
        self.buffer = buffer
        self.values = flags

    def check(self, host_flags: np.ndarray, *, version: int | None = None) -> None:
        """Raise for the first flagged tensor (in stream order), naming it and its first bad element.

        Raises:
            NonFiniteError: as :func:`~megatron_fp8.refit.integrity.finite.check_finite`.
        """
        from megatron_fp8.refit.integrity.finite import check_finite

        for i in np.flatnonzero(np.asarray(host_flags) > 0).tolist():
            m = self.entries[i]
            if m is None:
                continue
            tensor = self.buffer[m.offset : m.offset + m.nbytes].view(DTYPES[m.dtype]).view(m.shape)
            check_finite(m.name, tensor, version=version)
            where = f" of version {version}" if version is not None else ""
            raise NonFiniteError(
                f"tensor {m.name!r}{where}: the bucket's NaN/Inf pass flagged it but it reads finite now (it changed "
                "while it was copied?); refusing to refit it",
                name=m.name,
            )
