"""Triton kernels for blockwise and per-token-group FP8 quantization on CUDA.

They produce the same bytes as the torch path (:mod:`megatron_fp8.quant.blockwise`,
:mod:`megatron_fp8.quant.token_group`) because they follow the same rule
(:mod:`megatron_fp8.quant.formats`) step by step:

* ``amax`` over the tile's real elements (masked loads fill edge tiles with 0,
  which never raises a maximum of ``|x|``); NaN is mapped to +inf before the
  reduction, because the GPU's ``max`` drops NaN operands, so a NaN anywhere in
  a tile always makes its ``amax`` non-finite;
* ``scale = max(div_rn(amax, 448), 2**-126)``, 1.0 where ``amax == 0``;
  ``tl.math.div_rn`` is the correctly rounded IEEE division (plain ``/`` is an
  approximate division on NVIDIA GPUs and would differ in the last bit);
* ``ue8m0``: ``2**ceil(log2(ratio))`` from the float32 bits of ``ratio``
  (exponent + 1 when any mantissa bit is set), exact, no ``log2``;
* ``q = fp8_e4m3fn(clamp(div_rn(x_fp32, scale), -448, 448))``, round to nearest
  even (Triton's default for float32 -> float8e4nv, ``cvt.rn.satfinite`` on sm_89+).

Each kernel also writes the per-tile ``amax`` so the caller can raise
:class:`~megatron_fp8.errors.NonFiniteError` naming the first bad block, with
the same message as the torch path.

The kernels read every input byte once and write every output byte once: one
program per ``bn x bk`` tile (or per ``cols_per_program`` adjacent tiles along
K), the tile held in registers between the reduction and the cast.

Testing without a GPU: with ``TRITON_INTERPRET=1`` set before Triton is
imported, the kernels run on CPU tensors in Triton's numpy interpreter. The
interpreter's float32 -> float8 conversion is not round-to-nearest-even (it
rounds half up on the cut-off bit and does not carry into the exponent), so
the launchers take ``fp8_out=False`` to store the clamped float32 quotient
instead and let torch do the final cast: that checks tiling, masking, amax,
scale and division in the interpreter; the hardware cast itself is checked by
the GPU tests.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from megatron_fp8.errors import QuantInputError
from megatron_fp8.layout import ceil_div
from megatron_fp8.quant import _checks
from megatron_fp8.quant.formats import FP8_DTYPE, FP8_MAX, MIN_SCALE, check_scale_format

if TYPE_CHECKING:
    from triton.runtime.jit import KernelInterface

logger = logging.getLogger(__name__)

try:  # Triton is optional: without it the module imports and available() is False
    import triton
    import triton.language as tl
except Exception as _exc:  # ImportError, or a broken install raising at import time
    triton = None
    tl = None
    _IMPORT_ERROR: Exception | None = _exc
else:
    _IMPORT_ERROR = None

__all__ = [
    "available",
    "interpreter_active",
    "launch_blockwise",
    "launch_token_group",
    "quantize_blockwise_triton",
    "quantize_per_token_group_triton",
]


def _triton_importable() -> bool:
    return triton is not None


def interpreter_active() -> bool:
    """Whether these kernels run in Triton's CPU interpreter.

    Triton decides when the kernels are defined (at import of this module), from
    ``TRITON_INTERPRET=1`` in the environment; setting it later has no effect.
    """
    return _triton_importable() and type(_blockwise_kernel).__name__ == "InterpretedFunction"


def available() -> bool:
    """Whether the Triton kernels can run on CUDA tensors here (Triton imports and CUDA is up)."""
    return _triton_importable() and torch.cuda.is_available()


RECIP_MIN_SCALE: float = 2.0**-90
"""The smallest block scale the kernels divide by through its reciprocal (below it, and for a non-finite scale,
they divide; with ``division="reciprocal_only"`` they lift such a tile by 2**64 instead); a tile's scale is below it
only when its amax is below ``448 * 2**-90`` (about 3.6e-25)."""

if triton is not None:
    _RECIP_MIN = tl.constexpr(RECIP_MIN_SCALE)
    _LIFT = tl.constexpr(2.0**64)

    @triton.jit
    def _scale_from_amax(amax, UE8M0: tl.constexpr):
        # amax: float32 (scalar or vector). Same rule as formats.SCALE_RULES.
        ratio = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)  # 2**-126
        if UE8M0:
            bits = ratio.to(tl.int32, bitcast=True)
            exponent = (bits >> 23) & 0xFF
            exponent = exponent + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            ratio = (exponent << 23).to(tl.float32, bitcast=True)
        return tl.where(amax == 0.0, 1.0, ratio)

    @triton.jit
    def _divide_noselect(x, scale):
        # x / scale through the scale's correctly rounded reciprocal and the negated remainder (RECIP == 2, below)
        r = tl.math.div_rn(1.0, scale)
        q0 = x * r
        return tl.math.fma(tl.math.fma(q0, scale, -x), -r, q0)

    @triton.jit
    def _divide_by_scale(x, scale, RECIP: tl.constexpr):
        # x / scale correctly rounded (IEEE division), for one tile's scalar scale. RECIP: through the scale's
        # correctly rounded reciprocal and one remainder correction (Markstein: q0 = x*r, e = x - q0*scale exact
        # by fma, q = q0 + e*r), three instructions per element instead of a division; the same e4m3 code as the
        # division (the same float32 quotient from 2**-11 up) wherever the scale is at least RECIP_MIN_SCALE
        # (tests/quant/test_recip_division.py checks every bfloat16 x against every bfloat16 amax), so other tiles
        # (and a non-finite scale) divide.
        # RECIP == 2: the same arithmetic with the remainder negated, e' = q0*scale - x and q = q0 + e'*(-r) (the
        # negations are operand modifiers of the fma): e'*(-r) is e*r exactly, so every quotient is the same bits,
        # and +-0.0 keeps its sign without the select (x = -0: e' = +0, +0*(-r) + -0 = -0), two instructions per
        # element fewer. The negation is on r, never zero: Triton before triton-lang/triton#10270 (3.6, on the lent
        # Hopper machines) compiles unary minus to `0 - v`, which turns -(+0) into +0, so -e' lost -0.0's sign on
        # CUDA (the H200 run of 2026-11-27 showed it); 3.9, pinned here, emits fneg, in its interpreter too
        # (tests/quant/test_recip_division.py runs the kernel's byte test with minus emulated as 0 - v as well).
        # RECIP == 3: the RECIP == 2 arithmetic for every tile, so that no per-element division is compiled in (a
        # division inlines a check and a slow-path call per element: 40% of the kernel's code, never run on a real
        # weight). A scale under RECIP_MIN_SCALE (a tile's amax under 448 * 2**-90) and x are both lifted by 2**64
        # first: products by a power of two are exact here (x * 2**64 < 2**-17, every subnormal becomes normal), the
        # quotient is the same real number, now with a scale the reciprocal path is exact for. An infinite scale
        # (a NaN/Inf tile, refused by every caller) gives x * 0 over 1, which is x / inf: +-0, or NaN for Inf/NaN.
        if RECIP == 3:
            s = scale
            if scale < _RECIP_MIN:
                x = x * _LIFT
                s = scale * _LIFT
            elif scale == float("inf"):
                x = x * 0.0
                s = 1.0
            y = _divide_noselect(x, s)
        elif RECIP != 0:
            if (scale >= _RECIP_MIN) & (scale < float("inf")):
                if RECIP == 2:
                    y = _divide_noselect(x, scale)
                else:
                    r = tl.math.div_rn(1.0, scale)
                    q0 = x * r
                    e = tl.math.fma(-q0, scale, x)
                    y = tl.where(e == 0.0, q0, tl.math.fma(e, r, q0))  # e == 0: q0 is exact (and keeps -0.0)
            else:
                y = tl.math.div_rn(x, scale)
        else:
            y = tl.math.div_rn(x, scale)
        return y

    @triton.jit
    def _tile_amax_bits(raw):
        # amax of |raw| from the elements' bit patterns: with the sign bit cleared, a float's bits order as its
        # magnitude does and every NaN pattern lies above +inf's, so one integer AND and one integer max per element
        # replace abs, the NaN test, its select and the float max; the pattern is then widened exactly to float32
        # (a source's values are exact in float32), and anything from +inf's pattern up becomes +inf.
        if raw.dtype == tl.float32:
            top = tl.max(tl.max(raw.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)
            amax = tl.where(top >= 0x7F800000, float("inf"), top.to(tl.float32, bitcast=True))
        else:  # bfloat16 or float16: 16-bit patterns, +inf at 0x7F80 or 0x7C00
            top = tl.max(tl.max(raw.to(tl.int16, bitcast=True) & 0x7FFF, axis=1), axis=0).to(tl.int16)
            finite = top.to(raw.dtype, bitcast=True).to(tl.float32)
            if raw.dtype == tl.bfloat16:
                amax = tl.where(top >= 0x7F80, float("inf"), finite)
            else:
                amax = tl.where(top >= 0x7C00, float("inf"), finite)
        return amax

    @triton.jit
    def _tile_amax(raw, AMAX_BITS: tl.constexpr):
        # The amax of |raw| over a tile (or a part of one), NaN -> +inf (the GPU's max drops NaN); AMAX_BITS: from the
        # bit patterns (_tile_amax_bits), the same value.
        if AMAX_BITS:
            amax = _tile_amax_bits(raw)
        else:
            ax = tl.abs(raw.to(tl.float32))
            ax = tl.where(ax == ax, ax, float("inf"))
            amax = tl.max(tl.max(ax, axis=1), axis=0)
        return amax

    @triton.jit
    def _store_codes(q_ptrs, raw, scale, mask, FP8_OUT: tl.constexpr, RECIP: tl.constexpr, CLAMP: tl.constexpr,
                     MASKED: tl.constexpr):  # fmt: skip
        # raw / scale as e4m3 codes (FP8_OUT) or float32 quotients, stored at q_ptrs.
        # CLAMP=False leaves out the clamp to +-448: in a finite tile the correctly rounded quotient never exceeds
        # 448 by more than the cast rounds away (tests/quant/test_recip_division.py), so the codes are the same;
        # a NaN/Inf tile (refused by every caller) then gets NaN codes where the GPU's min/max would give +-448.
        y = _divide_by_scale(raw.to(tl.float32), scale, RECIP)
        if CLAMP:
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if FP8_OUT:
            y = y.to(tl.float8e4nv)
        if MASKED:
            tl.store(q_ptrs, y, mask=mask)
        else:
            tl.store(q_ptrs, y)

    @triton.jit
    def _load_tile(x_ptrs, mask, MASKED: tl.constexpr):
        # MASKED=False: a tile known to be whole (every caller's check), loaded without a mask.
        if MASKED:
            raw = tl.load(x_ptrs, mask=mask, other=0.0)
        else:
            raw = tl.load(x_ptrs)
        return raw

    @triton.jit
    def _quantize_tile(
        x_ptrs,
        q_ptrs,
        mask,
        UE8M0: tl.constexpr,
        FP8_OUT: tl.constexpr,
        RECIP: tl.constexpr,
        CLAMP: tl.constexpr,
        AMAX_BITS: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        # One [BN, BK] tile, held in registers from its load to its store: its amax (NaN -> +inf), scale, and codes
        # stored at q_ptrs; returns (scale, amax).
        raw = _load_tile(x_ptrs, mask, MASKED)
        amax = _tile_amax(raw, AMAX_BITS)
        scale = _scale_from_amax(amax, UE8M0)
        _store_codes(q_ptrs, raw, scale, mask, FP8_OUT, RECIP, CLAMP, MASKED)
        return scale, amax

    @triton.jit
    def _blockwise_kernel(
        x_ptr,
        q_ptr,
        scale_ptr,
        amax_ptr,
        N,
        K,
        NB,
        KB,
        BN: tl.constexpr,
        BK: tl.constexpr,
        BN_P2: tl.constexpr,
        BK_P2: tl.constexpr,
        COLS: tl.constexpr,
        UE8M0: tl.constexpr,
        FP8_OUT: tl.constexpr,
    ):
        pid_k = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.program_id(2).to(tl.int64)
        r = tl.arange(0, BN_P2)
        c = tl.arange(0, BK_P2)
        rows = pid_n * BN + r
        row_ok = (r < BN) & (rows < N)
        row_off = expert * N * K + rows.to(tl.int64) * K
        for i in tl.static_range(COLS):
            kb = pid_k * COLS + i
            cols = kb * BK + c
            mask = row_ok[:, None] & ((c < BK) & (cols < K))[None, :]
            offs = row_off[:, None] + cols[None, :]
            scale, amax = _quantize_tile(x_ptr + offs, q_ptr + offs, mask, UE8M0, FP8_OUT, 1, True, False, True)
            s_idx = (expert * NB + pid_n) * KB + kb
            tl.store(scale_ptr + s_idx, scale, mask=kb < KB)
            tl.store(amax_ptr + s_idx, amax, mask=kb < KB)

    @triton.jit
    def _token_group_kernel(
        x_ptr,
        q_ptr,
        scale_ptr,
        amax_ptr,
        M,
        K,
        NG,
        G: tl.constexpr,
        G_P2: tl.constexpr,
        ROWS: tl.constexpr,
        UE8M0: tl.constexpr,
        FP8_OUT: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        grp = tl.program_id(1)
        r = pid_m * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, G_P2)
        cols = grp * G + c
        row_ok = r < M
        mask = row_ok[:, None] & ((c < G) & (cols < K))[None, :]
        offs = r.to(tl.int64)[:, None] * K + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        ax = tl.where(ax == ax, ax, float("inf"))
        amax = tl.max(ax, axis=1)
        scale = _scale_from_amax(amax, UE8M0)
        y = tl.math.div_rn(x, scale[:, None])
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if FP8_OUT:
            tl.store(q_ptr + offs, y.to(tl.float8e4nv), mask=mask)
        else:
            tl.store(q_ptr + offs, y, mask=mask)
        s_idx = r.to(tl.int64) * NG + grp
        tl.store(scale_ptr + s_idx, scale, mask=row_ok)
        tl.store(amax_ptr + s_idx, amax, mask=row_ok)


def _kernels() -> tuple[KernelInterface, KernelInterface]:
    """The two jitted kernels ``(blockwise, token_group)``; raises when Triton is missing."""
    if triton is None:
        raise QuantInputError(f"backend='triton' needs the triton package ({_IMPORT_ERROR}); use backend='torch'")
    return _blockwise_kernel, _token_group_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _check_runnable(x: torch.Tensor, scale_format: str, what: str, name: str | None) -> None:
    check_scale_format(scale_format)
    if not _triton_importable():
        raise QuantInputError(f"{what}: backend='triton' needs the triton package; use backend='torch'")
    if not x.is_cuda and not interpreter_active():
        raise QuantInputError(
            f"{what}: tensor {name!r} is on {x.device}; the Triton kernels need a CUDA tensor "
            "(or TRITON_INTERPRET=1 set before triton is imported, for CPU testing). Use backend='torch'."
        )


def _default_num_warps(tile_elems: int) -> int:
    """Warps per program: about 32 float32 elements per thread, 4..16 warps."""
    return int(min(16, max(4, tile_elems // (32 * 32))))


def launch_blockwise(
    x3: torch.Tensor,
    bn: int,
    bk: int,
    scale_format: str,
    *,
    fp8_out: bool = True,
    cols_per_program: int = 1,
    num_warps: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the blockwise kernel only: no validation, no non-finite check, no sync.

    For benchmarks and callers that batch the check themselves. ``x3`` must be a
    contiguous ``[E, N, K]`` tensor. Arguments as for :func:`quantize_blockwise_triton`;
    ``out``: ``(q, scale_inv)`` to write into instead of new tensors (e.g. views of a
    refit bucket): contiguous, ``q`` with ``E * N * K`` elements of the output dtype,
    ``scale_inv`` float32 with ``E * ceil(N/bn) * ceil(K/bk)`` elements.

    Returns:
        ``(q, scale_inv, amax)``: ``q`` float8_e4m3fn (float32 when
        ``fp8_out=False``) ``[E, N, K]``; ``scale_inv`` and ``amax`` float32
        ``[E, ceil(N/bn), ceil(K/bk)]`` (``amax`` is +inf for a tile holding NaN).
    """
    blockwise_kernel, _ = _kernels()
    e, n, k = x3.shape
    nb, kb = ceil_div(n, bn), ceil_div(k, bk)
    cols = max(1, min(int(cols_per_program), kb))
    q_dtype = FP8_DTYPE if fp8_out else torch.float32
    if out is None:
        q = torch.empty((e, n, k), dtype=q_dtype, device=x3.device)
        scale = torch.empty((e, nb, kb), dtype=torch.float32, device=x3.device)
    else:
        q, scale = out
        if (
            q.dtype != q_dtype
            or q.numel() != e * n * k
            or not q.is_contiguous()
            or scale.dtype != torch.float32
            or scale.numel() != e * nb * kb
            or not scale.is_contiguous()
        ):
            raise QuantInputError(
                f"launch_blockwise: out must be contiguous {q_dtype} with {e * n * k} elements and float32 with "
                f"{e * nb * kb}, got {q.dtype} {tuple(q.shape)} and {scale.dtype} {tuple(scale.shape)}"
            )
    amax = torch.empty((e, nb, kb), dtype=torch.float32, device=x3.device)
    bn_p2, bk_p2 = _next_pow2(bn), _next_pow2(bk)
    warps = num_warps if num_warps is not None else _default_num_warps(bn_p2 * bk_p2)
    grid = (ceil_div(kb, cols), nb, e)
    blockwise_kernel[grid](
        x3, q, scale, amax, n, k, nb, kb,
        BN=bn, BK=bk, BN_P2=bn_p2, BK_P2=bk_p2, COLS=cols,
        UE8M0=scale_format == "ue8m0", FP8_OUT=fp8_out, num_warps=warps,
    )  # fmt: skip
    return q, scale, amax


