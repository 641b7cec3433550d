"""Integer layout math of megatron_fp8/layout.py: where engines sharded over trainer ranks can live."""

from __future__ import annotations

import pytest

from megatron_fp8.layout import engine_group_problem, engine_of_rank, even_split


def _replicas(world: int, tp: int, pp: int) -> list[list[int]]:
    """Megatron-Core's model-parallel groups in its default rank order (TP fastest, then DP, then PP)."""
    dp = world // (tp * pp)
    return [[t + tp * d + tp * dp * p for p in range(pp) for t in range(tp)] for d in range(dp)]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("engine_ranks", [1, 2, 4])
def test_an_approved_engine_lies_in_one_replica_and_engines_tile_it(world, tp, pp, engine_ranks):
    if world % (tp * pp):
        return
    problem = engine_group_problem(world_size=world, engine_ranks=engine_ranks, tp=tp, pp=pp)
    spans = any(len({r // engine_ranks for r in g}) * engine_ranks != len(g) for g in _replicas(world, tp, pp))
    assert (problem is None) == (world % engine_ranks == 0 and not spans), problem
    if problem is not None:
        return
    for group in _replicas(world, tp, pp):
        seen = {}
        for rank in group:
            engine, engines, leader = engine_of_rank(rank, group, engine_ranks)
            assert engines == len(group) // engine_ranks and 0 <= engine < engines
            assert leader == (rank % engine_ranks == 0)
            seen.setdefault(engine, set()).add(rank)
        assert all(len(ranks) == engine_ranks for ranks in seen.values())  # each engine: its whole block
        parts = even_split(64, len(seen))
        assert sum(b - a for a, b in parts) == 64


def test_the_refusal_says_how_many_replicas_an_engine_would_span():
    assert "span 2 data-parallel replicas (trainer TP 1, DP 2)" in engine_group_problem(
        world_size=2, engine_ranks=2, tp=1, pp=1
    )
    assert "do not split into engines of 4" in engine_group_problem(world_size=6, engine_ranks=4, tp=2, pp=1)


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 0, 4), (0,), (4, 1, 6, 2)])
def test_contiguous_strides_are_torchs(shape):
    import torch

    from megatron_fp8.layout import contiguous_strides

    assert contiguous_strides(shape) == torch.empty(shape).stride()
