"""One Triton launch for a whole group of weights: blockwise FP8 of every weight of a refit bucket.

:func:`launch_blockwise_grouped` quantizes many weights with the tile code of
:mod:`megatron_fp8.quant.triton_kernels` (the same rule, step by step: the same bytes) in **one** launch over
the group's tiles, instead of one launch per weight. Launching is the host's cost (each Triton launch is tens of
microseconds of Python; a Llama-3.1-8B refit quantizes 224 weights), and a GPU waiting on the host is idle.

The launch reads a small int64 table (one host -> device copy of ``16 + 7 * W`` words): the first tile of
each weight (a prefix sum, padded to a power of two), then per weight the offsets of its source, codes and
scales from three typed base pointers (the group's first tensors) and its ``N, K, NB, KB``. A program finds its
weight with one vector compare of the prefix sum, then handles one ``bn x bk`` tile exactly as
``_blockwise_kernel`` does. Offsets from a base pointer, not raw addresses cast to pointers: the compiler
keeps the base pointers' 16-byte alignment, and when every offset and ``K`` of the group are multiples of 16
bytes the table stores them divided by 16 (``ALIGNED``), so the compiler can prove the alignment of every row
and issue vector loads and stores; any other group runs the same kernel without that promise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_fp8.errors import QuantInputError
from megatron_fp8.layout import ceil_div
from megatron_fp8.quant.formats import FP8_DTYPE
from megatron_fp8.quant.triton_kernels import _default_num_warps, _kernels, _next_pow2, tl, triton

__all__ = ["GroupedItem", "launch_blockwise_grouped", "launch_into_bucket", "table_row", "whole_tiles", "work_table"]

_ROW = 7  # words per weight in the quantizer's table: x, q, s offsets, N, K, NB, KB
_MIN_W_P2 = 16  # the prefix sum is padded to at least this many words (fewer compiled variants)
_PAD_START = 1 << 62  # a padded prefix-sum word: no program's tile index reaches it
_CHUNKS = (1, 2, 4, 8)
"""Row bands a grouped program may read its tile in (``chunks``)."""
_DIVISIONS = {"rn": 0, "reciprocal": 1, "reciprocal_noselect": 2, "reciprocal_only": 3}
"""``division`` -> the kernels' ``RECIP`` constexpr (``triton_kernels._divide_by_scale``)."""


def work_table(starts: list[int], rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, int]:
    """The table a grouped launch reads (this quantizer's, and ``refit/fused_fill.py``'s copy-and-probe kernel).

    Args:
        starts: per item, the index of its first program (a prefix sum of the programs per item).
        rows: per item, its words (the same count for every item; :func:`table_row` reads them).
        device: where the kernel runs (the copy is non-blocking).

    Returns:
        ``(table, W_P2)``: int64 ``[W_P2 + len(rows) * row_words]``, the prefix sum padded to ``W_P2`` (a power of
        two, at least 16) with a start no program reaches, then the rows; ``W_P2`` is the kernel's constexpr.
    """
    w_p2 = max(_MIN_W_P2, _next_pow2(len(rows)))
    words = starts + [_PAD_START] * (w_p2 - len(starts)) + [v for r in rows for v in r]
    return torch.tensor(words, dtype=torch.int64).to(device, non_blocking=True), w_p2


_X_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@dataclass(frozen=True)
class GroupedItem:
    """One weight of a grouped launch.

    Attributes:
        x3: contiguous ``[E, N, K]`` source (every item of a launch has the same dtype).
        q: contiguous output with ``E * N * K`` elements: float8_e4m3fn, or float32 with ``fp8_out=False``.
        scales: contiguous float32 output with ``E * ceil(N/bn) * ceil(K/bk)`` elements.
    """

    x3: torch.Tensor
    q: torch.Tensor
    scales: torch.Tensor


