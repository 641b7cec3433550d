"""GRPO rewards: math answers (real math-verify), the toy task's partial credit, users' functions, safe_reward."""

from __future__ import annotations

import itertools
import json
import logging
import signal
import textwrap
import threading
from pathlib import Path

import pytest

from megatron_fp8.config.schema import DataConfig, DataDefaultsConfig, DatasetConfig, GRPOConfig, RunConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.data.rewards import (
    MAX_REPORTED_ERRORS,
    MathReward,
    RewardResult,
    TaskReward,
    UserReward,
    load_user_reward,
    reset_error_reports,
    reward_function,
    safe_reward,
)
from megatron_fp8.rl.data.task import Problem, get_task

REPO = Path(__file__).resolve().parents[3]
_MODULE_NUMBERS = itertools.count()


@pytest.fixture(autouse=True)
def _fresh_reports():
    reset_error_reports()
    yield
    reset_error_reports()


def _math(answer: str, response: str) -> RewardResult:
    pytest.importorskip("math_verify")
    return safe_reward(MathReward(), Problem(prompt="q", answer=answer), response, finished=True)


@pytest.mark.parametrize(
    ("answer", "response"),
    [
        ("12", "\\boxed{12}"),
        ("12", "First 3, so the result is \\boxed{12}. Done, 5 more words"),
        ("12", "the answer is 12"),
        ("12", "3 + 9 = 12."),
        ("3", "12 and then 3"),
        ("-3", "x = -3"),
        ("1000", "1,000"),
        ("\\frac{1}{2}", "\\boxed{0.5}"),
        ("\\frac{1}{2}", "it is 1/2"),
        ("0.5", "\\boxed{\\frac{1}{2}}"),
        ("0.5", "0.50"),
        ("7", "7"),
    ],
)
def test_math_right_answers(answer, response):
    assert _math(answer, response) == RewardResult(reward=1.0, exact=True)


@pytest.mark.parametrize(
    ("answer", "response"),
    [
        ("12", "\\boxed{13}"),
        ("12", "13"),
        ("12", "12 or maybe 13"),  # the last number counts
        ("7", "3 + 4"),  # repeating the question's expression is not an answer
        ("7", "10-3"),  # a binary minus is not a sign: the answer read is 3
        ("12", "twelve"),
        ("12", ""),
        ("\\frac{1}{2}", "\\boxed{0.4}"),
    ],
)
def test_math_wrong_or_missing_answers(answer, response):
    assert _math(answer, response) == RewardResult(reward=0.0, exact=False)


def test_math_ignores_finished():
    pytest.importorskip("math_verify")
    problem = Problem(prompt="q", answer="4")
    assert MathReward()(problem, "4", finished=False) == MathReward()(problem, "4", finished=True)


def test_math_gold_that_does_not_parse_is_an_error(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.rl.data.rewards"):
        result = _math("banana", "\\boxed{1}")
    assert result.reward == 0.0 and not result.exact
    assert "the expected answer 'banana' does not parse as math" in result.error
    assert "reward math failed" in caplog.text


def test_math_in_the_main_thread_restores_the_alarm_handler():
    before = signal.getsignal(signal.SIGALRM)
    assert _math("12", "\\boxed{12}").exact
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.alarm(0) == 0  # no alarm left pending


def test_math_leaves_a_pending_alarm_alone():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 300.0)
        assert _math("12", "\\boxed{12}").exact
        remaining, _ = signal.setitimer(signal.ITIMER_REAL, 0)  # cancel, reading what was left
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert remaining > 200 and not fired


def test_math_in_another_thread_uses_no_signal():
    pytest.importorskip("math_verify")
    results: list[object] = []

    def work():
        try:
            results.append(MathReward()(Problem(prompt="q", answer="\\frac{1}{2}"), "so \\boxed{0.5}", finished=True))
        except Exception as exc:  # recorded for the assertion below
            results.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert results == [RewardResult(reward=1.0, exact=True)]


def test_math_tiny_answers_verify_against_themselves():
    pytest.importorskip("math_verify")
    for name in ("train.jsonl", "validation.jsonl"):
        for line in (REPO / "data" / "math_tiny" / name).read_text().splitlines():
            row = json.loads(line)
            problem = Problem(prompt=row["problem"], answer=row["expected_answer"])
            assert MathReward()(problem, f"The answer is {row['expected_answer']}.", finished=True).exact, row


def test_task_reward_keeps_partial_credit():
    task = get_task("addition")
    problem = Problem(prompt="12+7=", answer="19")
    fn = TaskReward(task=task)
    for response, finished in (("19", True), ("18", True), ("19", False), ("", True)):
        breakdown = task.reward(problem, response, finished=finished)
        assert fn(problem, response, finished=finished) == RewardResult(reward=breakdown.reward, exact=breakdown.exact)
    assert 0.0 < fn(problem, "18", finished=True).reward < 1.0


