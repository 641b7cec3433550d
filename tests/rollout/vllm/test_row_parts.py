"""layouts.RowParts: a fused tensor as its shards, copied into and compared with its rows part by part (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from megatron_fp8.rollout.vllm.layouts import RowParts, materialized, same_rows, stacked


def _parts(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(rows, 6, generator=g).to(dtype) for rows in (4, 2, 3))


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_copy_into_writes_what_the_concatenation_would(dtype):
    parts = _parts(dtype)
    want = torch.cat(parts)
    rp = RowParts(parts)
    assert rp.shape == tuple(want.shape) and rp.dtype == dtype and rp.dim() == 2
    dst = torch.zeros_like(want)
    rp.copy_into(dst)
    assert _equal(dst, want) and _equal(materialized(rp), want)
    t = torch.zeros(6, 9, dtype=dtype).t()  # a transposed Parameter view, written through its rows
    rp.copy_into(t)
    assert _equal(t, want)


def test_same_rows_compares_each_part_with_its_own_rows():
    parts = _parts()
    held = torch.cat(parts)
    rp = RowParts(parts)
    assert same_rows(held, rp, _equal)
    for row in (0, 4, 8):  # one flipped element in each part's rows
        bad = held.clone()
        bad[row, 5] += 1
        assert not same_rows(bad, rp, _equal)
    assert not same_rows(held[:-1], rp, _equal)  # a shape that cannot hold them
    assert same_rows(held, held.clone(), _equal)  # a plain tensor: the comparison itself


def test_one_part_is_the_tensor_itself_and_bad_parts_are_refused():
    (a, b, _) = _parts()
    assert stacked([a]) is a and isinstance(stacked([a, b]), RowParts)
    with pytest.raises(ValueError, match="2 or more"):
        RowParts((a,))
    with pytest.raises(ValueError, match="differ beyond their rows"):
        RowParts((a, torch.zeros(2, 5)))
    with pytest.raises(ValueError, match="differ beyond their rows"):
        RowParts((a, b.double()))
    with pytest.raises(ValueError, match="copied into"):
        RowParts((a, b)).copy_into(torch.zeros(5, 6))
