"""DAPO's reward and loss pieces in real GRPO runs (issue 56, in part): NeMo-RL's ``grpo.reward_scaling``,
``grpo.reward_shaping`` (the overlong penalty), ``grpo.overlong_filtering`` and ``loss_fn.ratio_clip_c``.

The arithmetic is checked against NeMo-RL's own functions in ``tests/rl/algorithm/test_shaping_oracle.py`` and
``test_nemo_rl_loss_oracle.py``; here, what a step does with them: the rewards its advantages come from are the scaled
and shaped ones (recomputed from the step's samples by the same rule), and the keys off leave the run as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_fp8.config import load_config
from megatron_fp8.rl.driver.grpo import run_grpo
from megatron_fp8.rl.state.results import METRICS_FILE, TIMING_SUFFIXES

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

BASE = ("grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.warm_start_steps=2")
DAPO = (
    "grpo.reward_scaling.enabled=true",
    "grpo.reward_scaling.target_min=-1.0",  # [0, 1] -> [-1, 1]
    "grpo.reward_shaping.enabled=true",
    "grpo.reward_shaping.overlong_buffer_length=8",
    "grpo.reward_shaping.overlong_buffer_penalty=1.0",
    "grpo.reward_shaping.max_response_length=16",  # policy.generation.max_new_tokens of the tiny default
    "grpo.overlong_filtering=true",
    "loss_fn.ratio_clip_c=3.0",
)


def _run(tmp_path: Path, *extra: str) -> list[dict]:
    out = tmp_path / "out"
    run_grpo(load_config(None, [*BASE, *extra]), out_dir=out, steps=2, arms=["fp8_tis"], progress=False)
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


def test_dapo_keys_shape_the_rewards_the_step_trains_on(tmp_path):
    plain, dapo = _run(tmp_path / "plain"), _run(tmp_path / "dapo", *DAPO)
    assert plain[0]["sample"] == dapo[0]["sample"]  # step 0: the same samples (the warm start's weights)
    assert plain[0]["exact_match"] == dapo[0]["exact_match"]
    # scaled to [-1, 1] then shaped (a penalty only lowers): the mean reward the advantages see is 2 r - 1 or less
    assert dapo[0]["reward_mean"] <= 2 * plain[0]["reward_mean"] - 1 + 1e-6
    assert dapo[0]["loss"] != plain[0]["loss"]


def test_the_keys_off_leave_the_run_as_it_was(tmp_path):
    off = (
        "grpo.reward_scaling.enabled=false",
        "grpo.reward_shaping.enabled=false",
        "grpo.overlong_filtering=false",
        "loss_fn.ratio_clip_c=null",
    )
    untimed = [{k: v for k, v in r.items() if not k.endswith(TIMING_SUFFIXES)} for r in _run(tmp_path / "off", *off)]
    assert untimed == [{k: v for k, v in r.items() if not k.endswith(TIMING_SUFFIXES)} for r in _run(tmp_path / "a")]
