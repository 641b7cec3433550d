"""Issue 54: the trainer's micro-batch layouts (``megatron_fp8.megatron.microbatch``) on the embedded tiny model.

What a layout must keep: every row in exactly one micro-batch, the token budget, one shape per pass under pipeline
parallelism; and what the model computes through it: the log-probabilities of the padded layout (float32 rounding:
the bound each test states is what it measures, with margin), and the same gradients, so a step's update is the
padded step's. Packed micro-batches run Megatron-Core's own THD path (``PackedSeqParams``: the rotary embedding
restarts at each sequence), only the attention kernel differing on CPU (the local attention over each sequence alone,
patch 6 of the adapter).
"""

from __future__ import annotations

import pytest
import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron import build_megatron_model, make_optimizer, megatron_parallel, train_step
from megatron_fp8.megatron.microbatch import BatchLayout, TokenTally, plan_micro_batches, row_lengths
from megatron_fp8.megatron.step import sequence_logprobs
from megatron_fp8.models import tiny_model_path

LOGPROB_BOUND = 1e-5
"""Max |log p| difference to the padded layout on real tokens (float32; measured ~1e-6 on the tiny model)."""
LR = 1e-3
GRAD_REL = 1e-5
"""Relative difference of a train step's loss and gradient norm to the padded step's (float32 sums in another order)."""


