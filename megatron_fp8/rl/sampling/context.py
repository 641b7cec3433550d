"""What every step of every arm shares: the run config, the problems, the reward and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_fp8.config.schema import RunConfig
from megatron_fp8.rl.algorithm.batch import Tokenizer
from megatron_fp8.rl.data.problems import ProblemSource
from megatron_fp8.rl.data.rewards import RewardFn


@dataclass(frozen=True)
class GRPOContext:
    """What every step of every arm shares.

    Attributes:
        config: the run configuration.
        problems: the training problems (a dataset or the built-in task), a pure function of the step.
        reward: the reward of a response (math-verify, a user's function, or the task's partial credit).
        tokenizer: the model's tokenizer.
        eos_id: end-of-sequence id (stops responses).
        pad_id: padding id of the trainer's batches.
    """

    config: RunConfig
    problems: ProblemSource
    reward: RewardFn
    tokenizer: Tokenizer
    eos_id: int
    pad_id: int
