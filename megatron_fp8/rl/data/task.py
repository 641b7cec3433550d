"""Verifiable toy tasks for the GRPO demo: problems generated locally, rewards checked exactly.

The demo trains a tiny, randomly initialised character-level model, so a task
must give a learning signal from the first step. Each task therefore scores a
response with *partial credit* (:func:`score_response`), in ``[0, 1]``:

=====================  ======  ==========================================================
component              weight  value
=====================  ======  ==========================================================
``position_match``     0.6     characters equal to the answer at the same position, over
                               ``max(len(answer), len(response))`` (extra characters cost)
``alphabet``           0.2     fraction of response characters in the task's alphabet
                               (digits); 0 for an empty response
``stopped``            0.2     1 when the response ended with EOS and has the answer's length
=====================  ======  ==========================================================

An exact answer that ends with EOS scores 1.0; the answer without EOS scores 0.8.

Tasks (:data:`TASKS`):

* ``addition`` -- ``"12+7="`` -> ``"19"`` (operands with ``1..max_digits`` digits);
* ``copy`` -- ``"copy 4821:"`` -> ``"4821"`` (echo a digit string).

Problems come from a seeded :class:`random.Random`, so every arm of a run sees the
same prompts in the same order.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from megatron_fp8.errors import ConfigError

REWARD_WEIGHTS: dict[str, float] = {"position_match": 0.6, "alphabet": 0.2, "stopped": 0.2}
"""Weights of the reward components (they sum to 1)."""

DIGITS = frozenset(string.digits)


@dataclass(frozen=True)
class Problem:
    """One task instance.

    Attributes:
        prompt: the text the model continues (toy tasks: no chat template; dataset rows: after the prompt file
            and the tokenizer's chat template, :mod:`megatron_fp8.rl.data.problems`).
        answer: the exact expected response (without EOS).
    """

    prompt: str
    answer: str


@dataclass(frozen=True)
class RewardBreakdown:
    """A scored response.

    Attributes:
        reward: weighted sum of the components, in ``[0, 1]``.
        position_match: in ``[0, 1]``.
        alphabet: in ``[0, 1]``.
        stopped: 0 or 1.
        exact: the response equals the answer and ended with EOS.
    """

    reward: float
    position_match: float
    alphabet: float
    stopped: float
    exact: bool


def score_response(answer: str, response: str, *, finished: bool, alphabet: frozenset[str] = DIGITS) -> RewardBreakdown:
    """Partial-credit reward of ``response`` against ``answer`` (see the module docstring).

    Args:
        answer: the expected text (non-empty).
        response: the generated text up to (not including) EOS.
        finished: whether generation ended with the EOS token (not by the length limit).
        alphabet: characters a well-formed answer consists of.

    Returns:
        The :class:`RewardBreakdown`.

    Raises:
        ConfigError: an empty ``answer``.
    """
    if not answer:
        raise ConfigError("score_response: the answer must be non-empty")
    span = max(len(answer), len(response))
    matches = sum(1 for a, b in zip(answer, response, strict=False) if a == b)
    position_match = matches / span
    in_alphabet = sum(1 for ch in response if ch in alphabet) / len(response) if response else 0.0
    stopped = 1.0 if finished and len(response) == len(answer) else 0.0
    reward = (
        REWARD_WEIGHTS["position_match"] * position_match
        + REWARD_WEIGHTS["alphabet"] * in_alphabet
        + REWARD_WEIGHTS["stopped"] * stopped
    )
    return RewardBreakdown(
        reward=reward,
        position_match=position_match,
        alphabet=in_alphabet,
        stopped=stopped,
        exact=finished and response == answer,
    )


class ToyTask(Protocol):
    """A verifiable task: seeded problems and an exact reward."""

    name: str
    alphabet: frozenset[str]

    def sample(self, rng: random.Random) -> Problem:
        """Draw one problem."""
        ...

    def reward(self, problem: Problem, response: str, *, finished: bool) -> RewardBreakdown:
        """Score a response to ``problem``."""
        ...


@dataclass(frozen=True)
class AdditionTask:
    """``"a+b="`` -> the decimal sum.

    Attributes:
        max_digits: operands have 1..``max_digits`` digits (>= 1).
    """

    max_digits: int = 1
    name: str = "addition"
    alphabet: frozenset[str] = DIGITS

    def __post_init__(self) -> None:
        if self.max_digits < 1:
            raise ConfigError(f"addition task: max_digits must be >= 1, got {self.max_digits}")

    def sample(self, rng: random.Random) -> Problem:
        """Draw ``a + b`` with uniformly chosen operands below ``10**max_digits``."""
        hi = 10**self.max_digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b))

    def reward(self, problem: Problem, response: str, *, finished: bool) -> RewardBreakdown:
        """Partial-credit score (:func:`score_response`)."""
        return score_response(problem.answer, response, finished=finished, alphabet=self.alphabet)


@dataclass(frozen=True)
class CopyTask:
    """``"copy 4821:"`` -> ``"4821"``.

    Attributes:
        max_digits: the string has 1..``max_digits`` digits (>= 1).
    """

    max_digits: int = 2
    name: str = "copy"
    alphabet: frozenset[str] = DIGITS

    def __post_init__(self) -> None:
        if self.max_digits < 1:
            raise ConfigError(f"copy task: max_digits must be >= 1, got {self.max_digits}")

    def sample(self, rng: random.Random) -> Problem:
        """Draw a digit string of random length."""
        n = rng.randint(1, self.max_digits)
        digits = "".join(rng.choice(string.digits) for _ in range(n))
        return Problem(prompt=f"copy {digits}:", answer=digits)

    def reward(self, problem: Problem, response: str, *, finished: bool) -> RewardBreakdown:
        """Partial-credit score (:func:`score_response`)."""
        return score_response(problem.answer, response, finished=finished, alphabet=self.alphabet)


TASKS: dict[str, Callable[..., ToyTask]] = {"addition": AdditionTask, "copy": CopyTask}
"""Registry: task name -> constructor (keyword ``max_digits``)."""


def get_task(name: str, *, max_digits: int | None = None) -> ToyTask:
    """Build a task by name.

    Args:
        name: a key of :data:`TASKS`.
        max_digits: operand / string length limit; ``None`` keeps the task's default.

    Raises:
        ConfigError: unknown name (the message lists the valid names) or a bad ``max_digits``.
    """
    try:
        factory = TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown GRPO task {name!r}; valid names: {', '.join(sorted(TASKS))}") from None
    return factory() if max_digits is None else factory(max_digits=max_digits)


def sample_problems(task: ToyTask, *, seed: int, step: int, count: int) -> list[Problem]:
    """The ``count`` problems of one step, the same for every arm of a run.

    Args:
        task: the task.
        seed: run seed.
        step: step index (0-based).
        count: number of problems (>= 1).
    """
    if count < 1:
        raise ConfigError(f"sample_problems: count must be >= 1, got {count}")
    rng = random.Random(f"{task.name}-{seed}-{step}")
    return [task.sample(rng) for _ in range(count)]
