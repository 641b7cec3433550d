"""GRPO rewards: the toy task's partial credit, math answers checked with ``math-verify``, or a user function.

:func:`reward_function` picks one from the config:

* a toy-task run (no ``data.train.data_path``): the task's own reward (:meth:`ToyTask.reward`, partial credit
  kept; ``exact`` from :class:`~megatron_fp8.rl.data.task.RewardBreakdown`);
* ``data.default.env_name: math``: :class:`MathReward`, 1.0 when the response's final answer equals the
  expected one (``math-verify``), else 0.0;
* ``data.default.env_name: "package.module:function"``: :class:`UserReward`, the function imported once at setup
  and called as ``function(prompt, response, answer) -> float | bool`` (``prompt`` the final prompt text,
  ``response`` the generated text without EOS, ``answer`` the row's expected answer as text); ``True`` / ``False``
  count as 1.0 / 0.0, anything else must be a finite number. ``exact`` is ``reward >= 1``.

Call every reward through :func:`safe_reward`: a reward that raises (or returns a bad value) is reported with
the sample, scored 0.0 with :attr:`RewardResult.error` set, and the run goes on.

**The math answer** of a response is its last ``\\boxed{...}`` when it has one (LaTeX inside, e.g.
``\\boxed{\\frac{1}{2}}``), else its last plain number (``-3``, ``1,000``, ``0.5``, ``1/2``): a response that
only repeats the question's expression (``"3+4"``) scores 0, since its last number is ``4``. The expected answer
is parsed as a whole (``12``, ``\\frac{1}{2}``, ``0.5``). Whether generation finished (EOS) does not change the
math reward. ``math-verify`` bounds its own time with ``SIGALRM``, which only the main thread may use: in the
main thread parsing and comparing each have :data:`MATH_VERIFY_TIMEOUT_S` (the previous handler is restored);
in any other thread, or while another alarm is pending (which math-verify's would cancel), they run without a
time limit and touch no signal (responses are at most ``max_new_tokens`` long).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import re
import signal
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_fp8.config.schema import RunConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.data.task import Problem, ToyTask, get_task

logger = logging.getLogger(__name__)

ENV_NAMES: tuple[str, ...] = ("math",)
"""Built-in ``data.default.env_name`` values (besides a ``"module:function"`` entry point)."""

MATH_VERIFY_TIMEOUT_S = 5
"""``math-verify``'s parse and compare time limits in the main thread (seconds, whole)."""

MAX_REPORTED_ERRORS = 3
"""Failures of one reward logged in full (with prompt and response); later ones are counted, not logged."""

_SHOWN_CHARS = 200
"""Characters of a prompt / response quoted in a warning."""