if triton is not None:
    from megatron_fp8.quant.triton_kernels import _load_tile, _quantize_tile, _scale_from_amax, _store_codes, _tile_amax

    @triton.jit
    def table_row(table_ptr, W_P2: tl.constexpr, ROW: tl.constexpr):
        """This program's item in a :func:`work_table`: (pointer to its row, item index, program index within it)."""
        p = tl.program_id(0).to(tl.int64)
        starts = tl.load(table_ptr + tl.arange(0, W_P2))
        w = tl.sum((starts <= p).to(tl.int32), axis=0) - 1
        return table_ptr + W_P2 + w * ROW, w, p - tl.load(table_ptr + w)

    @triton.jit
    def _band(i, pid_n, expert, n, k, cols, col_ok, BN: tl.constexpr, ROWS: tl.constexpr):
        # band i (ROWS rows) of the tile in block row pid_n of stack entry `expert`: its element offsets and mask
        r = i * ROWS + tl.arange(0, ROWS)
        rows = pid_n * BN + r
        mask = ((r < BN) & (rows < n))[:, None] & col_ok[None, :]
        return (expert * n * k + rows * k)[:, None] + cols[None, :], mask

    @triton.jit
    def _grouped_blockwise_kernel(
        table_ptr,
        x_base,
        q_base,
        s_base,
        flag_ptr,
        W_P2: tl.constexpr,
        ROW: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        BN_P2: tl.constexpr,
        BK_P2: tl.constexpr,
        UE8M0: tl.constexpr,
        FP8_OUT: tl.constexpr,
        ALIGNED: tl.constexpr,
        X_UNIT: tl.constexpr,
        Q_UNIT: tl.constexpr,
        FLAGS: tl.constexpr,
        RECIP: tl.constexpr,
        CLAMP: tl.constexpr,
        AMAX_BITS: tl.constexpr,
        WHOLE: tl.constexpr,
        CHUNKS: tl.constexpr,
    ):
        row, w, t = table_row(table_ptr, W_P2, ROW)  # t: the tile's index within its weight, [E, NB, KB] row-major
        x_off = tl.load(row)
        q_off = tl.load(row + 1)
        s_off = tl.load(row + 2)
        n = tl.load(row + 3)
        k = tl.load(row + 4)
        nb = tl.load(row + 5)
        kb_count = tl.load(row + 6)
        if ALIGNED:  # the table holds these divided by 16 bytes: multiplying back proves the alignment
            x_off = x_off * X_UNIT
            q_off = q_off * Q_UNIT
            k = k * 16
        tiles = nb * kb_count
        expert = t // tiles
        rem = t - expert * tiles
        pid_n = rem // kb_count
        kb = rem - pid_n * kb_count
        c = tl.arange(0, BK_P2)
        cols = kb * BK + c
        col_ok = (c < BK) & (cols < k)
        if CHUNKS == 1:  # the whole tile in registers from its load to its store
            offs, mask = _band(0, pid_n, expert, n, k, cols, col_ok, BN, BN_P2)
            scale, amax = _quantize_tile(x_base + x_off + offs, q_base + q_off + offs, mask, UE8M0, FP8_OUT, RECIP,
                                         CLAMP, AMAX_BITS, not WHOLE)  # fmt: skip
        else:  # CHUNKS row bands: the amax band by band, then each band read again (from cache) and quantized
            amax = 0.0
            for i in range(CHUNKS):
                offs, mask = _band(i, pid_n, expert, n, k, cols, col_ok, BN, BN_P2 // CHUNKS)
                amax = tl.maximum(amax, _tile_amax(_load_tile(x_base + x_off + offs, mask, not WHOLE), AMAX_BITS))
            scale = _scale_from_amax(amax, UE8M0)
            for i in range(CHUNKS):
                offs, mask = _band(i, pid_n, expert, n, k, cols, col_ok, BN, BN_P2 // CHUNKS)
                raw = _load_tile(x_base + x_off + offs, mask, not WHOLE)
                _store_codes(q_base + q_off + offs, raw, scale, mask, FP8_OUT, RECIP, CLAMP, not WHOLE)
        tl.store(s_base + s_off + t, scale)
        if FLAGS:  # one NaN/Inf flag per weight: amax is +inf exactly when the tile holds NaN/Inf
            bad = (amax == float("inf")).to(tl.int32)
            tl.atomic_max(flag_ptr + w, bad, mask=bad > 0)


def _offset(t: torch.Tensor, base: torch.Tensor) -> int:
    """Elements from ``base``'s first element to ``t``'s (same dtype; may be negative)."""
    delta = t.data_ptr() - base.data_ptr()
    size = t.element_size()
    if delta % size:
        raise QuantInputError(f"launch_blockwise_grouped: a {t.dtype} tensor is not aligned to its element size")
    return delta // size


def launch_blockwise_grouped(
    items: Sequence[GroupedItem],
    bn: int,
    bk: int,
    scale_format: str,
    *,
    fp8_out: bool = True,
    num_warps: int | None = None,
    division: str = "reciprocal",
    clamp: bool = True,
    amax_bits: bool = False,
    unmasked: bool = False,
    chunks: int = 1,
) -> None:
    """Quantize every item blockwise in one launch (no validation of values, no sync).

    Args:
        items: the weights and their outputs (:class:`GroupedItem`); one source dtype, one output dtype.
        bn: block rows (along N).
        bk: block columns (along K).
        scale_format: ``"fp32"`` or ``"ue8m0"``.
        fp8_out: ``True``: the kernel casts to float8_e4m3fn; ``False``: it stores the clamped float32 quotient
            (Triton's CPU interpreter, whose fp8 cast is inexact).
        num_warps: warps per program; ``None`` picks from the tile size.
        division: how ``x / scale`` is computed, with the same codes either way: ``"reciprocal"`` (the tile's
            correctly rounded reciprocal and one fma correction, see ``RECIP_MIN_SCALE``), ``"reciprocal_noselect"``
            (the same with the remainder negated: the same quotient bits without the select that keeps -0.0, two
            instructions per element fewer), ``"reciprocal_only"`` (that arithmetic for every tile: a tile under
            ``RECIP_MIN_SCALE`` is lifted by 2**64 first, an infinite scale gives ``x * 0``; no per-element division
            is compiled in, 40% of the kernel's code) or ``"rn"`` (an IEEE division per element, the
            reference the benchmark compares against).
        clamp: clamp the quotient to +-448 before the cast (the default). ``False`` gives the same codes for
            every finite tile (two instructions per element fewer; ``bench/quant.py`` times both); a tile holding
            NaN/Inf, which every caller refuses, then gets NaN codes instead of +-448.
        amax_bits: take each tile's amax from the elements' bit patterns (an integer AND and max per element
            instead of abs, a NaN test, a select and a float max): the same amax, so the same bytes.
        unmasked: when every tile of the group is whole (``N % bn == K % bk == 0`` for every item, ``bn``, ``bk``
            powers of two), load and store without masks; other groups keep them. The same bytes.
        chunks: ``1``: each program holds its whole tile in registers from load to store; ``2``, ``4`` or ``8``: it
            reads the tile in that many row bands twice (the amax band by band, then each band again, from cache, to
            quantize it), holding a band at a time: fewer registers per thread, more programs per SM. The same amax,
            so the same bytes.

    Raises:
        QuantInputError: mixed source dtypes, a wrong output dtype/size, or a non-contiguous tensor.
    """
    if division not in _DIVISIONS:
        raise QuantInputError(
            f"launch_blockwise_grouped: division must be one of {tuple(_DIVISIONS)}, got {division!r}"
        )
    if not items:
        return
    kernel = _grouped_kernel()
    x_base, q_base, s_base = items[0].x3, items[0].q, items[0].scales
    q_dtype = FP8_DTYPE if fp8_out else torch.float32
    x_kind = _X_KINDS.get(x_base.dtype)
    starts: list[int] = []
    rows: list[list[int]] = []
    total = 0
    for it in items:
        e, n, k = it.x3.shape
        nb, kb = ceil_div(n, bn), ceil_div(k, bk)
        if (
            it.x3.dtype != x_base.dtype
            or x_kind is None
            or it.q.dtype != q_dtype
            or it.q.numel() != e * n * k
            or it.scales.dtype != torch.float32
            or it.scales.numel() != e * nb * kb
            or not (it.x3.is_contiguous() and it.q.is_contiguous() and it.scales.is_contiguous())
        ):
            raise QuantInputError(
                f"launch_blockwise_grouped: every item needs a contiguous {x_base.dtype} source (bfloat16, float16 "
                f"or float32), a contiguous {q_dtype} output of the source's size and contiguous float32 scales "
                f"[E, ceil(N/{bn}), ceil(K/{bk})]; got {it.x3.dtype} {tuple(it.x3.shape)} -> {it.q.dtype} "
                f"{it.q.numel()} elements, {it.scales.dtype} {it.scales.numel()} elements"
            )
        starts.append(total)
        total += e * nb * kb
        rows.append([_offset(it.x3, x_base), _offset(it.q, q_base), _offset(it.scales, s_base), n, k, nb, kb])
    if total == 0:
        return
    _launch_table(kernel, starts, rows, total, (x_base, q_base, s_base), None, bn=bn, bk=bk,
                  scale_format=scale_format, fp8_out=fp8_out, num_warps=num_warps, division=division,
                  clamp=clamp, amax_bits=amax_bits, unmasked=unmasked, chunks=chunks)  # fmt: skip


def whole_tiles(shapes: Sequence[tuple[int, int]], bn: int, bk: int) -> bool:
    """Whether every ``bn x bk`` tile of every ``(N, K)`` is whole: the unmasked kernel may run on such a group.

    A tile is whole when ``N % bn == 0`` and ``K % bk == 0``, and the kernel's tile is the block itself when
    ``bn`` and ``bk`` are powers of two (otherwise it is padded to the next one, and masked).
    """
    pow2 = bn == _next_pow2(bn) and bk == _next_pow2(bk)
    return pow2 and all(n % bn == 0 and k % bk == 0 for n, k in shapes)


def _launch_table(
    kernel,
    starts: list[int],
    rows: list[list[int]],
    total: int,
    bases: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    flags: torch.Tensor | None,
    *,
    bn: int,
    bk: int,
    scale_format: str,
    fp8_out: bool,
    num_warps: int | None,
    division: str = "reciprocal",
    clamp: bool = True,
    amax_bits: bool = False,
    unmasked: bool = False,
    chunks: int = 1,
) -> None:
    """Write the table (prefix sum, then per weight its x/q/s element offsets from ``bases``, N, K, NB, KB) and
    launch over ``total`` tiles; the ``ALIGNED`` variant when every row allows it; ``flags``: one per weight;
    ``unmasked``: the ``WHOLE`` variant when every tile of every row is whole."""
    x_base, q_base, s_base = bases
    bn_p2, bk_p2 = _next_pow2(bn), _next_pow2(bk)
    if chunks not in _CHUNKS or bn_p2 % chunks:
        raise QuantInputError(
            f"chunks must be one of {_CHUNKS} and divide the block's padded rows {bn_p2}, got {chunks!r}"
        )
    whole = unmasked and whole_tiles([(r[3], r[4]) for r in rows], bn, bk)
    x_unit, q_unit = 16 // x_base.element_size(), 16 // q_base.element_size()
    aligned = (
        x_base.data_ptr() % 16 == 0
        and q_base.data_ptr() % 16 == 0
        and all(r[0] % x_unit == 0 and r[1] % q_unit == 0 and r[4] % 16 == 0 for r in rows)
    )
    if aligned:
        rows = [[r[0] // x_unit, r[1] // q_unit, r[2], r[3], r[4] // 16, r[5], r[6]] for r in rows]
    table, w_p2 = work_table(starts, rows, x_base.device)
    kernel[(total,)](
        table, x_base, q_base, s_base, flags if flags is not None else table,
        W_P2=w_p2, ROW=_ROW, BN=bn, BK=bk, BN_P2=bn_p2, BK_P2=bk_p2,
        UE8M0=scale_format == "ue8m0", FP8_OUT=fp8_out, ALIGNED=aligned, X_UNIT=x_unit, Q_UNIT=q_unit,
        FLAGS=flags is not None, RECIP=_DIVISIONS[division], CLAMP=clamp, AMAX_BITS=amax_bits, WHOLE=whole,
        CHUNKS=chunks,
        num_warps=num_warps if num_warps is not None else _default_num_warps(bn_p2 * bk_p2),
    )  # fmt: skip


INTO_BUCKET_DIVISION = "reciprocal_noselect"
""":func:`launch_into_bucket`'s division (the refit's quantizer): the fastest with the same codes on an H200."""
INTO_BUCKET_NUM_WARPS = 8
""":func:`launch_into_bucket`'s warps per 128 x 128 tile program (16 by default elsewhere)."""
INTO_BUCKET_AMAX_BITS = False
""":func:`launch_into_bucket`'s amax from bit patterns (``amax_bits``): off until a GPU run times it
(``bench/quant.py``'s ``LEAN_VARIANTS``)."""
INTO_BUCKET_UNMASKED = False
""":func:`launch_into_bucket`'s unmasked whole tiles (``unmasked``): off until a GPU run times it."""
INTO_BUCKET_CHUNKS = 1
""":func:`launch_into_bucket`'s row bands per tile (``chunks``): 1 until a GPU run times the others."""


def launch_into_bucket(
    buffer: torch.Tensor,
    items: Sequence[tuple[torch.Tensor, int, int]],
    block_size: tuple[int, int],
    scale_format: str,
) -> torch.Tensor:
    """Quantize weights straight into a refit bucket in one launch, given byte offsets (no view per weight).

    The refit packer's CUDA path: the codes and scales of every weight are addressed as offsets of the bucket
    itself (its bytes viewed once as float8_e4m3fn and once as float32), and each weight gets a NaN/Inf flag,
    so the host reads one int32 per weight instead of its block scales. Under Triton's CPU interpreter the
    codes go through a float32 shadow of the bucket and torch's cast (the interpreter's e4m3 cast is inexact).

    Args:
        buffer: the bucket, 1-D uint8.
        items: ``(source, codes byte offset, scales byte offset)`` per weight: a contiguous ``[N, K]`` or
            ``[E, N, K]`` source (one dtype for all), offsets multiples of 4 (the packer's are of 16).
        block_size: ``(bn, bk)``.
        scale_format: ``"fp32"`` or ``"ue8m0"``.

    Returns:
        int32 ``[len(items)]`` on the bucket's device: 1 where the weight holds NaN/Inf (its block scale there
        is ``+inf``), else 0. Nothing is read back (no host sync).
    """
    from megatron_fp8.quant.triton_kernels import interpreter_active

    kernel = _grouped_kernel()
    bn, bk = int(block_size[0]), int(block_size[1])
    flags = torch.zeros(len(items), dtype=torch.int32, device=buffer.device)
    if not items:
        return flags
    fp8_out = not interpreter_active()
    x_base = items[0][0]
    q_base = buffer.view(FP8_DTYPE) if fp8_out else torch.zeros(buffer.numel(), device=buffer.device)
    s_base = buffer[: buffer.numel() // 4 * 4].view(torch.float32)
    starts: list[int] = []
    rows: list[list[int]] = []
    total = 0
    for x, q_off, s_off in items:
        e, n, k = (1, *x.shape) if x.dim() == 2 else x.shape
        nb, kb = ceil_div(n, bn), ceil_div(k, bk)
        if x.dtype != x_base.dtype or q_off % 4 or s_off % 4:
            raise QuantInputError("launch_into_bucket: one source dtype per launch, offsets multiples of 4 bytes")
        starts.append(total)
        total += e * nb * kb
        # codes: the byte offset is the element offset of both the float8 view and the float32 shadow
        rows.append([_offset(x, x_base), q_off, s_off // 4, n, k, nb, kb])
    if total == 0:
        return flags
    # The fastest variant with the same bytes (bench/results/quant_cuda.json, H200, the 8B linear set: 7.3-7.6 ms
    # by default, 6.4-6.8 ms so): the select-free division, 8 warps, and on CUDA no clamp (the cast saturates, so
    # every finite tile gets the same codes; NaN/Inf tiles, flagged and refused, get NaN codes instead of +-448).
    # tests/quant/test_recip_division.py shows the same codes (interpreter, and CUDA under `gpu`).
    _launch_table(kernel, starts, rows, total, (x_base, q_base, s_base), flags, bn=bn, bk=bk,
                  scale_format=scale_format, fp8_out=fp8_out, num_warps=INTO_BUCKET_NUM_WARPS,
                  division=INTO_BUCKET_DIVISION, clamp=not fp8_out, amax_bits=INTO_BUCKET_AMAX_BITS,
                  unmasked=INTO_BUCKET_UNMASKED, chunks=INTO_BUCKET_CHUNKS)  # fmt: skip
    if not fp8_out:  # the interpreter: cast the float32 quotients with torch (round to nearest even)
        for x, q_off, _ in items:
            buffer[q_off : q_off + x.numel()].view(FP8_DTYPE).copy_(q_base[q_off : q_off + x.numel()].to(FP8_DTYPE))
    return flags


def _grouped_kernel():
    _kernels()  # raises the "needs the triton package" error when Triton is missing
    return _grouped_blockwise_kernel
