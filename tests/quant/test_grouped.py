"""Group quantization into caller-owned outputs: the bytes of the per-weight quantizer, for every shape class."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8.errors import QuantInputError
from megatron_fp8.quant import blockwise_scale_shape, quantize_blockwise
from megatron_fp8.quant.grouped import BlockwiseTarget, quantize_blockwise_into

DTYPES = st.sampled_from([torch.bfloat16, torch.float16, torch.float32])
FORMATS = st.sampled_from(["fp32", "ue8m0"])


@st.composite
def weight_shapes(draw):
    """[N, K] or [E, N, K]: 1x1, edge sizes around 128, and small odd sizes (as tests/quant/test_blockwise.py)."""
    dim = st.one_of(st.integers(1, 300), st.sampled_from([1, 127, 128, 129, 256, 257]))
    n, k = draw(dim), draw(dim)
    if draw(st.booleans()):
        return (draw(st.integers(1, 3)), min(n, 140), min(k, 140))
    return (n, k)


def _targets(xs, block_size=(128, 128)):
    return [
        BlockwiseTarget(
            x,
            torch.full(x.shape, 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn),  # garbage: every byte is written
            torch.full(blockwise_scale_shape(x.shape, block_size), -1.0),
            f"w{i}",
        )
        for i, x in enumerate(xs)
    ]


def _assert_same_as_per_weight(qhelp, xs, targets, *, block_size=(128, 128), scale_format="fp32"):
    for x, t in zip(xs, targets, strict=True):
        q, s = quantize_blockwise(x, block_size=block_size, scale_format=scale_format, nonfinite="defer")
        qhelp.assert_same_bytes(t.scales, s, f"scales of {t.name} {tuple(x.shape)} {x.dtype} {scale_format}")
        qhelp.assert_same_bytes(t.codes, q, f"codes of {t.name} {tuple(x.shape)} {x.dtype} {scale_format}")


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(weight_shapes(), min_size=1, max_size=5),
    dtype=DTYPES,
    fmt=FORMATS,
    seed=st.integers(0, 2**31 - 1),
    workspace_tiles=st.sampled_from([1, 2, 5, 1 << 20]),
)
def test_group_bytes_equal_the_per_weight_quantizer(qhelp, shapes, dtype, fmt, seed, workspace_tiles):
    xs = [qhelp.make_input(shape, dtype, seed + i) for i, shape in enumerate(shapes)]
    targets = _targets(xs)
    quantize_blockwise_into(targets, scale_format=fmt, workspace_bytes=workspace_tiles * 128 * 128 * 4)
    _assert_same_as_per_weight(qhelp, xs, targets, scale_format=fmt)


@pytest.mark.parametrize("block_size", [(128, 128), (64, 32), (1, 128), (7, 5)])
def test_other_block_sizes(qhelp, block_size):
    xs = [
        qhelp.make_input(s, torch.bfloat16, seed=i)
        for i, s in enumerate([(1, 1), (129, 257), (256, 384), (3, 130, 200)])
    ]
    for fmt in ("fp32", "ue8m0"):
        targets = _targets(xs, block_size)
        quantize_blockwise_into(targets, block_size=block_size, scale_format=fmt, workspace_bytes=1 << 16)
        _assert_same_as_per_weight(qhelp, xs, targets, block_size=block_size, scale_format=fmt)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nonfinite_blocks_get_inf_scales_and_the_deferred_bytes(qhelp, bad, dtype):
    xs = [qhelp.make_input(s, dtype, seed=3) for s in [(300, 260), (2, 129, 140), (128, 128)]]
    xs[0][140, 3] = bad  # row block 1, column block 0
    xs[1][1, 128, 139] = bad  # expert 1, the corner block
    targets = _targets(xs)
    quantize_blockwise_into(targets)
    _assert_same_as_per_weight(qhelp, xs, targets)
    assert torch.isinf(targets[0].scales[1, 0]) and torch.isfinite(targets[0].scales).sum() == 8
    assert torch.isinf(targets[1].scales[1, 1, 1]) and torch.isfinite(targets[2].scales).all()


def test_rounding_edge_cases(qhelp):
    """The pinned tie case of formats.py, amax exactly at 448 multiples, subnormal blocks, +-0."""
    x = torch.zeros(256, 384, dtype=torch.float32)
    x[0, 0], x[0, 1] = 448 + 2**-15, 1.1875 + 2**-23
    x[0, 128], x[1, 129] = 448.0, -448.0
    x[0, 256], x[5, 300] = 2**-130, -(2**-140)  # below 448 * 2**-126: the scale floor
    x[128, 0:128] = torch.linspace(-1, 1, 128) * 3e38  # near float32 max
    x[200, 200] = -0.0
    targets = _targets([x, x.to(torch.bfloat16), x.t()])
    quantize_blockwise_into(targets)
    _assert_same_as_per_weight(qhelp, [x, x.to(torch.bfloat16), x.t()], targets)


def test_caller_copies_ride_in_the_first_multi_tensor_copy():
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    dst, src = torch.zeros(10), torch.arange(10.0)
    targets = _targets([x])
    quantize_blockwise_into(targets, copies=([dst], [src]))
    assert torch.equal(dst, src)
    quantize_blockwise_into([], copies=([dst[:2]], [torch.ones(2)]))
    assert dst[:2].tolist() == [1.0, 1.0]


def test_bad_outputs_are_refused():
    x = torch.randn(130, 140, dtype=torch.bfloat16)
    with pytest.raises(QuantInputError, match="codes of 'w'"):
        quantize_blockwise_into([BlockwiseTarget(x, torch.empty(130, 140), torch.empty(2, 2), "w")])
    with pytest.raises(QuantInputError, match="scales of 'w' must be contiguous float32"):
        quantize_blockwise_into(
            [BlockwiseTarget(x, torch.empty(130, 140, dtype=torch.float8_e4m3fn), torch.empty(2, 3), "w")]
        )
    with pytest.raises(QuantInputError, match="rank"):
        quantize_blockwise_into([BlockwiseTarget(x[0], x[0].to(torch.float8_e4m3fn), torch.empty(2), "w")])