def _batch(lengths: list[int], *, seed: int = 0, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.full((len(lengths), t), pad, dtype=torch.int64)
    mask = torch.zeros(len(lengths), t, dtype=torch.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(4, 360, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


LENGTHS = [5, 31, 3, 12, 9, 40, 7, 22, 16, 4, 28, 11]
LAYOUTS = {
    "dynamic": BatchLayout(kind="dynamic", tokens=96, round_to=8, key="policy.dynamic_batching.train_mb_tokens"),
    "packed": BatchLayout(kind="packed", tokens=64, key="policy.sequence_packing.train_mb_tokens"),
    "packed-rounded": BatchLayout(kind="packed", tokens=64, round_to=16, key="k"),
    "packed-largest-first": BatchLayout(kind="packed", tokens=80, largest_first=True, key="k"),
    "packed-ffd": BatchLayout(kind="packed", tokens=64, algorithm="first_fit_decreasing", key="k"),
}


# ----------------------------------------------------------------------------- the plan (no model)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_row_once_within_the_budget(name):
    layout = LAYOUTS[name]
    ids, mask = _batch(LENGTHS)
    plan = plan_micro_batches(ids, mask, layout)
    rows = sorted(int(r) for mb in plan for r in mb.rows)
    assert rows == list(range(len(LENGTHS)))
    for mb in plan:
        assert mb.computed_tokens <= layout.tokens
        assert list(mb.lengths) == [LENGTHS[int(r)] for r in mb.rows]
        if layout.is_packed:
            assert mb.input_ids.shape[0] == 1 and mb.input_ids.shape[1] % layout.round_to == 0
            assert int(mb.cu_seqlens[-1]) == mb.input_ids.shape[1]
            for j, r in enumerate(mb.rows.tolist()):  # each sequence's tokens, positions from 0
                start, n = int(mb.cu_seqlens[j]), LENGTHS[r]
                assert torch.equal(mb.input_ids[0, start : start + n], ids[r, :n])
                assert torch.equal(mb.position_ids[0, start : start + n], torch.arange(n))
    tally = TokenTally()
    tally.add(plan)
    assert tally.real == sum(LENGTHS) and tally.computed >= tally.real


def test_packing_computes_fewer_tokens_than_dynamic_than_rows():
    ids, mask = _batch(LENGTHS)
    computed = {}
    for name, layout in (
        ("rows", BatchLayout(kind="rows", rows=4)),
        ("dynamic", LAYOUTS["dynamic"]),
        ("packed", LAYOUTS["packed"]),
    ):
        tally = TokenTally()
        tally.add(plan_micro_batches(ids, mask, layout))
        computed[name] = tally.computed
    assert computed["packed"] < computed["dynamic"] < computed["rows"] == len(LENGTHS) * max(LENGTHS)
    assert computed["packed"] <= 1.1 * sum(LENGTHS)


def test_packed_sequences_attend_only_to_themselves():
    ids, mask = _batch([3, 2])
    (mb,) = plan_micro_batches(ids, mask, BatchLayout(kind="packed", tokens=8, round_to=8))
    allowed = ~mb.attention_mask()[0, 0]
    expected = torch.zeros(8, 8, dtype=torch.bool)
    expected[:3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
    expected[3:5, 3:5] = torch.ones(2, 2, dtype=torch.bool).tril()
    expected[5:, 5:] = torch.ones(3, 3, dtype=torch.bool).tril()  # the fill: a sequence of its own
    assert torch.equal(allowed, expected)
    assert mb.cu_seqlens.tolist() == [0, 3, 5, 8]


def test_to_rows_puts_each_position_back():
    ids, mask = _batch(LENGTHS)
    for layout in LAYOUTS.values():
        for mb in plan_micro_batches(ids, mask, layout):
            # a fake score: 1000 x micro-batch token index + position, so every value says where it came from
            b, t = mb.input_ids.shape
            fake = torch.arange(b * t, dtype=torch.float32).reshape(b, t)[:, :-1]
            rows = mb.to_rows(fake)
            assert rows.shape == (len(mb.lengths), max(LENGTHS) - 1)
            for j, n in enumerate(mb.lengths):
                if mb.cu_seqlens is not None:
                    start = int(mb.cu_seqlens[j])
                    assert rows[j, : n - 1].tolist() == list(range(start, start + n - 1))
                else:
                    assert rows[j, : n - 1].tolist() == fake[j, : n - 1].tolist()


def test_a_row_over_the_budget_is_refused_naming_the_key():
    ids, mask = _batch(LENGTHS)
    for kind in ("packed", "dynamic"):
        layout = BatchLayout(kind=kind, tokens=39, key=f"policy.x.train_mb_tokens ({kind})")
        with pytest.raises(ConfigError, match=r"row 5 of the batch has 40 tokens .* policy\.x\.train_mb_tokens"):
            plan_micro_batches(ids, mask, layout)


def test_pipeline_stages_get_one_shape_or_a_refusal():
    ids, mask = _batch(LENGTHS)
    plan = plan_micro_batches(ids, mask, LAYOUTS["packed"], pipeline_stages=2)
    assert len({mb.input_ids.shape for mb in plan}) == 1 and len(plan) > 1
    with pytest.raises(ConfigError, match="dynamic_batching needs one pipeline stage"):
        plan_micro_batches(ids, mask, LAYOUTS["dynamic"], pipeline_stages=2)
    with pytest.raises(ConfigError, match=r"k=5 does not split the 12 rows .* pipeline parallelism"):
        plan_micro_batches(ids, mask, BatchLayout(kind="rows", rows=5, key="k"), pipeline_stages=2)
    assert len(plan_micro_batches(ids, mask, BatchLayout(kind="rows", rows=5, key="k"))) == 3  # one stage: fine


def test_layout_invariants():
    with pytest.raises(ConfigError, match="unknown batch layout"):
        BatchLayout(kind="bucketed")
    with pytest.raises(ConfigError, match="token budget >= 1"):
        BatchLayout(kind="packed", tokens=0, key="policy.sequence_packing.train_mb_tokens")
    with pytest.raises(ConfigError, match="not one of NeMo-RL's"):
        BatchLayout(kind="packed", tokens=8, algorithm="best_fit")
    with pytest.raises(ConfigError, match="must be >= 1"):
        BatchLayout(kind="rows", rows=0)
    assert row_lengths(*_batch([3, 5])) == [3, 5]


# ----------------------------------------------------------------------------- through the model


@pytest.fixture(scope="module")
def parallel():
    with megatron_parallel(seed=3) as state:
        yield state


def _model():
    return build_megatron_model(tiny_model_path("dense"), dtype="fp32")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_logprobs_equal_the_padded_layout(parallel, name):
    m = _model()
    ids, mask = _batch(LENGTHS, seed=1)
    real = mask[:, 1:].bool()
    with torch.no_grad():
        padded = sequence_logprobs(m, ids, attention_mask=mask, temperature=0.7)
        got = sequence_logprobs(m, ids, attention_mask=mask, temperature=0.7, layout=LAYOUTS[name])
    assert (got - padded)[real].abs().max() <= LOGPROB_BOUND
    assert torch.all(got[~real] == 0)


def _token_mean_share(mask: torch.Tensor):
    real = mask[:, 1:].float()
    total = real.sum()

    def loss(logprobs: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        part = real if rows is None else real[rows]
        return -(logprobs * part).sum() / total

    return loss


@pytest.mark.parametrize("name", ["dynamic", "packed"])
def test_a_train_step_equals_the_padded_step(parallel, name):
    """Same loss, same gradient norm, and the same weights after the update (to float32 rounding)."""
    ids, mask = _batch(LENGTHS, seed=2)
    results, weights = [], []
    for layout in (None, LAYOUTS[name]):
        m = _model()
        optimizer = make_optimizer(m, lr=LR)
        loss = _token_mean_share(mask)
        batch = {"input_ids": ids, "attention_mask": mask}
        results.append(
            train_step(m, optimizer, loss, batch, micro_batch_size=4 if layout is None else None, layout=layout)
        )
        weights.append(torch.cat([p.detach().reshape(-1) for p in m.model[0].parameters()]))
    padded, got = results
    assert got.loss == pytest.approx(padded.loss, rel=GRAD_REL)
    assert got.grad_norm == pytest.approx(padded.grad_norm, rel=GRAD_REL)
    # Adam divides each gradient element by its own magnitude, so an element whose gradient is ~0 moves by up to lr
    # on rounding alone: the bound is a small share of lr (measured 8e-6 = 0.008 lr on the tiny model)
    apart = (weights[0] - weights[1]).abs().max()
    assert apart <= 0.05 * LR, f"weights after the update differ by {float(apart)}"


def test_a_dynamic_row_is_checked_rounded_as_nemo_rl_checks_it():
    ids, mask = _batch([30, 10, 40])  # T = 40: a rounding never goes past it
    with pytest.raises(
        ConfigError, match=r"row 0 .* 10 tokens \(prompt \+ response\) \(16 rounded up to sequence_length_round\)"
    ):
        plan_micro_batches(ids[1:2], mask[1:2], BatchLayout(kind="dynamic", tokens=11, round_to=16, key="k"))
    plan = plan_micro_batches(ids, mask, BatchLayout(kind="dynamic", tokens=40, round_to=64, key="k"))
    assert [mb.input_ids.shape for mb in plan] == [torch.Size([1, 40])] * 3  # 64 capped at the batch's 40
