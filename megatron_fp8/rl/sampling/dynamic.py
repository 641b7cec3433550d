"""DAPO's dynamic sampling in the step (``grpo.use_dynamic_sampling``): generation rounds until the step has its
samples with varying group rewards.

Each round draws the next data batch (:class:`DataCursor`) of ``num_prompts_per_step x batch_multiplier`` prompts
(:attr:`~megatron_fp8.config.data_schema.GRPOConfig.round_prompts`), rolls it out on every rank as a step without
dynamic sampling would (:func:`~megatron_fp8.rl.sampling.rollout.rollout_phase`: each replica its prompts), scores it
(:func:`~megatron_fp8.rl.sampling.scores.score_phase`: advantages within each group, before any filtering, as NeMo-RL
computes them) and keeps the samples whose deviation within their group is not 0
(:mod:`megatron_fp8.rl.algorithm.dynamic_sampling`). The replicas' kept samples are all-gathered in replica order,
which is the batch's order, so every rank holds the same buffer; once it holds ``num_prompts_per_step x
num_generations_per_prompt``, the first that many are the step's and each replica trains on its even share of them.

The cursor is part of the checkpoint (``data_batches`` in its ``extra``), so a resumed run draws the rounds an
uninterrupted one would; each round's samples are seeded by its batch index.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_fp8.rl.algorithm.dynamic_sampling import SampleBuffer, prompt_reward_std, varying
from megatron_fp8.rl.cluster.distributed import gather_over_replicas
from megatron_fp8.rl.data.rewards import RewardResult
from megatron_fp8.rl.data.task import Problem
from megatron_fp8.rl.sampling.context import GRPOContext
from megatron_fp8.rl.sampling.rollout import RolloutOutcome, RolloutSide, rollout_phase
from megatron_fp8.rl.sampling.scores import Scores, score_phase
from megatron_fp8.rollout.engines import Rollout

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "data_batches"
"""The key of the cursor in a checkpoint's ``extra``."""


@dataclass
class DataCursor:
    """The next data batch a generation round draws (mutable: rounds per step vary with the rewards).

    Attributes:
        next_batch: the index of the next batch (0-based; batch ``b`` holds rows ``b x count .. (b + 1) x count - 1``
            of the data walk).
    """

    next_batch: int = 0

    def take(self) -> int:
        """The next batch's index; the cursor moves past it."""
        batch = self.next_batch
        self.next_batch += 1
        return batch


@dataclass(frozen=True)
class DynamicSamplingStats:
    """What dynamic sampling did in one step (NeMo-RL's metric names in :class:`~megatron_fp8.rl.state.results.StepMetrics`).

    Attributes:
        rounds: generation rounds (``dynamic_sampling_num_gen_batches``).
        discarded: samples with varying rewards beyond the step's need (``..._num_discarded_valid_samples``).
        generated: samples generated over the rounds, every replica.
        filtered: of those, samples left out because their group's rewards were equal.
        reward_mean: mean reward over every generated sample (NeMo-RL's ``reward``; the trained ones' mean is its
            ``filtered_reward``).
        exact_match: share of every generated sample that is exactly right.
    """

    rounds: int
    discarded: int
    generated: int
    filtered: int
    reward_mean: float
    exact_match: float

    @property
    def filtered_share(self) -> float:
        """The share of generated samples left out for equal group rewards."""
        return self.filtered / self.generated if self.generated else 0.0


@dataclass(frozen=True)
class _Sample:
    """One generated sample with its scores: what the replicas exchange."""

    problem: Problem
    prompt_ids: list[int]
    token_ids: tuple[int, ...]
    logprobs: torch.Tensor
    finished: bool
    text: str
    breakdown: RewardResult
    reward: float
    advantage: float
    unshaped: float


def _samples(out: RolloutOutcome, scores: Scores) -> list[_Sample]:
    r = out.rollout
    return [
        _Sample(
            out.problems[i],
            out.prompt_ids[i],
            r.token_ids[i],
            r.logprobs[i],
            r.finished[i],
            scores.texts[i],
            scores.breakdowns[i],
            float(scores.rewards[i]),
            float(scores.advantages[i]),
            float(scores.unshaped[i]),
        )
        for i in range(len(r.token_ids))
    ]


