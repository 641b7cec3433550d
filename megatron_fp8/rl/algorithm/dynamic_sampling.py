"""DAPO's dynamic sampling as NeMo-RL runs it: which samples a step trains on.

A step generates rounds of ``num_prompts_per_step x batch_multiplier`` prompts (``num_generations_per_prompt``
samples each). Of each round, the samples whose reward deviation within their prompt's group
(:func:`prompt_reward_std`) is not 0 join a buffer, in order; once the buffer holds the step's
``num_prompts_per_step x num_generations_per_prompt`` samples, the first that many are trained on and the rest
discarded (``num_discarded_valid_samples``); a step still short after round ``dynamic_sampling_max_gen_batches + 1``
stops the run (:class:`~megatron_fp8.errors.DynamicSamplingError`), as NeMo-RL counts its rounds.

With ``grpo.reward_shaping`` the deviation is taken over the rewards before shaping (after scaling), so the filter
sees the task's outcome, not the length penalty; the advantages use the shaped rewards.

``tests/rl/algorithm/test_dynamic_sampling_oracle.py`` runs NeMo-RL's own ``dynamic_sampling`` and
``calculate_baseline_and_std_per_prompt`` on the same rounds and gets the same samples, rounds and discards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from megatron_fp8.errors import ConfigError, DynamicSamplingError

T = TypeVar("T")


def prompt_reward_std(rewards: torch.Tensor, *, group_size: int, leave_one_out: bool) -> torch.Tensor:
    """Each sample's reward deviation within its prompt's group, in NeMo-RL's arithmetic.

    Per group of ``n = group_size`` samples: the Bessel-corrected deviation over the group, or with
    ``leave_one_out`` over the other ``n - 1`` samples (so one sample of a group can be 0 where the others are not);
    0 where it is undefined. Computed as ``calculate_baseline_and_std_per_prompt`` computes it (float32 mask-matrix
    products, ``(E[r^2] - E[r]^2) x k / (k - 1)``, a negative rounding residue's root 0), so a group of equal rewards
    that are not exactly representable is kept or dropped as NeMo-RL keeps or drops it.

    Args:
        rewards: float32 ``[num_prompts * group_size]``, prompt-major.
        group_size: samples per prompt (``grpo.num_generations_per_prompt``).
        leave_one_out: ``grpo.use_leave_one_out_baseline``.

    Returns:
        float32 ``[num_prompts * group_size]``.

    Raises:
        ConfigError: ``rewards`` is not a whole number of groups.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ConfigError(
            f"dynamic sampling needs whole groups of {group_size} rewards, got shape {tuple(rewards.shape)}"
        )
    out = torch.zeros_like(rewards)
    if group_size <= 1:
        return out
    ones = torch.ones(group_size, dtype=rewards.dtype)
    mask = 1 - torch.eye(group_size) if leave_one_out else torch.ones((group_size, group_size))
    count = ones.float().sum() - int(leave_one_out)
    for start in range(0, rewards.numel(), group_size):
        r = rewards[start : start + group_size]
        mean = torch.matmul(mask, r * ones) / count
        mean_sq = torch.matmul(mask, torch.pow(r, 2) * ones) / count
        out[start : start + group_size] = ((mean_sq - mean.square()) * (count / (count - 1))).sqrt().nan_to_num(0)
    return out


@dataclass(frozen=True)
class Selection(Generic[T]):
    """What a completed step trains on.

    Attributes:
        items: the step's samples, in the order they were generated (round, then position).
        rounds: generation rounds the step took (NeMo-RL's ``dynamic_sampling_num_gen_batches``).
        discarded: samples with varying rewards beyond the step's need (``num_discarded_valid_samples``).
        generated: samples generated over all rounds.
    """

    items: tuple[T, ...]
    rounds: int
    discarded: int
    generated: int


@dataclass
class SampleBuffer(Generic[T]):
    """One step's buffer of samples whose rewards vary (module docstring): :meth:`add` each round's samples whose
    deviation is not 0 (:func:`varying`) until it returns the :class:`Selection`.

    Attributes:
        target: samples a step trains on (``num_prompts_per_step x num_generations_per_prompt``), >= 1.
        max_rounds: ``grpo.dynamic_sampling_max_gen_batches``, >= 1.
    """

    target: int
    max_rounds: int
    _kept: list[T] = field(default_factory=list)
    _rounds: int = 0
    _generated: int = 0

    def __post_init__(self) -> None:
        if self.target < 1 or self.max_rounds < 1:
            raise ConfigError(
                f"dynamic sampling needs a target >= 1 and grpo.dynamic_sampling_max_gen_batches >= 1, got "
                f"{self.target} and {self.max_rounds}"
            )

    @property
    def rounds(self) -> int:
        """Rounds offered so far."""
        return self._rounds

    @property
    def kept(self) -> int:
        """Samples with varying rewards held so far."""
        return len(self._kept)

    def add(self, kept: Sequence[T], *, generated: int) -> Selection[T] | None:
        """Add one round whose samples with varying rewards are ``kept`` (in order) of ``generated``.

        Returns:
            The step's :class:`Selection` once it has ``target`` samples, else ``None`` (generate another round).

        Raises:
            DynamicSamplingError: still short after round ``max_rounds + 1``.
        """
        self._rounds += 1
        self._generated += generated
        self._kept.extend(kept)
        if len(self._kept) >= self.target:
            return Selection(
                items=tuple(self._kept[: self.target]),
                rounds=self._rounds,
                discarded=len(self._kept) - self.target,
                generated=self._generated,
            )
        if self._rounds > self.max_rounds:
            raise DynamicSamplingError(
                f"dynamic sampling: after {self._rounds} generation rounds ({self._generated} samples) only "
                f"{len(self._kept)} of the step's {self.target} samples have rewards that vary within their prompt's "
                f"group (grpo.dynamic_sampling_max_gen_batches={self.max_rounds}); the prompts are too easy or too "
                "hard for the policy: raise grpo.dynamic_sampling_max_gen_batches or grpo.batch_multiplier, or use "
                "more grpo.num_generations_per_prompt"
            )
        return None


def varying(items: Sequence[T], std: torch.Tensor) -> list[T]:
    """The items whose ``std`` (float ``[len(items)]``) is not 0, in order."""
    return [item for item, keep in zip(items, (std != 0.0).tolist(), strict=True) if keep]