_LAST_NUMBER = re.compile(r"(?:(?<![\w)\].])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
"""A plain number: optional sign (not a binary minus), thousands separators, decimals, a fraction."""


@dataclass(frozen=True)
class RewardResult:
    """One scored response.

    Attributes:
        reward: the scalar reward (math: 0.0 or 1.0; toy task: partial credit in ``[0, 1]``).
        exact: the response is right (math: the answer verified; toy task: exact and stopped).
        error: why the reward could not be computed (then ``reward`` is 0.0), ``None`` when it could.
    """

    reward: float
    exact: bool
    error: str | None = None


class RewardFn(Protocol):
    """A reward: ``(problem, response, finished=...) -> RewardResult``; may raise (see :func:`safe_reward`)."""

    def __call__(self, problem: Problem, response: str, *, finished: bool) -> RewardResult:
        """Score ``response`` (generated text without EOS; ``finished``: it ended with EOS) to ``problem``."""
        ...


def _signal_timeout_s() -> int | None:
    """``math-verify``'s time limit here: :data:`MATH_VERIFY_TIMEOUT_S` where it may use ``SIGALRM``, else ``None``."""
    if threading.current_thread() is not threading.main_thread():
        return None  # signal handlers can only be set from the main thread
    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return None  # someone else's alarm is pending: math-verify's would cancel it
    return MATH_VERIFY_TIMEOUT_S


def _final_answer_text(response: str) -> tuple[str, bool] | None:
    """``(text to parse, is LaTeX)`` of the response's final answer, ``None`` when it has none."""
    if "\\boxed" in response:
        return response, True
    numbers = _LAST_NUMBER.findall(response)
    if not numbers:
        return None
    return numbers[-1].replace(",", ""), False


@dataclass(frozen=True)
class MathReward:
    """``data.default.env_name: math``: 1.0 when the final answer verifies against the expected one.

    Attributes:
        name: label in warnings.
    """

    name: str = "math"

    def __call__(self, problem: Problem, response: str, *, finished: bool) -> RewardResult:
        """Parse and compare with ``math-verify`` (module docstring); ``finished`` is not used.

        Raises:
            ValueError: the expected answer does not parse (a dataset problem, reported by :func:`safe_reward`).
        """
        from math_verify import (  # lazy: optional dependency (the GPU test box has torch only)
            ExprExtractionConfig,
            LatexExtractionConfig,
            parse,
            verify,
        )

        timeout = _signal_timeout_s()
        gold = parse(problem.answer, parsing_timeout=timeout)
        if not gold:
            raise ValueError(
                f"the expected answer {problem.answer!r} does not parse as math (math-verify); fix the dataset's "
                "output column or use a 'module:function' reward (data.default.env_name)"
            )
        final = _final_answer_text(response)
        if final is None:
            return RewardResult(reward=0.0, exact=False)
        text, latex = final
        config = [LatexExtractionConfig()] if latex else [ExprExtractionConfig()]
        predicted = parse(text, extraction_config=config, parsing_timeout=timeout)
        ok = bool(predicted) and bool(verify(gold, predicted, timeout_seconds=timeout))
        return RewardResult(reward=1.0 if ok else 0.0, exact=ok)


@dataclass(frozen=True)
class TaskReward:
    """A toy task's reward (:meth:`ToyTask.reward`), its partial credit kept.

    Attributes:
        task: the task.
        name: label in warnings.
    """

    task: ToyTask
    name: str = "task"

    def __call__(self, problem: Problem, response: str, *, finished: bool) -> RewardResult:
        """The task's :class:`~megatron_fp8.rl.data.task.RewardBreakdown` as a :class:`RewardResult`."""
        breakdown = self.task.reward(problem, response, finished=finished)
        return RewardResult(reward=float(breakdown.reward), exact=bool(breakdown.exact))


@dataclass(frozen=True)
class UserReward:
    """A user's reward function ``function(prompt, response, answer) -> float | bool``.

    Attributes:
        name: the entry point, ``"package.module:function"``.
        fn: the imported function.
    """

    name: str
    fn: Any

    def __call__(self, problem: Problem, response: str, *, finished: bool) -> RewardResult:
        """Call the function; ``True``/``False`` -> 1.0/0.0; ``exact`` is ``reward >= 1``.

        Raises:
            ValueError: the function returned something else than a bool or a finite number (whatever the function
                raises passes through too; :func:`safe_reward` reports both).
        """
        value = self.fn(problem.prompt, response, problem.answer)
        if isinstance(value, bool):
            reward = float(value)
        else:
            try:
                reward = float(value)
            except (TypeError, ValueError):
                reward = math.nan
            if isinstance(value, str) or not math.isfinite(reward):
                raise ValueError(
                    f"reward {self.name} returned {value!r} ({type(value).__name__}); it must return a finite "
                    "number or a bool"
                )
        return RewardResult(reward=reward, exact=reward >= 1.0)


def load_user_reward(entry_point: str, *, key: str = "data.default.env_name") -> UserReward:
    """Import ``"package.module:function"`` once.

    Args:
        entry_point: the module path and attribute, separated by one colon.
        key: the config key it came from, for messages.

    Raises:
        ConfigError: a malformed entry point, a module that does not import (its error quoted), a missing
            attribute, or one that is not callable.
    """
    module_name, sep, attr = entry_point.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise ConfigError(f"{key}={entry_point!r}: write a reward function as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of the user's module
        raise ConfigError(
            f"{key}={entry_point!r}: module {module_name!r} does not import ({type(exc).__name__}: {exc}); "
            "check the name and that it is on PYTHONPATH"
        ) from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ConfigError(f"{key}={entry_point!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(
            f"{key}={entry_point!r}: {attr!r} is a {type(fn).__name__}, not callable; name a function "
            "(prompt, response, answer) -> float | bool"
        )
    return UserReward(name=entry_point, fn=fn)


_REPORT_LOCK = threading.Lock()
_REPORTED: Counter[str] = Counter()


def reset_error_reports() -> None:
    """Forget how many failures of each reward were logged (a new run logs its first ones again)."""
    with _REPORT_LOCK:
        _REPORTED.clear()


def _report(name: str, error: str, problem: Problem, response: str) -> None:
    with _REPORT_LOCK:
        _REPORTED[name] += 1
        seen = _REPORTED[name]
    if seen <= MAX_REPORTED_ERRORS:
        logger.warning(
            "reward %s failed, scored 0.0: %s; prompt=%r response=%r",
            name,
            error,
            problem.prompt[-_SHOWN_CHARS:],
            response[:_SHOWN_CHARS],
        )
    if seen == MAX_REPORTED_ERRORS:
        logger.warning(
            "reward %s: %d failures logged; further ones are not logged (RewardResult.error still says why)",
            name,
            seen,
        )


def safe_reward(fn: RewardFn, problem: Problem, response: str, *, finished: bool) -> RewardResult:
    """``fn(problem, response, finished=...)``, never raising: a failure scores 0.0 with ``error`` set.

    The first :data:`MAX_REPORTED_ERRORS` failures of each reward (by its ``name``) are logged as warnings
    with the exception, the prompt's end and the response's start; later ones are not logged.

    Args:
        fn: the reward.
        problem: the problem.
        response: generated text without EOS.
        finished: generation ended with EOS.

    Returns:
        ``fn``'s result, or ``RewardResult(0.0, False, error="<Type>: <message>")``.
    """
    try:
        result = fn(problem, response, finished=finished)
        if not isinstance(result, RewardResult):
            raise TypeError(f"returned a {type(result).__name__}, not a RewardResult")
    except Exception as exc:  # a user's reward must never end the run
        error = f"{type(exc).__name__}: {exc}"
        _report(getattr(fn, "name", None) or getattr(fn, "__qualname__", repr(fn)), error, problem, response)
        return RewardResult(reward=0.0, exact=False, error=error)
    return result


def reward_function(config: RunConfig, task: ToyTask | None) -> RewardFn:
    """The run's reward.

    Args:
        config: the run config (``data.train.data_path``, ``data.default.env_name``; ``grpo.task`` when
            ``task`` is ``None`` on a toy-task run).
        task: the toy task of a run without a dataset (``None`` = built from ``grpo.task``); ignored on a
            dataset run.

    Returns:
        A :class:`TaskReward` (no ``data.train.data_path``), :class:`MathReward` (``env_name: math``) or
        :class:`UserReward` (``env_name: "module:function"``, imported now). Call it through :func:`safe_reward`.

    Raises:
        ConfigError: an unknown ``env_name`` (the message lists the choices), ``math`` without ``math-verify``
            installed, or a user function that does not import.
    """
    if config.data.train.data_path is None:
        if task is None:
            task = get_task(config.grpo.task, max_digits=config.grpo.task_max_digits)
        return TaskReward(task=task, name=f"task {task.name}")
    env_name = config.data.default.env_name
    if env_name == "math":
        if importlib.util.find_spec("math_verify") is None:
            raise ConfigError("data.default.env_name=math needs the 'math-verify' library: pip install math-verify")
        return MathReward()
    if ":" in env_name:
        return load_user_reward(env_name)
    raise ConfigError(
        f"data.default.env_name={env_name!r} is unknown; choices: {', '.join(map(repr, ENV_NAMES))}, or a Python "
        "entry point 'package.module:function' called as function(prompt, response, answer) -> float | bool"
    )
