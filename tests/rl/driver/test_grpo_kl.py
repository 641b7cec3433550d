"""GRPO with NeMo-RL's KL penalty to the reference policy and its leave-one-out baseline (issue 21): real runs.

The reference policy is the arm's initial weights: at step 0 the policy is the reference (the penalty is 0 up to
the last bit of two forwards of the same weights), after the first update it is not; a run resumed from a
checkpoint keeps the initial weights as its reference (its steps equal an uninterrupted run's), and the penalty
changes the updates (the losses differ from a run without it from step 1 on).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_fp8.config import load_config
from megatron_fp8.rl.driver.grpo import run_grpo
from megatron_fp8.rl.state.results import METRICS_FILE

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

KL = ("loss_fn.reference_policy_kl_penalty=0.2", "grpo.use_leave_one_out_baseline=true")


def _config(tmp_path: Path, *extra: str):
    return load_config(
        None,
        [
            "checkpointing.enabled=true",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            "checkpointing.save_period=1",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "grpo.warm_start_steps=2",  # each run warm-starts anew; 2 supervised steps give rewards > 0 already
            *extra,
        ],
    )


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


def test_the_penalty_starts_at_zero_grows_and_survives_a_resume(tmp_path):
    run_grpo(_config(tmp_path / "a", *KL), out_dir=tmp_path / "a" / "out", steps=3, arms=["fp8_tis"], progress=False)
    straight = _records(tmp_path / "a" / "out")
    assert abs(straight[0]["kl_penalty"]) < 1e-9  # the policy is the reference
    assert straight[1]["kl_penalty"] > 1e-7 and straight[2]["kl_penalty"] > 1e-7

    out = tmp_path / "b" / "out"
    run_grpo(_config(tmp_path / "b", *KL), out_dir=out, steps=2, arms=["fp8_tis"], progress=False)
    run_grpo(_config(tmp_path / "b", *KL), out_dir=out, steps=3, arms=["fp8_tis"], progress=False)
    resumed = _records(out)
    keys = ("reward_mean", "loss", "grad_norm", "kl_penalty", "gen_kl", "sample")
    assert {k: resumed[2][k] for k in keys} == {k: straight[2][k] for k in keys}  # reference = initial weights

    plain = tmp_path / "c" / "out"
    run_grpo(_config(tmp_path / "c"), out_dir=plain, steps=2, arms=["fp8_tis"], progress=False)
    without = _records(plain)
    assert all(r["kl_penalty"] == 0.0 for r in without)
    assert without[0]["reward_mean"] == straight[0]["reward_mean"]  # the same samples at step 0
    assert without[1]["loss"] != straight[1]["loss"]  # the penalty and the baseline change the update
