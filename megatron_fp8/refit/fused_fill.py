"""Grouped byte passes over many tensors on CUDA: one Triton launch per element width, whatever the tensor count.

The kernel reads a table of segments (one per tensor) and runs in one of three modes:

* **fill** (:func:`fill_and_flag`): copy a bucket's plain tensors to their offsets and flag NaN/Inf in the same
  pass. The torch path of the packer copies with one multi-tensor copy and then reads the bytes again for the
  NaN/Inf probe (``torch._foreach_norm``): two passes, and the copy itself runs at about half of the device's copy
  bandwidth (an H200 profile, 2026-11-26: 15.3 ms copy + 6.9 ms probe for the 16 GB Llama-3.1-8B set).
  :func:`copy_many` is the same copy between any two lists of tensors (the appliers' snapshot and write);
* **compare** (:func:`compare_many`): one read of two lists of tensors, a flag per pair whose bytes differ (the
  appliers' read-back, where torch needs two concatenations, a comparison and a reduction);
* **probe** (:func:`probe_many`): one read, a flag per tensor holding a NaN/Inf bit pattern of its dtype
  (:data:`PATTERNS`; torch needs two reductions over an FP8 tensor's bytes).

Each program handles one chunk of one tensor (16 KiB) with vector loads and stores and raises its tensor's flag
with an atomic max; the bytes written are the source's (a copy). A flagged tensor is then named by the exact
per-tensor rule (:func:`~megatron_fp8.refit.integrity.finite.check_finite`), as the torch path does.

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

import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.quant.triton_grouped import work_table

try:  # Triton is optional: the torch path runs everywhere
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install raising at import time
    triton = None
    tl = None

__all__ = [
    "PATTERNS",
    "Segment",
    "available",
    "compare_many",
    "copy_many",
    "fill_and_flag",
    "interpreter_active",
    "probe_many",
    "runs_on",
]

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
        MODE: tl.constexpr,
    ):
        # MODE: _COPY (copy src -> dst and flag src's NaN/Inf patterns), _COMPARE (flag a segment whose src and dst
        # words differ; nothing written), _PROBE (flag src's NaN/Inf patterns; dst unused, nothing written)
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
        if MODE == 1:
            y = tl.load(dst_base + d_off + offs, mask=inside, other=0)
            bad = tl.max((x != y).to(tl.int32), axis=0)  # masked-off lanes are 0 on both sides: never bad
        else:
            if MODE == 0:
                tl.store(dst_base + d_off + offs, x, mask=inside)
            bits_mask = tl.load(row + 3).to(x.dtype)
            pattern = tl.load(row + 4).to(x.dtype)
            bad = tl.max(((x & bits_mask) == pattern).to(tl.int32), axis=0)  # masked-off lanes are 0: never bad
        tl.atomic_max(flag_ptr + tl.load(row + 5), bad, mask=bad > 0)


def _launch(buffer: torch.Tensor, group: list[tuple[int, Segment]], size: int, flags: torch.Tensor) -> None:
    """One fill launch over the segments of one element size: every segment addressed by its data pointer and its
    offset in the bucket (no tensor op per segment: a view costs the host a dispatch, ~2-3 us on a GPU machine)."""
    word = _WORDS[size]
    src_base = group[0][1].src.detach().reshape(-1).view(word)
    dst_base = buffer[: buffer.numel() // size * size].view(word)
    at = buffer.data_ptr()
    items = []
    for index, seg in group:
        mask, pattern = PATTERNS.get(seg.src.dtype, _NEVER) if seg.probe else _NEVER
        items.append((index, seg.src.data_ptr(), at + seg.offset, seg.src.numel(), mask, pattern))
    _launch_items(items, src_base, dst_base, size, flags, _COPY, what="fill_and_flag")


_COPY, _COMPARE, _PROBE = 0, 1, 2
"""The kernel's modes (its ``MODE`` constexpr)."""


