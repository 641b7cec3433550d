"""The toy tasks and their verifiable reward, checked by hand examples."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.data.task import (
    REWARD_WEIGHTS,
    TASKS,
    AdditionTask,
    CopyTask,
    Problem,
    get_task,
    sample_problems,
    score_response,
)


def test_weights_sum_to_one():
    assert sum(REWARD_WEIGHTS.values()) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("answer", "response", "finished", "expected", "exact"),
    [
        ("19", "19", True, 1.0, True),  # exact and stopped
        ("19", "19", False, 0.6 + 0.2, False),  # right digits, ran into the length limit
        ("19", "18", True, 0.6 * 0.5 + 0.2 + 0.2, False),  # one of two positions
        ("19", "91", True, 0.0 + 0.2 + 0.2, False),  # right digits, wrong places
        ("19", "", True, 0.0, False),  # empty: no alphabet credit, wrong length
        ("7", "7x", False, 0.6 * 0.5 + 0.2 * 0.5, False),  # extra char halves both
        ("7", "ab", True, 0.0, False),
        ("12", "1", True, 0.6 * 0.5 + 0.2, False),  # stopped too early: no stop credit
    ],
)
def test_score_by_hand(answer, response, finished, expected, exact):
    got = score_response(answer, response, finished=finished)
    assert got.reward == pytest.approx(expected)
    assert got.exact is exact


def test_empty_answer_rejected():
    with pytest.raises(ConfigError, match="non-empty"):
        score_response("", "1", finished=True)


@settings(max_examples=50, deadline=None)
@given(
    answer=st.text("0123456789", min_size=1, max_size=4),
    response=st.text("0123456789ab", max_size=6),
    finished=st.booleans(),
)
def test_reward_in_unit_interval_and_max_only_when_exact(answer, response, finished):
    r = score_response(answer, response, finished=finished)
    assert 0.0 <= r.reward <= 1.0
    assert (r.reward == pytest.approx(1.0)) == r.exact


def test_addition_problems_are_correct_and_seeded():
    task = AdditionTask(max_digits=2)
    probs = sample_problems(task, seed=3, step=5, count=20)
    assert probs == sample_problems(task, seed=3, step=5, count=20)
    assert probs != sample_problems(task, seed=3, step=6, count=20)
    for p in probs:
        a, b = p.prompt[:-1].split("+")
        assert p.prompt.endswith("=") and int(p.answer) == int(a) + int(b) and max(int(a), int(b)) <= 99
        assert task.reward(p, p.answer, finished=True).exact


def test_copy_task():
    task = CopyTask(max_digits=3)
    p = task.sample(random.Random(0))
    assert p.prompt == f"copy {p.answer}:" and 1 <= len(p.answer) <= 3 and p.answer.isdigit()
    assert task.reward(Problem("copy 12:", "12"), "12", finished=True).reward == pytest.approx(1.0)


def test_registry_and_errors():
    assert set(TASKS) == {"addition", "copy"}
    assert get_task("addition", max_digits=3).max_digits == 3
    with pytest.raises(ConfigError, match="valid names: addition, copy"):
        get_task("division")
    with pytest.raises(ConfigError, match="max_digits"):
        AdditionTask(max_digits=0)
    with pytest.raises(ConfigError, match="count"):
        sample_problems(AdditionTask(), seed=0, step=0, count=0)
