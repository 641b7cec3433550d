"""Per-tensor and per-channel quantizers against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8.errors import NonFiniteError, QuantInputError
from megatron_fp8.quant import (
    dequantize_per_channel,
    dequantize_tensorwise,
    quantize_per_channel,
    quantize_tensorwise,
)
from megatron_fp8.quant.reference import quantize_per_token_group_reference

DTYPES = st.sampled_from([torch.bfloat16, torch.float16, torch.float32])
FORMATS = st.sampled_from(["fp32", "ue8m0"])


@settings(max_examples=50, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
    dtype=DTYPES,
    fmt=FORMATS,
    seed=st.integers(0, 2**31 - 1),
)
def test_tensorwise_matches_reference(qhelp, shape, dtype, fmt, seed):
    x = qhelp.make_input(shape, dtype, seed)
    q, s = quantize_tensorwise(x, scale_format=fmt)
    # one group spanning the whole tensor is exactly the tensorwise rule
    qr, sr = quantize_per_token_group_reference(x.reshape(1, -1), group_size=x.numel(), scale_format=fmt)
    assert s.dim() == 0 and q.shape == x.shape
    qhelp.assert_same_bytes(s.reshape(1, 1), sr, "tensor scale")
    qhelp.assert_same_bytes(q.reshape(1, -1), qr, "tensorwise q")
    assert torch.equal(dequantize_tensorwise(q, s), q.to(torch.float32) * s)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 300), dtype=DTYPES, fmt=FORMATS, seed=st.integers(0, 2**31 - 1))
def test_per_channel_matches_reference(qhelp, n, k, dtype, fmt, seed):
    x = qhelp.make_input((n, k), dtype, seed)
    q, s = quantize_per_channel(x, scale_format=fmt)
    qr, sr = quantize_per_token_group_reference(x, group_size=k, scale_format=fmt)
    assert s.shape == (n, 1)
    qhelp.assert_same_bytes(s, sr, "per-channel scale")
    qhelp.assert_same_bytes(q, qr, "per-channel q")
    assert torch.equal(dequantize_per_channel(q, s), q.to(torch.float32) * s)


def test_zero_tensor_gets_scale_one():
    q, s = quantize_tensorwise(torch.zeros(3, 5))
    assert s.item() == 1.0 and (q.view(torch.uint8) == 0).all()
    q, s = quantize_per_channel(torch.zeros(3, 5))
    assert s.flatten().tolist() == [1.0, 1.0, 1.0]


def test_nonfinite():
    x = torch.randn(6, 7)
    x[4, 2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"'w'.*tensor=0"):
        quantize_tensorwise(x, name="w")
    with pytest.raises(NonFiniteError) as info:
        quantize_per_channel(x, name="w")
    assert info.value.block[0] == 4 and "row=4" in str(info.value)
    q, s = quantize_tensorwise(x, nonfinite="sanitize")
    assert torch.isfinite(s) and not torch.isnan(q.to(torch.float32)).any()


@pytest.mark.parametrize(
    ("fn", "x", "match"),
    [
        (quantize_tensorwise, torch.tensor(2.0), r"rank 0"),
        (quantize_tensorwise, torch.ones(3, dtype=torch.int8), r"dtype torch.int8"),
        (quantize_tensorwise, torch.ones(0), r"is empty"),
        (quantize_per_channel, torch.ones(2, 3, 4), r"rank 3 .*expected rank 2"),
        (quantize_per_channel, torch.zeros(2, 2).to(torch.float8_e4m3fn), r"float8_e4m3fn"),
    ],
)
def test_bad_input(fn, x, match):
    with pytest.raises(QuantInputError, match=match):
        fn(x, name="w")


def test_dequantize_shape_checks():
    q, s = quantize_per_channel(torch.randn(4, 8))
    with pytest.raises(QuantInputError, match=r"needs scale_inv \[4, 1\]"):
        dequantize_per_channel(q, s[:2])
    with pytest.raises(QuantInputError, match=r"must hold one value"):
        dequantize_tensorwise(q, s)
