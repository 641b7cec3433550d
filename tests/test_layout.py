"""Integer layout math of megatron_fp8/layout.py: where engines sharded over trainer ranks can live."""

from __future__ import annotations

import pytest

from megatron_fp8.layout import engine_group_problem, engine_of_rank, engine_replica_span, even_split


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
    replicas = _replicas(world, tp, pp)
    dp = world // (tp * pp)
    spans = any(len({r // engine_ranks for r in g}) * engine_ranks != len(g) for g in replicas)
    # an engine larger than the trainer's TP over several replicas holds their TP groups (one stage of each)
    holds = engine_ranks % tp == 0 and dp % (engine_ranks // tp) == 0
    assert (problem is None) == (world % engine_ranks == 0 and (not spans or holds or dp == 1)), problem
    if problem is not None:
        return
    span = engine_replica_span(engine_ranks=engine_ranks, tp=tp, pp=pp, dp=dp)
    if spans and dp > 1:
        assert span == engine_ranks // tp >= 2
        for block in range(world // engine_ranks):  # each engine: the TP groups of `span` consecutive replicas
            held = set(range(block * engine_ranks, (block + 1) * engine_ranks))
            stage, first = divmod(block * span, dp)
            assert held == {t + tp * (d + dp * stage) for d in range(first, first + span) for t in range(tp)}
        return
    for group in replicas:
        seen = {}
        for rank in group:
            engine, engines, leader = engine_of_rank(rank, group, engine_ranks)
            assert engines == len(group) // engine_ranks and 0 <= engine < engines
            assert leader == (rank % engine_ranks == 0)
            seen.setdefault(engine, set()).add(rank)
        assert all(len(ranks) == engine_ranks for ranks in seen.values())  # each engine: its whole block
        parts = even_split(64, len(seen))
        assert sum(b - a for a, b in parts) == 64


def test_the_refusal_says_how_many_replicas_an_engine_would_span_and_why():
    assert engine_group_problem(world_size=2, engine_ranks=2, tp=1, pp=1) is None  # holds both replicas
    assert engine_replica_span(engine_ranks=2, tp=1, pp=1, dp=2) == 2
    assert engine_replica_span(engine_ranks=8, tp=4, pp=1, dp=2) == 2  # NeMo-RL's 70B rollout TP 8 over TP 4, at PP 1
    assert engine_group_problem(world_size=64, engine_ranks=8, tp=4, pp=8) is None  # NeMo-RL's 70B FP8 layout
    assert engine_replica_span(engine_ranks=8, tp=4, pp=8, dp=2) == 2  # one stage of both replicas per engine
    assert "would hold parts of replicas' TP groups" in engine_group_problem(world_size=6, engine_ranks=3, tp=2, pp=1)
    assert "the 3 replicas do not split into groups of 2" in engine_group_problem(
        world_size=6, engine_ranks=2, tp=1, pp=2
    )
    assert "do not split into engines of 4" in engine_group_problem(world_size=6, engine_ranks=4, tp=2, pp=1)


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 0, 4), (0,), (4, 1, 6, 2)])
def test_contiguous_strides_are_torchs(shape):
    import torch

    from megatron_fp8.layout import contiguous_strides

    assert contiguous_strides(shape) == torch.empty(shape).stride()