def dynamic_sampling_phase(
    side: RolloutSide, ctx: GRPOContext, *, cursor: DataCursor, step: int
) -> tuple[RolloutOutcome, Scores, DynamicSamplingStats]:
    """Generation rounds until the step has its samples (module docstring); this replica's share of them.

    Args:
        side: the arm's engine and data-parallel place.
        ctx: the run's shared parts.
        cursor: the data position; moved past every round drawn.
        step: the step (for the log lines).

    Returns:
        This replica's samples to train on, their scores (advantages as computed within the full groups), and the
        step's dynamic-sampling statistics (the same on every rank).

    Raises:
        DynamicSamplingError: ``grpo.dynamic_sampling_max_gen_batches`` ran out (on every rank alike).
    """
    g = ctx.config.grpo
    buffer: SampleBuffer[_Sample] = SampleBuffer(
        target=g.num_prompts_per_step * g.num_generations_per_prompt, max_rounds=g.dynamic_sampling_max_gen_batches
    )
    seconds = busy = wait = 0.0
    samples = tokens = 0
    engine = side.engine.name
    totals = [0.0, 0, 0]  # reward sum, exact count, samples: every replica's, every round
    while True:
        batch = cursor.take()
        out = rollout_phase(side, ctx, batch=batch, count=g.round_prompts)
        scores = score_phase(out, ctx)
        seconds, busy, wait = seconds + out.seconds, busy + out.busy_seconds, wait + out.wait_seconds
        samples, tokens, engine = samples + out.generated_samples, tokens + out.generated_tokens, out.rollout.engine
        std = prompt_reward_std(
            scores.unshaped, group_size=g.num_generations_per_prompt, leave_one_out=g.use_leave_one_out_baseline
        )
        mine = (
            varying(_samples(out, scores), std),
            float(scores.rewards.sum()),
            sum(b.exact for b in scores.breakdowns),
            len(scores.breakdowns),
        )
        parts = gather_over_replicas(mine, side.dp)
        kept = [s for part in parts for s in part[0]]  # type: ignore[index]
        round_totals = [sum(part[k] for part in parts) for k in (1, 2, 3)]  # type: ignore[index]
        totals = [a + b for a, b in zip(totals, round_totals, strict=True)]
        chosen = buffer.add(kept, generated=int(round_totals[2]))
        logger.info(
            "step %d: dynamic sampling round %d (data batch %d): %d of %d samples have varying group rewards; %d of %d "
            "held",
            step + 1,
            buffer.rounds,
            batch,
            len(kept),
            int(round_totals[2]),
            min(buffer.kept, buffer.target),
            buffer.target,
        )
        if chosen is not None:
            break
    share: list[_Sample] = side.dp.shard(chosen.items)
    rollout = Rollout(
        token_ids=tuple(s.token_ids for s in share),
        logprobs=tuple(s.logprobs for s in share),
        finished=tuple(s.finished for s in share),
        engine=engine,
    )
    out = RolloutOutcome(
        tuple(s.problem for s in share),
        tuple(s.prompt_ids for s in share),
        rollout,
        seconds,
        samples,
        tokens,
        0,
        busy,
        wait,
    )
    scores = Scores(
        texts=tuple(s.text for s in share),
        breakdowns=tuple(s.breakdown for s in share),
        rewards=_floats([s.reward for s in share]),
        advantages=_floats([s.advantage for s in share]),
        unshaped=_floats([s.unshaped for s in share]),
    )
    reward_sum, exact, generated = totals
    kept_total = buffer.kept
    stats = DynamicSamplingStats(
        rounds=chosen.rounds,
        discarded=chosen.discarded,
        generated=int(generated),
        filtered=int(generated) - kept_total,
        reward_mean=float(reward_sum) / generated if generated else 0.0,
        exact_match=float(exact) / generated if generated else 0.0,
    )
    return out, scores, stats


def _floats(values: Sequence[float]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32)
