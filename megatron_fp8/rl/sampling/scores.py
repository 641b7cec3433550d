"""A batch's rewards and advantages: decoded responses scored, NeMo-RL's reward scaling and shaping, GRPO's
group-normalised advantages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_fp8.rl.algorithm.batch import decode_response, group_advantages
from megatron_fp8.rl.algorithm.shaping import scale_rewards, shape_rewards
from megatron_fp8.rl.data.rewards import RewardResult, safe_reward
from megatron_fp8.rl.sampling.context import GRPOContext
from megatron_fp8.rl.sampling.rollout import RolloutOutcome


@dataclass(frozen=True)
class Scores:
    """The rewards of one step's responses.

    Attributes:
        texts: per response, the decoded text (EOS dropped).
        breakdowns: per response, the reward's result (``error`` set where the reward function raised).
        rewards: float32 ``[num_responses]``.
        advantages: float32 ``[num_responses]``, normalised within each prompt's group.
        unshaped: float32 ``[num_responses]``, the rewards after ``grpo.reward_scaling``, before
            ``grpo.reward_shaping`` (what dynamic sampling filters on, as NeMo-RL's ``unshaped_total_reward``).
    """

    texts: tuple[str, ...]
    breakdowns: tuple[RewardResult, ...]
    rewards: torch.Tensor
    advantages: torch.Tensor
    unshaped: torch.Tensor


def score_phase(out: RolloutOutcome, ctx: GRPOContext) -> Scores:
    """Decode and score every response, then the GRPO advantages within each group.

    A reward function that raises scores 0 for that response and is reported with the sample
    (:func:`~megatron_fp8.rl.data.rewards.safe_reward`); the step counts such responses (``reward_errors``).
    """
    texts, breakdowns = [], []
    for problem, ids, finished in zip(out.problems, out.rollout.token_ids, out.rollout.finished, strict=True):
        body = ids[:-1] if finished and ids and ids[-1] == ctx.eos_id else ids
        text = decode_response(ctx.tokenizer, body)
        texts.append(text)
        breakdowns.append(safe_reward(ctx.reward, problem, text, finished=finished))
    rewards = torch.tensor([s.reward for s in breakdowns], dtype=torch.float32)
    g, rollout = ctx.config.grpo, out.rollout  # NeMo-RL's order: scaled, then shaped (DAPO's overlong penalty)
    cut = [not f for f in rollout.finished]
    unshaped = scale_rewards(rewards, g.reward_scaling)
    rewards = shape_rewards(unshaped, [len(t) for t in rollout.token_ids], cut, g.reward_shaping)
    advantages = group_advantages(
        rewards.view(-1, g.num_generations_per_prompt),
        leave_one_out=g.use_leave_one_out_baseline,
        normalize=g.normalize_rewards,
    )
    return Scores(tuple(texts), tuple(breakdowns), rewards, advantages, unshaped)
