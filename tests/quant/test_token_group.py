"""Per-token-group (1 x 128) activation quantizer, torch path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8.errors import NonFiniteError, QuantInputError
from megatron_fp8.quant import dequantize_per_token_group, is_pow2, quantize_per_token_group
from megatron_fp8.quant.reference import quantize_per_token_group_reference


def _f32(v: float) -> float:
    """``v`` rounded to float32 (what a float32 scale holds)."""
    return torch.tensor(v, dtype=torch.float32).item()


@st.composite
def activation_shapes(draw):
    lead = draw(st.lists(st.integers(1, 9), min_size=0, max_size=2))
    k = draw(st.one_of(st.integers(1, 400), st.sampled_from([1, 127, 128, 129, 256, 384])))
    return (*lead, k)


@settings(max_examples=60, deadline=None)
@given(
    shape=activation_shapes(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    fmt=st.sampled_from(["fp32", "ue8m0"]),
    group_size=st.sampled_from([128, 64, 100, 1]),
    seed=st.integers(0, 2**31 - 1),
)
def test_bytes_equal_float64_reference(qhelp, shape, dtype, fmt, group_size, seed):
    x = qhelp.make_input(shape, dtype, seed)
    q, s = quantize_per_token_group(x, group_size=group_size, scale_format=fmt)
    qr, sr = quantize_per_token_group_reference(x, group_size=group_size, scale_format=fmt)
    assert q.shape == x.shape and s.shape == (*shape[:-1], qhelp.ceil_div(shape[-1], group_size))
    qhelp.assert_same_bytes(s, sr, f"scale_inv {shape} {dtype} {fmt} g={group_size}")
    qhelp.assert_same_bytes(q, qr, f"q {shape} {dtype} {fmt} g={group_size}")
    if fmt == "ue8m0":
        assert is_pow2(s).all()


def test_partial_last_group_uses_only_real_elements():
    x = torch.full((2, 130), 64.0)
    x[:, 128:] = torch.tensor([1.0, -2.0])  # the last group holds 2 real elements
    q, s = quantize_per_token_group(x)
    assert s.shape == (2, 2)
    assert s[:, 0].tolist() == [_f32(64.0 / 448)] * 2
    assert s[:, 1].tolist() == [_f32(2.0 / 448)] * 2
    assert q[:, 128:].to(torch.float32).tolist() == [[224.0, -448.0]] * 2


def test_each_token_has_its_own_scale():
    x = torch.stack([torch.full((128,), 1.0), torch.zeros(128), torch.full((128,), -448.0)])
    q, s = quantize_per_token_group(x)
    assert s.flatten().tolist() == [_f32(1 / 448), 1.0, 1.0]
    assert q.to(torch.float32)[:, 0].tolist() == [448.0, 0.0, -448.0]


def test_dequantize_round_trip(qhelp):
    x = qhelp.make_input((3, 5, 300), torch.bfloat16, seed=5)
    q, s = quantize_per_token_group(x, scale_format="ue8m0")
    dq = dequantize_per_token_group(q, s)
    q2, s2 = quantize_per_token_group(dq, scale_format="ue8m0")
    qhelp.assert_same_bytes(q2, q, "re-quantized activations")
    qhelp.assert_same_bytes(s2, s, "re-quantized scales")
    full = s.repeat_interleave(128, dim=-1)[..., :300]
    v = x.to(torch.float64) / full.to(torch.float64)
    err = (dq.to(torch.float64) - x.to(torch.float64)).abs()
    assert (err <= 0.5 * qhelp.e4m3_spacing(v) * full.to(torch.float64)).all()  # pow2 scale: exact quotient


def test_nan_names_token_and_group():
    x = torch.randn(4, 3, 300)
    x[2, 1, 290] = float("nan")  # flat token 2*3+1 = 7, group 2
    with pytest.raises(NonFiniteError) as info:
        quantize_per_token_group(x, name="hidden")
    assert info.value.block == (7, 2)
    assert "token=7, group=2" in str(info.value) and "'hidden'" in str(info.value)


def test_sanitize(qhelp):
    x = qhelp.make_input((5, 200), torch.float16, seed=1)
    bad = x.clone()
    bad[1, 150] = float("inf")
    clean = bad.clone()
    clean[1, 150] = 0
    q, s = quantize_per_token_group(bad, nonfinite="sanitize")
    qr, sr = quantize_per_token_group(clean)
    qhelp.assert_same_bytes(q, qr, "sanitized q")
    qhelp.assert_same_bytes(s, sr, "sanitized scale")


@pytest.mark.parametrize(
    ("x", "kwargs", "match"),
    [
        (torch.tensor(1.0), {}, r"rank 0"),
        (torch.ones(4, 4, dtype=torch.int64), {}, r"dtype torch.int64"),
        (torch.zeros(4, 4).to(torch.float8_e5m2), {}, r"float8_e5m2"),
        (torch.randn(3, 0), {}, r"is empty"),
        (torch.randn(4, 4), {"group_size": 0}, r"group_size must be a positive int, got 0"),
        (torch.randn(4, 4), {"group_size": 1.5}, r"group_size must be a positive int"),
        (torch.randn(4, 4), {"scale_format": "fp16"}, r"unknown scale_format 'fp16'; valid names"),
    ],
)
def test_bad_input(x, kwargs, match):
    with pytest.raises(QuantInputError, match=match):
        quantize_per_token_group(x, name="act", **kwargs)


def test_dequantize_checks_scale_shape():
    q, s = quantize_per_token_group(torch.randn(4, 300))
    with pytest.raises(QuantInputError, match=r"needs \(4, 3\)"):
        dequantize_per_token_group(q, s[:, :2])