# ---- users' reward functions ------------------------------------------------------------------------------------


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module ``user_rewards_<n>`` (a fresh name per test) on ``sys.path`` with a few reward functions."""
    name = f"user_rewards_{next(_MODULE_NUMBERS)}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            import math

            def contains(prompt, response, answer):
                return answer in response

            def half(prompt, response, answer):
                return 0.5

            def nan(prompt, response, answer):
                return math.nan

            def text(prompt, response, answer):
                return "1.0"

            def boom(prompt, response, answer):
                raise ZeroDivisionError("user bug")

            class Holder:
                @staticmethod
                def one(prompt, response, answer):
                    return 1

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_user_reward_values(user_module):
    problem = Problem(prompt="What is 2 + 2?", answer="4")
    assert safe_reward(load_user_reward(f"{user_module}:contains"), problem, "it is 4", finished=True) == RewardResult(
        reward=1.0, exact=True
    )
    assert safe_reward(load_user_reward(f"{user_module}:contains"), problem, "5", finished=True) == RewardResult(
        reward=0.0, exact=False
    )
    assert safe_reward(load_user_reward(f"{user_module}:half"), problem, "", finished=True) == RewardResult(0.5, False)
    assert safe_reward(load_user_reward(f"{user_module}:Holder.one"), problem, "", finished=True).exact


@pytest.mark.parametrize(("fn", "shown"), [("nan", "nan (float)"), ("text", "'1.0' (str)")])
def test_user_reward_must_return_a_finite_number(user_module, fn, shown):
    result = safe_reward(load_user_reward(f"{user_module}:{fn}"), Problem("p", "4"), "r", finished=True)
    assert result.reward == 0.0 and not result.exact
    assert (
        result.error
        == f"ValueError: reward {user_module}:{fn} returned {shown}; it must return a finite number or a bool"
    )


def test_a_raising_user_reward_is_reported_with_the_sample_and_scored_zero(user_module, caplog):
    fn = load_user_reward(f"{user_module}:boom")
    problem = Problem(prompt="What is 2 + 2?", answer="4")
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.rl.data.rewards"):
        results = [safe_reward(fn, problem, f"response {i}", finished=True) for i in range(MAX_REPORTED_ERRORS + 5)]
    assert all(r == RewardResult(reward=0.0, exact=False, error="ZeroDivisionError: user bug") for r in results)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == MAX_REPORTED_ERRORS + 1  # the first few in full, then one "not logged" notice
    assert f"reward {user_module}:boom failed, scored 0.0: ZeroDivisionError: user bug" in messages[0]
    assert "prompt='What is 2 + 2?'" in messages[0] and "response='response 0'" in messages[0]
    assert "further ones are not logged" in messages[-1]


@pytest.mark.parametrize(
    ("entry", "pattern"),
    [
        ("no_such_module_xyz:f", r"module 'no_such_module_xyz' does not import \(ModuleNotFoundError"),
        ("{mod}:missing", r"module '{mod}' has no attribute 'missing'"),
        ("{mod}:NOT_CALLABLE", r"'NOT_CALLABLE' is a int, not callable"),
        ("{mod}:", r"write a reward function as 'package\.module:function'"),
        (":f", r"write a reward function as 'package\.module:function'"),
    ],
)
def test_entry_point_errors_name_the_key(user_module, entry, pattern):
    entry, pattern = entry.format(mod=user_module), pattern.format(mod=user_module)
    with pytest.raises(ConfigError, match=rf"data\.default\.env_name='{entry}'") as err:
        load_user_reward(entry)
    assert err.match(pattern)


def test_a_module_that_fails_to_import_is_quoted(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_mod.py").write_text("raise RuntimeError('bad import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"'broken_reward_mod' does not import \(RuntimeError: bad import\)"):
        load_user_reward("broken_reward_mod:f")


# ---- the config's choice ----------------------------------------------------------------------------------------


def _config(env_name: str | None, **grpo) -> RunConfig:
    if env_name is None:
        return RunConfig(grpo=GRPOConfig(**grpo))
    data = DataConfig(train=DatasetConfig(data_path="train.jsonl"), default=DataDefaultsConfig(env_name=env_name))
    return RunConfig(data=data, grpo=GRPOConfig(**grpo))


def test_reward_function_follows_the_config(user_module):
    task = get_task("copy")
    assert reward_function(_config(None), task) == TaskReward(task=task, name="task copy")
    built = reward_function(_config(None, task="addition", task_max_digits=2), None)
    assert isinstance(built, TaskReward) and built.task == get_task("addition", max_digits=2)
    pytest.importorskip("math_verify")
    assert reward_function(_config("math"), task) == MathReward()
    user = reward_function(_config(f"{user_module}:half"), None)
    assert isinstance(user, UserReward) and user.name == f"{user_module}:half"


def test_unknown_env_name_lists_the_choices():
    with pytest.raises(ConfigError, match=r"data\.default\.env_name='gsm8k' is unknown; choices: 'math', or a Python"):
        reward_function(_config("gsm8k"), None)


def test_safe_reward_refuses_a_result_of_the_wrong_type():
    def bad(problem, response, *, finished):
        return 1.0

    result = safe_reward(bad, Problem("p", "a"), "r", finished=True)
    assert result.error == "TypeError: returned a float, not a RewardResult"
