"""Blockwise (128x128) quantizer, torch path: bytes against the float64 reference, properties, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8.errors import NonFiniteError, QuantInputError
from megatron_fp8.quant import (
    FP8_MAX,
    blockwise_scale_shape,
    dequantize_blockwise,
    is_pow2,
    quantize_blockwise,
)
from megatron_fp8.quant.reference import quantize_blockwise_reference

DTYPES = st.sampled_from([torch.bfloat16, torch.float16, torch.float32])
FORMATS = st.sampled_from(["fp32", "ue8m0"])


@st.composite
def weight_shapes(draw):
    """[N, K] or [E, N, K]: 1x1, edge sizes around 128, and small odd sizes."""
    dim = st.one_of(st.integers(1, 300), st.sampled_from([1, 127, 128, 129, 256, 257]))
    n, k = draw(dim), draw(dim)
    if draw(st.booleans()):
        return (draw(st.integers(1, 3)), min(n, 140), min(k, 140))
    return (n, k)


@settings(max_examples=60, deadline=None)
@given(shape=weight_shapes(), dtype=DTYPES, fmt=FORMATS, seed=st.integers(0, 2**31 - 1))
def test_bytes_equal_float64_reference(qhelp, shape, dtype, fmt, seed):
    x = qhelp.make_input(shape, dtype, seed)
    q, s = quantize_blockwise(x, scale_format=fmt)
    qr, sr = quantize_blockwise_reference(x, scale_format=fmt)
    assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == blockwise_scale_shape(x.shape) and s.dtype == torch.float32
    qhelp.assert_same_bytes(s, sr, f"scale_inv {shape} {dtype} {fmt}")
    qhelp.assert_same_bytes(q, qr, f"q {shape} {dtype} {fmt}")


@pytest.mark.parametrize("shape", [(1, 1), (129, 257), (256, 384), (3, 130, 200)])
@pytest.mark.parametrize("block_size", [(128, 128), (64, 32), (1, 128), (7, 5)])
def test_other_block_sizes_match_reference(qhelp, shape, block_size):
    x = qhelp.make_input(shape, torch.bfloat16, seed=sum(shape) + block_size[0])
    for fmt in ("fp32", "ue8m0"):
        q, s = quantize_blockwise(x, block_size=block_size, scale_format=fmt)
        qr, sr = quantize_blockwise_reference(x, block_size=block_size, scale_format=fmt)
        qhelp.assert_same_bytes(s, sr, f"scale_inv {shape} {block_size} {fmt}")
        qhelp.assert_same_bytes(q, qr, f"q {shape} {block_size} {fmt}")


def test_edge_blocks_use_only_real_elements():
    # 129 x 257: the last row block holds 1 row and the last column block 1 column.
    x = torch.full((129, 257), 100.0)
    x[128, :] = 0.5  # the bottom edge row: its blocks must not see the 100s above
    x[:128, 256] = 3.0  # the right edge column
    x[128, 256] = 0.25  # the corner block holds this one element
    _, s = quantize_blockwise(x)
    assert s.shape == (2, 3)
    assert torch.equal(s[0, :2], torch.full((2,), 100.0 / 448))
    assert s[0, 2].item() == pytest.approx(3.0 / 448, rel=2**-23)
    assert torch.equal(s[1, :2], torch.full((2,), torch.tensor(0.5 / 448, dtype=torch.float32).item()))
    assert s[1, 2].item() == torch.tensor(0.25 / 448, dtype=torch.float32).item()


def test_zero_blocks_get_scale_one_and_zero_codes():
    x = torch.randn(256, 256)
    x[:128, 128:] = 0
    x[128:, :128] = -0.0
    for fmt in ("fp32", "ue8m0"):
        q, s = quantize_blockwise(x, scale_format=fmt)
        assert s[0, 1].item() == 1.0 and s[1, 0].item() == 1.0
        assert torch.isfinite(s).all()
        assert (q[:128, 128:].view(torch.uint8) == 0).all()
        assert (q[128:, :128].view(torch.uint8) == 0x80).all()  # -0.0 keeps its sign, like the GPU cast


def test_tiny_blocks_hit_the_scale_floor():
    x = torch.full((128, 128), 2.0**-140)  # amax / 448 is below 2**-126
    q, s = quantize_blockwise(x)
    assert s.item() == 2.0**-126
    # 2**-140 / 2**-126 = 2**-14: below half the smallest e4m3 subnormal (2**-9) -> 0
    assert (q.view(torch.uint8) == 0).all()


@settings(max_examples=40, deadline=None)
@given(shape=weight_shapes(), dtype=DTYPES, seed=st.integers(0, 2**31 - 1))
def test_ue8m0_scales_are_powers_of_two_covering_amax(qhelp, shape, dtype, seed):
    x = qhelp.make_input(shape, dtype, seed)
    _, s_fp32 = quantize_blockwise(x, scale_format="fp32")
    q, s = quantize_blockwise(x, scale_format="ue8m0")
    assert is_pow2(s).all()
    assert (s >= s_fp32).all() and (s < 2 * s_fp32).all()  # the smallest power of two >= amax/448
    # so no element is clamped: |q| <= 448 and the block maximum maps into (224, 448]
    assert q.to(torch.float32).abs().max() <= FP8_MAX


@settings(max_examples=40, deadline=None)
@given(shape=weight_shapes(), dtype=DTYPES, fmt=FORMATS, seed=st.integers(0, 2**31 - 1))
def test_dequantize_error_is_at_most_half_an_e4m3_step(qhelp, shape, dtype, fmt, seed):
    x = qhelp.make_input(shape, dtype, seed)
    q, s = quantize_blockwise(x, scale_format=fmt)
    s_full = dequantize_blockwise(torch.ones_like(q, dtype=torch.float32).to(torch.float8_e4m3fn), s)
    s64 = s_full.to(torch.float64)
    v = x.to(torch.float64) / s64  # the exact quotient
    err = (q.to(torch.float64) * s64 - x.to(torch.float64)).abs()
    # half the e4m3 spacing at |v|, plus the float32 rounding of the quotient (half an ulp of 2**-24)
    bound = (0.5 * qhelp.e4m3_spacing(v) + v.abs() * 2.0**-24) * s64
    worst = (err - bound).max()
    assert worst <= 0, f"dequantization error exceeds half an e4m3 step by {worst.item()}"
    # dequantize_blockwise itself is q * scale per element
    dq = dequantize_blockwise(q, s)
    assert torch.equal(dq, q.to(torch.float32) * s_full)


@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("shape", [(129, 257), (2, 256, 130)])
def test_round_trip_is_stable(qhelp, fmt, shape):
    """Quantizing the dequantized weight gives the same codes (and, for ue8m0, the same scales)."""
    x = qhelp.make_input(shape, torch.bfloat16, seed=7)
    q, s = quantize_blockwise(x, scale_format=fmt)
    q2, s2 = quantize_blockwise(dequantize_blockwise(q, s), scale_format=fmt)
    qhelp.assert_same_bytes(q2, q, "re-quantized codes")
    if fmt == "ue8m0":
        qhelp.assert_same_bytes(s2, s, "re-quantized pow2 scales")  # q * 2**e is exact in float32
    else:
        # the float32 product q * scale rounds; the recovered scale is within one float32 ulp
        assert ((s2.to(torch.float64) - s.to(torch.float64)).abs() <= s.to(torch.float64) * 2.0**-23).all()


def test_fp32_quotient_is_rounded_before_e4m3():
    """Pin the documented two-step rounding (formats.py): float32 quotient first, then e4m3.

    amax = 448 + 2**-15 gives scale 1 + 2**-23; the exact quotient of 1.1875 + 2**-23
    lies just *below* the e4m3 midpoint 1.1875 (so the nearest e4m3 value is 1.125),
    but it rounds to 1.1875 in float32 and ties-to-even then gives 1.25, which is what
    a float32 GPU kernel produces too.
    """
    x = torch.tensor([[448 + 2**-15, 1.1875 + 2**-23]], dtype=torch.float32)
    q, s = quantize_blockwise(x)
    assert s.item() == 1 + 2**-23
    exact = x.to(torch.float64)[0, 1].item() / s.item()
    assert 1.125 < exact < 1.1875
    assert q.to(torch.float32).tolist() == [[448.0, 1.25]]


def test_non_contiguous_input(qhelp):
    x = qhelp.make_input((200, 300), torch.float32, seed=3)
    xt = x.t()  # [300, 200], non-contiguous
    q, s = quantize_blockwise(xt)
    qr, sr = quantize_blockwise(xt.contiguous())
    qhelp.assert_same_bytes(q, qr, "q of a transposed view")
    qhelp.assert_same_bytes(s, sr, "scale of a transposed view")


# ---------------------------------------------------------------- errors


def test_nan_names_the_block():
    x = torch.randn(300, 400)
    x[130, 260] = float("nan")  # row block 1, column block 2
    with pytest.raises(NonFiniteError) as info:
        quantize_blockwise(x, name="layers.3.mlp.fc1.weight")
    err = info.value
    assert err.block == (1, 2)
    assert err.name == "layers.3.mlp.fc1.weight"
    msg = str(err)
    assert "row_block=1, col_block=2" in msg and "'layers.3.mlp.fc1.weight'" in msg
    assert "dim 0 [128:256]" in msg and "dim 1 [256:384]" in msg and "sanitize" in msg


@pytest.mark.parametrize("bad", [float("inf"), float("-inf")])
def test_inf_in_expert_stack_names_the_expert(bad):
    x = torch.randn(4, 130, 140, dtype=torch.bfloat16)
    x[2, 129, 5] = bad
    x[3, 0, 0] = bad
    with pytest.raises(NonFiniteError) as info:
        quantize_blockwise(x, name="experts.w1")
    assert info.value.block == (2, 1, 0)
    assert "expert=2, row_block=1, col_block=0" in str(info.value)
    assert "2 non-finite value(s)" in str(info.value) and "2 block(s) affected" in str(info.value)


def test_sanitize_replaces_nonfinite_with_zero(qhelp):
    x = qhelp.make_input((130, 130), torch.float32, seed=11)
    bad = x.clone()
    bad[0, 0], bad[129, 129], bad[5, 100] = float("nan"), float("inf"), float("-inf")
    clean = bad.clone()
    clean[0, 0] = clean[129, 129] = clean[5, 100] = 0
    q, s = quantize_blockwise(bad, nonfinite="sanitize")
    qr, sr = quantize_blockwise(clean)
    qhelp.assert_same_bytes(q, qr, "sanitized q")
    qhelp.assert_same_bytes(s, sr, "sanitized scale")
    assert torch.isnan(bad[0, 0])  # the caller's tensor is untouched


@pytest.mark.parametrize(
    ("x", "kwargs", "match"),
    [
        (torch.randn(8), {}, r"rank 1 .*expected rank 2 or 3"),
        (torch.randn(1, 2, 3, 4), {}, r"rank 4"),
        (torch.ones(4, 4, dtype=torch.int32), {}, r"dtype torch.int32"),
        (torch.zeros(4, 4).to(torch.float8_e4m3fn), {}, r"float8_e4m3fn.*cast integer or FP8"),
        (torch.randn(0, 128), {}, r"is empty"),
        (torch.randn(4, 4), {"block_size": (0, 128)}, r"block_size must be two positive ints"),
        (torch.randn(4, 4), {"block_size": (128,)}, r"block_size"),
        (torch.randn(4, 4), {"scale_format": "e8m0"}, r"unknown scale_format 'e8m0'; valid names: \['fp32', 'ue8m0'\]"),
        (torch.randn(4, 4), {"nonfinite": "ignore"}, r"unknown nonfinite policy 'ignore'"),
        (torch.randn(4, 4), {"backend": "cuda"}, r"unknown backend 'cuda'; valid names"),
    ],
)
def test_bad_input_raises_quant_input_error(x, kwargs, match):
    with pytest.raises(QuantInputError, match=match):
        quantize_blockwise(x, name="w", **kwargs)


def test_error_names_the_tensor():
    with pytest.raises(QuantInputError, match=r"tensor 'model.embed'"):
        quantize_blockwise(torch.randn(3), name="model.embed")


def test_dequantize_checks_scale_shape():
    q, s = quantize_blockwise(torch.randn(200, 300))
    with pytest.raises(QuantInputError, match=r"needs \(2, 3\)"):
        dequantize_blockwise(q, s[:, :2])


def test_scale_shape_helper():
    assert blockwise_scale_shape((129, 257)) == (2, 3)
    assert blockwise_scale_shape((4, 128, 128)) == (4, 1, 1)
    assert blockwise_scale_shape((1, 1), (128, 128)) == (1, 1)
    assert math.prod(blockwise_scale_shape((300, 300), (7, 5))) == 43 * 60


@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
def test_deferred_nonfinite_check_reads_nothing_back_and_marks_the_block(fmt):
    from megatron_fp8.refit.opcount import OpCounter

    x = torch.randn(300, 260, generator=torch.Generator().manual_seed(1))
    with OpCounter() as counter:
        q, s = quantize_blockwise(x, scale_format=fmt, nonfinite="defer")
    assert counter.counts.num_host_reads == 0, counter.counts.host_reads
    qr, sr = quantize_blockwise(x, scale_format=fmt)  # finite input: the same bytes as the checked call
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    x[5, 7], x[200, 250] = float("nan"), float("-inf")
    _, s = quantize_blockwise(x, scale_format=fmt, nonfinite="defer")
    assert (~torch.isfinite(s)).nonzero().tolist() == [[0, 0], [1, 1]]
    assert torch.isposinf(s[0, 0]) and torch.isposinf(s[1, 1])
