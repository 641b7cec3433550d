"""NeMo-RL's own DAPO dynamic sampling (``dynamic_sampling`` of its ``grpo.py``, ``calculate_baseline_and_std_per_prompt``
of its ``utils.py`` and its whole ``BatchedDataDict``, run unchanged: ``data/nemo_rl/README.md``) against
:mod:`megatron_fp8.rl.algorithm.dynamic_sampling`, on the same generation rounds: the same samples trained on, in
the same order, the same number of rounds, the same discards, and the run stopped at the same round.

The few lines of NeMo-RL's GRPO loop around the function (count the round, the deviation over the unshaped rewards
when shaping, ``continue`` while the batch is incomplete) are restated in :func:`_nemo_rl_step`."""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from _nemo_rl_code import exec_excerpt, stand_in

from megatron_fp8.errors import DynamicSamplingError
from megatron_fp8.rl.algorithm.dynamic_sampling import SampleBuffer, prompt_reward_std, varying


@pytest.fixture(scope="module")
def nemo_rl() -> types.SimpleNamespace:
    """NeMo-RL's ``dynamic_sampling``, ``calculate_baseline_and_std_per_prompt`` and ``BatchedDataDict``;
    ``sys.modules`` left as found."""
    with mock.patch.dict(sys.modules):
        for name in ("nemo_rl", "nemo_rl.data", "nemo_rl.distributed"):
            sys.modules[name] = stand_in(name, package=True)
        for name in ("nemo_rl.data.multimodal_utils", "nemo_rl.data.packing", "nemo_rl.distributed.collectives"):
            sys.modules[name] = stand_in(name)
        batched = exec_excerpt("nemo_rl.distributed.batched_data_dict", "batched_data_dict.py.txt")
        utils = exec_excerpt("nemo_rl.algorithms.utils", "utils_baseline_std.py.txt")
        # the function's annotations name NeMo-RL's config, datum and timer types: only annotations here
        grpo = exec_excerpt(
            "nemo_rl.algorithms.grpo",
            "grpo_dynamic_sampling.py.txt",
            BatchedDataDict=batched.BatchedDataDict,
            DatumSpec=dict,
            MasterConfig=object,
            Timer=object,
        )
        return types.SimpleNamespace(
            dynamic_sampling=grpo.dynamic_sampling,
            baseline_and_std=utils.calculate_baseline_and_std_per_prompt,
            BatchedDataDict=batched.BatchedDataDict,
        )