def launch_token_group(
    x2: torch.Tensor,
    group_size: int,
    scale_format: str,
    *,
    fp8_out: bool = True,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the per-token-group kernel only (contiguous ``[M, K]`` input; no checks, no sync).

    Returns:
        ``(q, scale_inv, amax)``: ``[M, K]`` and float32 ``[M, ceil(K/group_size)]`` twice.
    """
    _, token_group_kernel = _kernels()
    m, k = x2.shape
    ng = ceil_div(k, group_size)
    g_p2 = _next_pow2(group_size)
    if rows_per_program is None:
        rows = min(_next_pow2(m), max(1, 8192 // g_p2))
    else:
        rows = _next_pow2(rows_per_program)
    q = torch.empty((m, k), dtype=FP8_DTYPE if fp8_out else torch.float32, device=x2.device)
    scale = torch.empty((m, ng), dtype=torch.float32, device=x2.device)
    amax = torch.empty_like(scale)
    warps = num_warps if num_warps is not None else _default_num_warps(rows * g_p2)
    grid = (ceil_div(m, rows), ng)
    token_group_kernel[grid](
        x2, q, scale, amax, m, k, ng,
        G=group_size, G_P2=g_p2, ROWS=rows,
        UE8M0=scale_format == "ue8m0", FP8_OUT=fp8_out, num_warps=warps,
    )  # fmt: skip
    return q, scale, amax


def quantize_blockwise_triton(
    x3: torch.Tensor,
    bn: int,
    bk: int,
    scale_format: str,
    *,
    name: str | None,
    fp8_out: bool = True,
    cols_per_program: int = 1,
    num_warps: int | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 quantization of a ``[E, N, K]`` stack with one Triton program per tile.

    Args:
        x3: ``[E, N, K]`` bfloat16/float16/float32 CUDA tensor (made contiguous
            if it is not). Validation of dtype/rank/emptiness is the caller's
            (:func:`megatron_fp8.quant.quantize_blockwise`).
        bn: block rows (along N); any positive int (padded to a power of two
            inside the kernel and masked).
        bk: block columns (along K).
        scale_format: ``"fp32"`` or ``"ue8m0"``.
        name: tensor name for error messages.
        fp8_out: ``True`` (default) casts to float8_e4m3fn in the kernel;
            ``False`` stores the clamped float32 quotient and casts with torch
            afterwards (for Triton's CPU interpreter, whose fp8 cast is inexact).
        cols_per_program: adjacent tiles along K handled by one program.
        num_warps: warps per program; ``None`` picks from the tile size.
        check: raise on NaN/Inf (one host read); ``False``: such a tile's scale is ``+inf``, nothing syncs.

    Returns:
        ``(q, scale_inv)``: float8_e4m3fn ``[E, N, K]`` and float32
        ``[E, ceil(N/bn), ceil(K/bk)]`` on ``x3``'s device.

    Raises:
        NonFiniteError: a tile holds NaN/Inf (names expert, row block and column block).
        QuantInputError: Triton missing, or a CPU tensor outside the interpreter.
    """
    what = "quantize_blockwise"
    _check_runnable(x3, scale_format, what, name)
    if x3.dim() != 3:
        raise QuantInputError(f"{what}: tensor {name!r} must be [E, N, K] here, got shape {tuple(x3.shape)}")
    x3 = x3.contiguous()
    e = x3.shape[0]
    q, scale, amax = launch_blockwise(
        x3, bn, bk, scale_format, fp8_out=fp8_out, cols_per_program=cols_per_program, num_warps=num_warps
    )
    if check:
        _checks.raise_on_nonfinite_amax(
            x3 if e > 1 else x3[0],
            amax if e > 1 else amax[0],
            block_size=(bn, bk),
            axis_names=(("expert",) if e > 1 else ()) + ("row_block", "col_block"),
            name=name,
            what=what,
        )
    if not fp8_out:
        q = q.to(FP8_DTYPE)
    return q, scale


def quantize_per_token_group_triton(
    x2: torch.Tensor,
    group_size: int,
    scale_format: str,
    *,
    name: str | None,
    fp8_out: bool = True,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 quantization of ``[M, K]`` activations.

    Args:
        x2: ``[M, K]`` bfloat16/float16/float32 CUDA tensor (made contiguous if needed).
        group_size: elements per group along K; a partial last group uses only
            its real elements.
        scale_format: ``"fp32"`` or ``"ue8m0"``.
        name: tensor name for error messages.
        fp8_out: see :func:`quantize_blockwise_triton`.
        rows_per_program: tokens per program (a power of two); ``None`` picks
            about 8192 elements per program.
        num_warps: warps per program; ``None`` picks from the tile size.
        check: as for :func:`quantize_blockwise_triton`.

    Returns:
        ``(q, scale_inv)``: float8_e4m3fn ``[M, K]`` and float32 ``[M, ceil(K/group_size)]``.

    Raises:
        NonFiniteError: a group holds NaN/Inf (names token and group).
        QuantInputError: Triton missing, or a CPU tensor outside the interpreter.
    """
    what = "quantize_per_token_group"
    _check_runnable(x2, scale_format, what, name)
    if x2.dim() != 2:
        raise QuantInputError(f"{what}: tensor {name!r} must be [M, K] here, got shape {tuple(x2.shape)}")
    x2 = x2.contiguous()
    q, scale, amax = launch_token_group(
        x2, group_size, scale_format, fp8_out=fp8_out, rows_per_program=rows_per_program, num_warps=num_warps
    )
    if check:
        _checks.raise_on_nonfinite_amax(
            x2, amax, block_size=(1, group_size), axis_names=("token", "group"), name=name, what=what
        )
    if not fp8_out:
        q = q.to(FP8_DTYPE)
    return q, scale


# The kernels hard-code these constants (a jitted function cannot read Python
# float globals); fail loudly at import if formats.py ever changes them.
if FP8_MAX != 448.0 or MIN_SCALE != 2.0**-126:
    raise RuntimeError("formats.FP8_MAX / MIN_SCALE changed: update the constants in triton_kernels")
