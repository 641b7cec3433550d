"""The kernels' division by a tile's scale through its reciprocal gives the codes of an IEEE division.

``quant/triton_kernels.py`` computes ``x / scale`` per element as ``q0 = x * r``, ``e = fma(-q0, scale, x)``,
``q = e == 0 ? q0 : fma(e, r, q0)`` with ``r`` the correctly rounded ``1 / scale`` (Markstein's correction), for
tiles whose scale is finite and at least ``RECIP_MIN_SCALE``; other tiles divide. Three instructions per element
instead of a division. These tests replay that arithmetic in numpy with the same single-rounding fma the Triton
interpreter uses, over every finite bfloat16 ``x`` against bfloat16 amax values (every 61st of all of them, the
smallest and largest 256, and the 512 around the guard; ``MFP8_EXHAUSTIVE=1`` takes all 32,639: 1.0e9 pairs,
no code differs, about a minute on 2 cores), and require:

* the e4m3 code (clamped to +-448, round to nearest even) equals the division's, for every pair;
* the float32 quotient equals the division's wherever the quotient is at least 2**-11 in magnitude (below it both
  codes are +-0: e4m3's smallest step is 2**-9); below, a tiny ``x`` can leave the remainder subnormal, so the
  quotient may differ in its last bit there, which the first check shows never reaches a code.

Then the kernel itself, under ``TRITON_INTERPRET=1`` in a child interpreter, gives the same bytes with both
divisions on values chosen to hit every branch (-0.0, subnormal bfloat16, a tile whose amax is below the guard,
a NaN tile, ue8m0 scales). ``division="reciprocal_noselect"`` (the remainder negated, ``q = fma(e', -r, q0)``
with ``e' = fma(q0, scale, -x)``, no select for an exact quotient) must give the same quotient bits as the
select form for every pair, signed zeros included, and the same bytes in the kernel.

The kernels' optional clamp (``clamp=False``): the largest quotient of any tile, ``amax / scale`` by either
division, must round to 448 under the cast alone, for every bfloat16 amax of the set, so that the clamp to +-448
never changes a finite tile's code; the interpreter's kernel and (``gpu``) the CUDA kernel, whose cast saturates,
give the same bytes with and without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from triton._C.libtriton import interpreter

from megatron_fp8.quant.triton_kernels import RECIP_MIN_SCALE


def _fma_fp32_exact(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``a * b + c`` in float32 with one rounding, in numpy float64 arithmetic.

    The product of two float32 values is exact in float64; the sum is rounded to odd at 53 bits (the round-to-nearest
    sum moved one ulp towards the exact value when it is inexact and its last bit is even, the error known exactly
    by TwoSum), and a value rounded to odd with at least 2 more bits than float32 rounds to nearest float32 like the
    exact value. Used where Triton's interpreter does not expose its own fma (Triton 3.6, the lent GPU machines).
    """
    a64, b64, c64 = (np.asarray(v, dtype=np.float64) for v in np.broadcast_arrays(a, b, c))
    p = a64 * b64
    s = p + c64
    with np.errstate(invalid="ignore", over="ignore"):
        t = s - p
        err = (p - (s - t)) + (c64 - t)
        even = (s.view(np.int64) & 1) == 0
        move = np.isfinite(err) & (err != 0) & even
        s = np.where(move, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


# the interpreter's own single-rounding fma where this Triton exposes it (the pinned one does), else the exact numpy
fma_fp32 = getattr(interpreter, "fma_fp32", _fma_fp32_exact)

FP8_MAX = np.float32(448.0)
MIN_SCALE = np.float32(2.0**-126)


def test_the_numpy_fma_is_the_interpreters() -> None:
    """The fallback fma gives the interpreter's bits: random operands, products that nearly cancel the addend, and
    products exactly halfway between two float32 values with a tiny addend (where a float64 sum rounded again to
    float32 would tie to even instead of rounding towards the addend)."""
    if not hasattr(interpreter, "fma_fp32"):
        pytest.skip(
            "the lent Hopper machines' Triton 3.6 has no interpreter fma_fp32 to compare with (the pinned 3.9 has)"
        )
    rng = np.random.default_rng(0)
    n = 1 << 18

    def floats(lo: int, hi: int, bits: int = 24) -> np.ndarray:  # significands of `bits` bits, exponents in [lo, hi)
        m = rng.integers(1 << (bits - 1), 1 << bits, n) * rng.choice([-1.0, 1.0], n)
        return (m * np.exp2(rng.integers(lo, hi, n) - bits)).astype(np.float32)

    a, b = floats(-100, 60), floats(-20, 20)
    cancel = -(a.astype(np.float64) * b).astype(np.float32)  # the fma is the product's rounding error
    half_a, half_b = floats(-40, 40, bits=12), floats(-20, 20, bits=13)  # products of 24 or 25 bits: halfway cases
    tiny = (np.sign(rng.standard_normal(n)) * np.exp2(-120.0)).astype(np.float32)
    cases = {
        "random": (a, b, floats(-149, 100)),
        "cancel": (a, b, cancel),
        "cancel + 1 ulp": (a, b, np.nextafter(cancel, np.float32(np.inf))),
        "halfway + tiny": (half_a, half_b, tiny),
        "specials": tuple(np.array(v, dtype=np.float32) for v in (
            [-0.0, 0.0, np.inf, np.nan, 3e38, 1e-30], [0.0, -0.0, 0.0, 1.0, 10.0, 1e-30], [-0.0, -0.0, 1.0, 1.0, 0.0, 0.0]
        )),
    }  # fmt: skip
    for name, (x, y, z) in cases.items():
        with np.errstate(invalid="ignore", over="ignore"):  # inf * 0, 3e38 * 10
            want, got = interpreter.fma_fp32(x, y, z), _fma_fp32_exact(x, y, z)
        assert np.array_equal(np.isnan(want), np.isnan(got)), name
        finite = ~np.isnan(want)
        differ = want[finite].view(np.uint32) != got[finite].view(np.uint32)
        assert not differ.any(), (name, int(differ.sum()))


def _every_bf16() -> np.ndarray:
    x = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    return x[np.isfinite(x)]


def _codes(q: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.clip(q, -FP8_MAX, FP8_MAX)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def _scale(amax: np.float32, ue8m0: bool) -> np.float32:
    ratio = np.maximum(np.float32(amax / FP8_MAX), MIN_SCALE)
    if ue8m0:  # the next power of two at or above the ratio
        bits = np.array([ratio], dtype=np.float32).view(np.int32)[0]
        exponent = ((bits >> 23) & 0xFF) + (1 if bits & 0x7FFFFF else 0)
        ratio = np.array([exponent << 23], dtype=np.int32).view(np.float32)[0]
    return np.float32(ratio)


def _recip_divide(x: np.ndarray, scale: np.float32) -> np.ndarray:
    r = np.float32(np.float32(1.0) / scale)
    q0 = x * r
    e = fma_fp32(-q0, np.full_like(x, scale), x)
    return np.where(e == 0, q0, fma_fp32(e, np.full_like(x, r), q0))


def _recip_divide_noselect(x: np.ndarray, scale: np.float32) -> np.ndarray:
    """The kernels' ``division="reciprocal_noselect"``: the remainder negated, no select for an exact quotient."""
    r = np.float32(np.float32(1.0) / scale)
    q0 = x * r
    e_neg = fma_fp32(q0, np.full_like(x, scale), -x)
    return fma_fp32(e_neg, np.full_like(x, -r), q0)


def _recip_divide_lifted(x: np.ndarray, scale: np.float32) -> np.ndarray:
    """The kernels' ``division="reciprocal_only"``: a tile whose scale is under the guard, lifted by 2**64 (x and the
    scale: exact), then the negated-remainder form; an infinite scale gives ``x * 0`` over 1."""
    if scale == np.inf:
        x, scale = x * np.float32(0.0), np.float32(1.0)
    elif scale < np.float32(RECIP_MIN_SCALE):
        x, scale = x * np.float32(2.0**64), np.float32(scale * np.float32(2.0**64))
    return _recip_divide_noselect(x, scale)


def _amax_set() -> np.ndarray:
    ax = np.unique(np.abs(_every_bf16()))
    ax = ax[ax > 0]
    guard_amax = np.float32(RECIP_MIN_SCALE) * FP8_MAX
    at = int(np.searchsorted(ax, guard_amax))
    if os.environ.get("MFP8_EXHAUSTIVE") == "1":
        return ax
    return np.unique(np.concatenate([ax[::61], ax[:256], ax[-256:], ax[max(0, at - 256) : at + 256]]))


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scale", "ue8m0-scale"])
def test_every_bf16_value_gets_the_divisions_code(ue8m0: bool) -> None:
    x_all = _every_bf16()
    order = np.argsort(np.abs(x_all))
    xs, axs = x_all[order], np.abs(x_all[order])
    pairs = code_diffs = quotient_diffs = fast_tiles = noselect_diffs = 0
    for amax in _amax_set():
        x = xs[: int(np.searchsorted(axs, amax, side="right"))]  # a tile holds values up to its amax
        scale = _scale(amax, ue8m0)
        if not scale >= RECIP_MIN_SCALE:  # the kernel divides there
            continue
        fast_tiles += 1
        ref = x / scale
        got = _recip_divide(x, scale)
        noselect_diffs += int((_recip_divide_noselect(x, scale).view(np.uint32) != got.view(np.uint32)).sum())
        differ = got.view(np.uint32) != ref.view(np.uint32)  # equal quotients give equal codes
        code_diffs += int((_codes(got[differ]) != _codes(ref[differ])).sum())
        quotient_diffs += int((np.abs(ref[differ]) >= 2.0**-11).sum())
        pairs += x.size
    assert fast_tiles > 500 and pairs > 10_000_000, (fast_tiles, pairs)
    assert code_diffs == 0, f"{code_diffs} of {pairs} codes differ from the division's"
    assert quotient_diffs == 0, f"{quotient_diffs} float32 quotients >= 2**-11 differ from the division's"
    assert noselect_diffs == 0, f"{noselect_diffs} quotients of the negated-remainder form differ (bits, +-0 sign)"


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scale", "ue8m0-scale"])
def test_the_clamp_never_changes_the_code_of_a_finite_tile(ue8m0: bool) -> None:
    amaxes = _amax_set()
    scales = np.array([_scale(a, ue8m0) for a in amaxes], dtype=np.float32)
    fast = scales >= np.float32(RECIP_MIN_SCALE)
    top = [amaxes / scales, _recip_divide(amaxes[fast], scales[fast])]  # each tile's largest quotient, both ways
    for q in top:
        assert np.all(q <= np.float32(448.0) * np.float32(1 + 2.0**-20)), float(q.max())
        unclamped = torch.from_numpy(np.concatenate([q, -q])).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        assert np.array_equal(unclamped, _codes(np.concatenate([q, -q])))
    if not ue8m0:  # a power-of-two scale is at least amax / 448; a rounded one can be below it
        assert float((amaxes / scales).max()) > 448.0, "some quotient does exceed 448 (the cast rounds it back)"


def test_the_guard_is_needed_below_it() -> None:
    """Without the guard the reciprocal path does give other codes (tiny tiles): the guard is what makes it exact."""
    x_all = _every_bf16()
    ax = np.abs(x_all)
    diffs = 0
    for amax in np.unique(ax[(ax > 0) & (ax < np.float32(RECIP_MIN_SCALE) * FP8_MAX)])[::4]:
        x = x_all[ax <= amax]
        scale = _scale(amax, False)
        diffs += int((_codes(_recip_divide(x, scale)) != _codes(x / scale)).sum())
    assert diffs > 0


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scale", "ue8m0-scale"])
def test_lifted_below_the_guard_every_bf16_value_gets_the_divisions_bits(ue8m0: bool) -> None:
    """``division="reciprocal_only"`` under the guard: x and the scale lifted by 2**64 give the division's float32
    quotient, bit for bit, for every bfloat16 x against every 2nd bfloat16 amax below the guard (every amax with
    ``MFP8_EXHAUSTIVE=1``); above it the arithmetic is the negated-remainder form checked above."""
    x_all = _every_bf16()
    ax = np.abs(x_all)
    below = np.unique(ax[(ax > 0) & (ax < np.float32(RECIP_MIN_SCALE) * FP8_MAX)])
    step = 1 if os.environ.get("MFP8_EXHAUSTIVE") == "1" else 2
    pairs = diffs = 0
    for amax in below[::step]:
        x = x_all[ax <= amax]
        scale = _scale(amax, ue8m0)
        assert scale < np.float32(RECIP_MIN_SCALE) or ue8m0, amax  # every one of them takes the lifted branch
        ref = x / scale
        diffs += int((_recip_divide_lifted(x, scale).view(np.uint32) != ref.view(np.uint32)).sum())
        pairs += x.size
    assert below.size > 3000 and pairs > 1_000_000, (below.size, pairs)
    assert diffs == 0, f"{diffs} of {pairs} lifted quotients differ from the division's"


def test_an_infinite_scale_gives_x_over_inf() -> None:
    """A NaN/Inf tile's scale is +inf: ``x * 0`` over 1 gives what ``x / inf`` gives, for every bfloat16 value and
    +-Inf and NaN: +-0.0 with x's sign, NaN for Inf and NaN."""
    x = np.concatenate([_every_bf16(), np.array([np.inf, -np.inf, np.nan], dtype=np.float32)])
    with np.errstate(invalid="ignore"):
        got, ref = _recip_divide_lifted(x, np.float32(np.inf)), x / np.float32(np.inf)
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.isnan(got).sum() == 3
    finite = ~np.isnan(ref)
    assert np.array_equal(got[finite].view(np.uint32), ref[finite].view(np.uint32))


_MINUS_AS_SUB = textwrap.dedent(
    """
    # Triton before triton-lang/triton#10270 (3.6, on the lent Hopper machines) compiled a float's unary minus as
    # `0 - v`, so -(+0.0) gave +0.0; the pinned 3.9 negates exactly, in its interpreter too. Emulate the old one.
    from triton.language import semantic

    _minus = semantic.TritonSemantic.minus
    subs = []

    def _minus_as_sub(self, input):
        scalar = input.type.scalar
        if not scalar.is_floating():
            return _minus(self, input)
        subs.append(1)
        return self.sub(self.make_tensor(self.builder.get_null_value(scalar.to_ir(self.builder)), scalar), input, True)

    semantic.TritonSemantic.minus = _minus_as_sub
    """
)

_KERNEL_SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron_fp8.quant.triton_grouped import GroupedItem, launch_blockwise_grouped
    from megatron_fp8.quant.triton_kernels import interpreter_active

    assert interpreter_active()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 256, 256, generator=g).to(torch.bfloat16)
    w[0, :128, :128] = -0.0                                       # a zero tile of negative zeros
    w[0, :128, 128:] *= 1e-30                                     # amax ~4e-30: below the guard, divides
    w[0, 128:, :128] = torch.randint(-32, 32, (128, 128), generator=g).to(torch.bfloat16) * 2.0**-133  # subnormal
    w[1, 5, 7] = float("nan")                                     # a NaN tile: infinite scale, divides
    w[1, 200:, 200:] *= 2.0**-20
    w[1, 128:, :128] = 0.0                                        # a tile whose reciprocal path needs the lift:
    w[1, 128, 0] = 3.274080905458301e-32                          # without it this amax's tiny elements get
    w[1, 129, 1], w[1, 130, 2] = 4.995850990994722e-37, -4.995850990994722e-37  # other codes than the division's
    w[2, 130, 131] = -0.0
    out = {}
    for fmt in ("fp32", "ue8m0"):
        for division, clamp in (
            ("reciprocal", True), ("rn", True), ("reciprocal", False), ("reciprocal_noselect", True),
            ("reciprocal_noselect", False), ("reciprocal_only", True), ("reciprocal_only", False),
        ):
            q = torch.empty(w.numel(), dtype=torch.float32)
            s = torch.empty(3 * 2 * 2, dtype=torch.float32)
            launch_blockwise_grouped(
                [GroupedItem(w, q, s)], 128, 128, fmt, fp8_out=False, division=division, clamp=clamp
            )
            out[fmt, division, clamp] = (q.to(torch.float8_e4m3fn).view(torch.uint8), s)
        qa, sa = out[fmt, "reciprocal", True]
        nan_at = 1 * 256 * 256 + 5 * 256 + 7
        others = [(v, k[2]) for k, v in out.items() if k[0] == fmt and k[1:] != ("reciprocal", True)]
        for (qb, sb), clamped in others:
            if not clamped:  # the NaN itself: the cast keeps it; max(NaN, -448) may drop it (tl.maximum's NaN
                # handling is unspecified by default: Triton 3.9's interpreter gives -448, 0xfe; 3.6's keeps NaN)
                assert int(qa[nan_at]) in (0xFE, 0x7F) and int(qb[nan_at]) == 0x7F, (int(qa[nan_at]), int(qb[nan_at]))
                qb = qb.clone()
                qb[nan_at] = qa[nan_at]
            assert torch.equal(qa, qb), (fmt, clamped, int((qa != qb).sum()))
            assert torch.equal(sa.view(torch.int32), sb.view(torch.int32)), fmt
        assert (qa == 0x80).sum() > 128 * 128, "the negative zeros keep their sign"
    print("same bytes", "minus as 0 - v:", len(globals().get("subs", [])))
    """
)


@pytest.mark.parametrize("minus", ["fneg", "zero_minus"])
def test_the_kernel_gives_the_same_bytes_with_either_division(minus: str) -> None:
    """Also with unary minus compiled as ``0 - v`` (older Triton on the GPU machines), where relying on ``-(+0.0)``
    being -0.0 loses a negative zero's sign (the select-free division did, before it negated ``r`` instead)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = (_MINUS_AS_SUB if minus == "zero_minus" else "") + _KERNEL_SCRIPT
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0 and "same bytes" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    subs = int(proc.stdout.split("minus as 0 - v:")[1].split()[0])
    assert (subs > 0) == (minus == "zero_minus"), subs  # the emulation reached the kernels' negations


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
def test_on_cuda_the_kernel_variants_give_the_same_bytes(fmt: str) -> None:
    """The CUDA cast saturates (``cvt.rn.satfinite``): without the clamp, and with the select-free division, every
    finite tile's codes are the same as the default kernel's; so are those of the lean setting with the amax from
    bit patterns and unmasked whole tiles (``tests/quant/test_grouped_variants.py`` checks those in the
    interpreter), on a group with edge tiles and on one of whole tiles only (where ``unmasked`` drops the masks)."""
    from megatron_fp8.quant.triton_grouped import GroupedItem, launch_blockwise_grouped

    g = torch.Generator().manual_seed(1)
    groups = {
        "edges": [(1, 4096, 4096), (2, 384, 1000), (1, 200, 136)],  # full tiles, edge tiles along N and K
        "whole": [(1, 4096, 4096), (2, 256, 1024)],
    }
    lean = {"clamp": False, "division": "reciprocal_noselect"}
    only = {**lean, "division": "reciprocal_only"}
    variants = {
        "default": {},
        "no clamp": {"clamp": False},
        "lean": lean,
        "lean, amax from bits": {**lean, "amax_bits": True},
        "lean, unmasked": {**lean, "unmasked": True},
        "lean, both, 8 warps": {**lean, "amax_bits": True, "unmasked": True, "num_warps": 8},
        "reciprocal only": only,
        "reciprocal only, both, 8 warps": {**only, "amax_bits": True, "unmasked": True, "num_warps": 8},
        "reciprocal only, 4 row bands": {**only, "chunks": 4, "num_warps": 8},
        "reciprocal only, both, 8 row bands": {**only, "amax_bits": True, "unmasked": True, "chunks": 8},
    }
    for shapes in groups.values():
        xs = []
        for e, n, k in shapes:
            x = torch.randn(e, n, k, generator=g) * torch.logspace(-30, 30, e * n).view(e, n, 1)
            x[0, 0, 0] = -0.0
            xs.append(x.to(torch.bfloat16).cuda())
        out = {}
        for variant, options in variants.items():
            items = [
                GroupedItem(x, torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(
                    x.shape[0] * -(-x.shape[1] // 128) * -(-x.shape[2] // 128), device="cuda"))
                for x in xs
            ]  # fmt: skip
            launch_blockwise_grouped(items, 128, 128, fmt, **options)
            out[variant] = [(it.q.view(torch.uint8).cpu(), it.scales.cpu()) for it in items]
        for variant in variants:
            for (qa, sa), (qb, sb) in zip(out["default"], out[variant], strict=True):
                assert torch.equal(qa, qb), (variant, int((qa != qb).sum()))
                assert torch.equal(sa.view(torch.int32), sb.view(torch.int32)), variant


def test_an_unknown_division_or_band_count_is_refused() -> None:
    from megatron_fp8.errors import QuantInputError
    from megatron_fp8.quant.triton_grouped import GroupedItem, launch_blockwise_grouped

    with pytest.raises(QuantInputError, match="division must be one of"):
        launch_blockwise_grouped([], 128, 128, "fp32", division="fast")
    x = torch.zeros(1, 128, 128, dtype=torch.bfloat16)
    item = GroupedItem(x, torch.empty(x.numel()), torch.empty(1))
    for chunks in (3, 16, 0):
        with pytest.raises(QuantInputError, match="chunks must be one of"):
            launch_blockwise_grouped([item], 128, 128, "fp32", fp8_out=False, chunks=chunks)
    with pytest.raises(QuantInputError, match="divide the block's padded rows 8"):
        launch_blockwise_grouped([GroupedItem(x, torch.empty(x.numel()), torch.empty(16 * 1))], 8, 128, "fp32",
                                 fp8_out=False, chunks=16)  # fmt: skip