def _launch_items(
    items: list[tuple[int, int, int, int, int, int]],
    src_base: torch.Tensor,
    dst_base: torch.Tensor,
    size: int,
    flags: torch.Tensor,
    mode: int,
    *,
    what: str,
) -> None:
    """One launch over ``items``: ``(flag index, source address, destination address, words, NaN/Inf mask,
    pattern)``, every source and destination addressed as an element offset from its base (``src_base`` and
    ``dst_base``: 1-D tensors of ``size``-byte words; a probe passes its source twice)."""
    vec = 16 // size
    chunk = _CHUNK_BYTES // size
    rows: list[list[int]] = []
    starts: list[int] = []
    total = 0
    src0, dst0 = src_base.data_ptr(), dst_base.data_ptr()
    for index, src, dst, n, mask, pattern in items:
        deltas = (src - src0, dst - dst0)
        if deltas[0] % size or deltas[1] % size:
            raise RefitError(
                f"{what}: tensor {index} ({n} {size}-byte words) starts at an address that is not a multiple "
                f"of its {size}-byte elements from the others'; pass a contiguous copy of it"
            )
        rows.append([deltas[0] // size, deltas[1] // size, n, mask, pattern, index])
        starts.append(total)
        total += math.ceil(n / chunk)
    if total == 0:
        return
    aligned = (
        src_base.data_ptr() % 16 == 0
        and dst_base.data_ptr() % 16 == 0
        and all(r[0] % vec == 0 and r[1] % vec == 0 and r[2] % vec == 0 for r in rows)
    )
    if aligned:
        rows = [[r[0] // vec, r[1] // vec, r[2] // vec, *r[3:]] for r in rows]
    table, w_p2 = work_table(starts, rows, src_base.device)
    _fill_kernel[(total,)](table, src_base, dst_base, flags, W_P2=w_p2, ROW=_ROW, BLOCK=chunk, ALIGNED=aligned,
                           VEC=vec, MODE=mode)  # fmt: skip


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


def _many(
    mode: int, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor] | None, *, what: str
) -> tuple[torch.Tensor, int]:
    """Launch ``mode`` over tensors (and their partners), one launch per (element size, 16-byte alignment).

    Returns:
        ``(flags, launches)``: int32 flags ``[len(srcs)]`` on the tensors' device, and the number of launches.
    """
    if triton is None:
        raise RefitError(f"{what} needs Triton")
    if dsts is not None and len(dsts) != len(srcs):
        raise RefitError(f"{what}: {len(srcs)} sources but {len(dsts)} destinations")
    first = next((t for t in srcs if t.numel()), None)
    device = first.device if first is not None else None
    where = first.get_device() if first is not None else -1  # an int per tensor: no torch.device built per check
    flags = torch.zeros(len(srcs), dtype=torch.int32, device=device if device is not None else "cpu")
    groups: dict[tuple[int, bool], list[tuple[int, int, int, int, int, int]]] = {}  # the launches' items
    bases: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor | None]] = {}  # each launch's first pair
    for i, src in enumerate(srcs):  # the host's loop over a version's tensors: a handful of attribute reads each
        dst = dsts[i] if dsts is not None else None
        size = src.element_size()
        n = src.numel()
        if n == 0:
            continue
        ptr = src.data_ptr()
        to = ptr if dst is None else dst.data_ptr()
        if not (src.is_contiguous() and src.get_device() == where) or (
            dst is not None
            and not (
                dst.is_contiguous() and dst.get_device() == where and dst.element_size() == size and dst.numel() == n
            )
        ):
            raise RefitError(
                f"{what}: tensor {i} ({src.dtype} {tuple(src.shape)}"
                + ("" if dst is None else f" and {dst.dtype} {tuple(dst.shape)}")
                + f") must be contiguous, on {device}, with one element size and count per pair"
            )
        key = (size, (n * size) % 16 == 0 and ptr % 16 == 0 and to % 16 == 0)
        mask, pattern = PATTERNS.get(src.dtype, _NEVER) if mode == _PROBE else _NEVER
        groups.setdefault(key, []).append((i, ptr, to, n, mask, pattern))
        bases.setdefault(key, (src, dst))
    for (size, whole), items in groups.items():
        word = _WORDS[size]
        first, first_dst = bases[size, whole]
        src_base = first.detach().reshape(-1).view(word)
        dst_base = src_base if first_dst is None else first_dst.detach().reshape(-1).view(word)
        _launch_items(items, src_base, dst_base, size, flags, mode, what=what)
    return flags, len(groups)


def copy_many(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> int:
    """``targets[i].copy_(sources[i])`` for every ``i``, bytes as they are: one launch per element width.

    Args:
        targets: contiguous tensors on one device (the tensors of any dtype; written).
        sources: contiguous tensors on the same device, each with its target's element size and count.

    Returns:
        The number of launches (no host sync).

    Raises:
        RefitError: Triton missing, or a pair that is not contiguous, on the device, or alike in size.
    """
    return _many(_COPY, sources, targets, what="copy_many")[1]


def compare_many(held: Sequence[torch.Tensor], sent: Sequence[torch.Tensor]) -> torch.Tensor:
    """Which ``held[i]`` differ from ``sent[i]`` in any byte: one read of both, one launch per element width.

    Args:
        held: contiguous tensors on one device.
        sent: contiguous tensors on the same device, each with its partner's element size and count.

    Returns:
        int32 ``[len(held)]`` on the device: 1 where the bytes differ, else 0 (nothing read back: no host sync).

    Raises:
        RefitError: as :func:`copy_many`.
    """
    return _many(_COMPARE, sent, held, what="compare_many")[0]


def probe_many(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Which tensors hold a NaN/Inf bit pattern of their dtype (:data:`PATTERNS`): one read, one launch per width.

    Args:
        tensors: contiguous tensors on one device; dtypes without a pattern (integers, bool, the fnuz formats) are
            never flagged, so check those another way.

    Returns:
        int32 ``[len(tensors)]`` on the device: 1 where a tensor holds NaN/Inf, else 0 (no host sync).

    Raises:
        RefitError: Triton missing, or a tensor that is not contiguous or not on the first one's device.
    """
    return _many(_PROBE, tensors, None, what="probe_many")[0]


_FORCE_ON_CPU = False
"""Tests only: let :func:`runs_on` take CPU tensors too while the kernel runs in Triton's CPU interpreter."""


def runs_on(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the appliers' copies, read-backs and NaN/Inf probes take the many-tensor passes for these tensors:
    Triton present and every one contiguous on one CUDA device (or, in tests, on CPU under the interpreter)."""
    if triton is None or not tensors:
        return False
    device = tensors[0].device
    on = device.type == "cuda" or (_FORCE_ON_CPU and device.type == "cpu" and interpreter_active())
    where = tensors[0].get_device()  # an int per tensor below: no torch.device built per check
    return on and all(t.get_device() == where and t.is_contiguous() for t in tensors)


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
        src.append(seg.src.detach().reshape(-1).view(torch.uint8))
        out[i] = Segment(seg.offset, place.view(seg.src.dtype), seg.probe)
    torch._foreach_copy_(dst, src)
    return out