class _Timer:
    def time(self, label: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@dataclass(frozen=True)
class _Round:
    ids: list[int]  # the round's sample ids (globally unique), prompt-major
    prompts: torch.Tensor  # int64 [n, 1]: each sample's prompt (one id per group)
    rewards: torch.Tensor  # float32 [n]: the (shaped) rewards
    unshaped: torch.Tensor | None  # float32 [n]: before shaping (None: no shaping)


def _rounds(seed: int, *, prompts: int, group: int, kind: str, shaped: bool, count: int = 40) -> list[_Round]:
    """``count`` generation rounds of ``prompts`` groups of ``group`` samples; some groups' rewards all equal."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(count):
        n = prompts * group
        if kind == "binary":  # math-verify: 0/1, a group all-right or all-wrong now and then
            p = torch.rand(prompts, 1, generator=g).expand(prompts, group)
            rewards = (torch.rand(prompts, group, generator=g) < p * 1.4 - 0.2).float().reshape(-1)
        elif kind == "inexact":  # equal rewards that are not exactly representable (0.7, 0.1, 1/3)
            level = torch.tensor([0.7, 0.1, 1 / 3, 0.0])[torch.randint(0, 4, (prompts, 1), generator=g)]
            vary = torch.rand(prompts, 1, generator=g) < 0.4
            noise = torch.randint(0, 2, (prompts, group), generator=g).float() * 0.2
            rewards = (level + torch.where(vary, noise, torch.zeros_like(noise))).reshape(-1).float()
        else:  # "hard": almost every group all-wrong
            rewards = (torch.rand(n, generator=g) < 0.01).float()
        unshaped = None
        if shaped:  # an overlong penalty: lengths vary inside groups whose task reward does not
            unshaped = rewards
            rewards = rewards - 0.25 * (torch.rand(n, generator=g) < 0.3).float()
        ids = list(range(r * n, (r + 1) * n))
        group_ids = torch.arange(r * prompts, (r + 1) * prompts).repeat_interleave(group)[:, None]
        out.append(_Round(ids, group_ids, rewards.float(), unshaped))
    return out


def _config(*, prompts: int, group: int, max_rounds: int) -> types.SimpleNamespace:
    grpo = types.SimpleNamespace(
        use_dynamic_sampling=True,
        num_prompts_per_step=prompts,
        num_generations_per_prompt=group,
        dynamic_sampling_max_gen_batches=max_rounds,
        deduplicate_multimodal_data=False,
    )
    return types.SimpleNamespace(grpo=grpo)


def _nemo_rl_step(nemo_rl, rounds, *, prompts: int, group: int, max_rounds: int, loo: bool):
    """NeMo-RL's loop for one step: ``(trained ids, rounds, discarded)``, or the error it raises."""
    cfg, cache, k = _config(prompts=prompts, group=group, max_rounds=max_rounds), None, 0
    for rnd in rounds:
        k += 1  # dynamic_sampling_num_gen_batches += 1, before the generation
        batch = nemo_rl.BatchedDataDict({"sample_id": list(rnd.ids), "total_reward": rnd.rewards.clone()})
        if rnd.unshaped is not None:
            batch["unshaped_total_reward"] = rnd.unshaped.clone()
        std_rewards = batch["unshaped_total_reward"] if "unshaped_total_reward" in batch else None
        baseline, std = nemo_rl.baseline_and_std(
            rnd.prompts, batch["total_reward"], torch.ones_like(batch["total_reward"]), leave_one_out_baseline=loo,
            std_rewards=std_rewards,
        )  # fmt: skip
        batch, complete, cache, metrics = nemo_rl.dynamic_sampling(batch, std, baseline, k, cfg, _Timer(), cache)
        if complete:
            return list(batch["sample_id"]), k, metrics["dynamic_sampling_num_discarded_valid_samples"]
    raise AssertionError("ran out of rounds")


def _ours_step(rounds, *, prompts: int, group: int, max_rounds: int, loo: bool):
    buffer: SampleBuffer[int] = SampleBuffer(target=prompts * group, max_rounds=max_rounds)
    for rnd in rounds:
        filter_on = rnd.unshaped if rnd.unshaped is not None else rnd.rewards
        std = prompt_reward_std(filter_on, group_size=group, leave_one_out=loo)
        chosen = buffer.add(varying(rnd.ids, std), generated=len(rnd.ids))  # what the GRPO step calls
        if chosen is not None:
            assert chosen.generated == chosen.rounds * len(rnd.ids)
            return list(chosen.items), chosen.rounds, chosen.discarded
    raise AssertionError("ran out of rounds")


CASES = [
    # (seed, prompts per step, batch multiplier, group, reward kind, shaped, leave-one-out, max rounds)
    (0, 4, 1.0, 4, "binary", False, False, 10),
    (1, 4, 3.0, 4, "binary", False, False, 10),
    (2, 8, 1.5, 8, "binary", True, False, 10),
    (3, 4, 2.0, 4, "binary", False, True, 10),
    (4, 2, 1.0, 2, "binary", False, False, 10),
    (5, 6, 2.0, 4, "inexact", False, False, 10),
    (6, 6, 2.0, 4, "inexact", False, True, 10),
    (7, 4, 1.0, 16, "binary", True, True, 10),
    (8, 4, 1.0, 4, "hard", False, False, 3),  # stops: too few groups with varying rewards
    (9, 4, 1.0, 4, "hard", False, False, 1),
    (10, 3, 3.0, 5, "inexact", True, False, 10),
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{c[0]}" for c in CASES])
def test_same_samples_rounds_and_discards_as_nemo_rl(nemo_rl, case):
    seed, prompts, multiplier, group, kind, shaped, loo, max_rounds = case
    rounds = _rounds(seed, prompts=int(prompts * multiplier), group=group, kind=kind, shaped=shaped)
    kw = {"prompts": prompts, "group": group, "max_rounds": max_rounds, "loo": loo}
    try:
        expected = _nemo_rl_step(nemo_rl, rounds, **kw)
    except ValueError as exc:  # NeMo-RL's stop
        assert "maximum allowed number of batches" in str(exc)
        with pytest.raises(DynamicSamplingError, match="grpo.dynamic_sampling_max_gen_batches"):
            _ours_step(rounds, **kw)
        return
    assert _ours_step(rounds, **kw) == expected


def test_the_cases_exercise_every_branch(nemo_rl):
    """Several rounds, discards, a stop, and LOO deviations that differ inside one group all occur above."""
    seen_rounds, seen_discards, stops = set(), set(), 0
    for seed, prompts, multiplier, group, kind, shaped, loo, max_rounds in CASES:
        rounds = _rounds(seed, prompts=int(prompts * multiplier), group=group, kind=kind, shaped=shaped)
        try:
            _, k, discarded = _ours_step(rounds, prompts=prompts, group=group, max_rounds=max_rounds, loo=loo)
        except DynamicSamplingError:
            stops += 1
            continue
        seen_rounds.add(k > 1)
        seen_discards.add(discarded > 0)
    assert seen_rounds == {True, False} and seen_discards == {True, False} and stops == 2
    split = prompt_reward_std(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, leave_one_out=True)
    assert split[0] == 0 and bool((split[1:] > 0).all())  # RLOO: the odd one out sees equal rewards


def test_a_group_of_equal_inexact_rewards_is_kept_or_dropped_as_nemo_rl_keeps_it(nemo_rl):
    for value in (0.7, 0.1, 1 / 3, 0.3, 1.0, 0.0):
        rewards = torch.full((6,), value, dtype=torch.float32)
        _, theirs = nemo_rl.baseline_and_std(torch.zeros(6, 1), rewards, torch.ones(6), leave_one_out_baseline=False)
        assert torch.equal(prompt_reward_std(rewards, group_size=6, leave_one_out=False), theirs)
