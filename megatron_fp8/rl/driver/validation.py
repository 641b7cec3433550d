"""Validation accuracy during GRPO: every ``grpo.val_period`` steps (and at the start with ``grpo.val_at_start``).

The validation problems (``data.validation``, or held-out problems of the built-in task:
:meth:`~megatron_fp8.rl.data.problems.ProblemSource.validation_problems`, at most ``grpo.max_val_samples``) are
answered once each by the arm's rollout engine, as it serves the policy at that moment (FP8 weights on the
FP8 arms), at ``policy.generation.temperature`` with a fixed seed, so two validations of one policy give the same answers.
Accuracy = fraction of exactly right answers (the reward's ``exact``); the mean reward is logged beside it.
Data-parallel ranks answer a share each; the counts are summed over ranks.

One JSON line per validation goes to ``validation.jsonl`` (:data:`~megatron_fp8.rl.state.results.VALIDATION_FILE`)
and to the loggers.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megatron_fp8.config.schema import RunConfig
from megatron_fp8.rl.algorithm.batch import Tokenizer, decode_response
from megatron_fp8.rl.cluster.distributed import DataParallel, engine_replicas
from megatron_fp8.rl.data.problems import ProblemSource
from megatron_fp8.rl.data.rewards import RewardFn, safe_reward
from megatron_fp8.rollout.engines import RolloutEngine

VALIDATION_SEED = 0x5EED
"""Sampling seed of every validation (added to ``grpo.seed``)."""


@dataclass(frozen=True)
class ValidationResult:
    """One validation of one arm.

    Attributes:
        arm: arm name.
        step: completed training steps when it ran (0 = before the first step).
        accuracy: fraction of problems answered exactly, in [0, 1].
        reward_mean: mean reward over the problems.
        problems: problems answered (all ranks).
        reward_errors: answers whose reward function raised (scored 0).
        seconds: wall time, seconds.
        sample: one problem and its answer, for reading.
    """

    arm: str
    step: int
    accuracy: float
    reward_mean: float
    problems: int
    reward_errors: int
    seconds: float
    sample: str

    def to_json_dict(self) -> dict[str, object]:
        """The record of ``validation.jsonl``."""
        return asdict(self)


def validates(config: RunConfig) -> bool:
    """Whether the run validates at all (``grpo.val_at_start`` or a ``grpo.val_period`` above 0; NeMo-RL's -1 never):
    only then is there a ``validation.jsonl``."""
    return config.grpo.val_at_start or config.grpo.val_period > 0


def validation_due(config: RunConfig, *, completed_steps: int) -> bool:
    """Whether a validation runs after ``completed_steps`` steps (0: before the first step)."""
    g = config.grpo
    if completed_steps == 0:
        return g.val_at_start
    return g.val_period > 0 and completed_steps % g.val_period == 0


def validate(
    engine: RolloutEngine,
    *,
    config: RunConfig,
    problems: ProblemSource,
    reward: RewardFn,
    tokenizer: Tokenizer,
    eos_id: int,
    dp: DataParallel,
    arm: str,
    completed_steps: int,
) -> ValidationResult:
    """Answer this rank's share of the validation problems with ``engine`` and score them.

    Collective over data-parallel ranks (the counts are summed); every rank returns the same result.

    Raises:
        ConfigError: no validation problem (from the problem source).
    """
    t0 = time.perf_counter()
    g = config.grpo
    every = problems.validation_problems(limit=g.max_val_samples)
    mine = dp.shard(every)
    ask, own = mine, slice(None)
    first, span = engine_replicas(dp, getattr(engine, "engine_ranks", 1))
    if span > 1:  # an engine holding whole replicas answers all of theirs at once (its ranks ask alike)
        a, b = dp.replicas_block(len(every), first, span)
        ask, at = every[a:b], dp.shard_start(len(every)) - a
        own = slice(at, at + len(mine))
    right = errors = 0
    reward_sum = 0.0
    sample = ""
    # a remote engine's generate is collective over the trainer ranks: call it even with nothing to ask
    if ask or getattr(engine, "collective_generate", False):
        prompt_ids = tuple(tokenizer.encode(p.prompt, add_special_tokens=False) for p in ask)
        rollout = engine.generate(
            prompt_ids,
            max_new_tokens=config.policy.generation.max_new_tokens,
            temperature=config.policy.generation.temperature,
            seed=g.seed + VALIDATION_SEED,
            eos_token_id=eos_id,
        )
        answers = zip(mine, rollout.token_ids[own], rollout.finished[own], strict=True)
        for problem, ids, finished in answers:
            body = ids[:-1] if finished and ids and ids[-1] == eos_id else ids
            text = decode_response(tokenizer, body)
            scored = safe_reward(reward, problem, text, finished=finished)
            right += int(scored.exact)
            errors += int(scored.error is not None)
            reward_sum += scored.reward
            if not sample or scored.exact:
                sample = f"{problem.prompt}{text!r} (answer {problem.answer})"
    once = 1.0 if dp.is_replica_first else 0.0  # the model-parallel ranks of a replica validated the same problems
    counts = torch.tensor([right, errors, len(mine)], dtype=torch.float64) * once
    total_reward = torch.tensor([reward_sum], dtype=torch.float64) * once
    if dp.world_size > 1:
        dist.all_reduce(counts)
        dist.all_reduce(total_reward)
    n = int(counts[2])
    return ValidationResult(
        arm=arm,
        step=completed_steps,
        accuracy=float(counts[0]) / n if n else float("nan"),
        reward_mean=float(total_reward[0]) / n if n else float("nan"),
        problems=n,
        reward_errors=int(counts[1]),
        seconds=time.perf_counter() - t0,
        sample=sample,
    )
