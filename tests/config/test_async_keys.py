"""Issue 55: NeMo-RL's async GRPO keys act (``grpo.async_grpo``, ``loss_fn.force_on_policy_ratio``), their refusals,
and NeMo-RL's own FP8 async recipe through ``megatron-fp8 config`` (its data staged as a local file)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import _warm_cli
import pytest

from megatron_fp8.config import load_config
from megatron_fp8.config.loader import load_config_report
from megatron_fp8.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PERF = ROOT / "tests" / "config" / "data" / "nemo_rl" / "examples" / "configs" / "recipes" / "llm" / "performance"
ASYNC_FP8 = PERF / "grpo-llama3.1-8b-instruct-2n8g-fp8-async-1off.yaml"
SPLIT = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1"]


def _staged(path: Path, n: int = 40) -> Path:
    """OpenMathInstruct-2's columns (``problem``, ``expected_answer``) in a local file, as a user stages it."""
    path.write_text(
        "".join(json.dumps({"problem": f"What is {i} + 1?", "expected_answer": str(i + 1)}) + "\n" for i in range(n))
    )
    return path


def test_nemo_rls_fp8_async_recipe_keys_act(tmp_path):
    report = load_config_report(ASYNC_FP8, [f"data.train.data_path={_staged(tmp_path / 'train.jsonl')}"])
    cfg = report.config
    assert cfg.grpo.async_grpo.enabled and cfg.grpo.async_grpo.max_trajectory_age_steps == 1
    assert cfg.grpo.async_grpo.ahead == 1
    assert cfg.loss_fn.force_on_policy_ratio and cfg.loss_fn.use_importance_sampling_correction
    assert not cfg.policy.generation.colocated.enabled
    assert "grpo.async_grpo.enabled" not in report.no_effect
    assert report.no_effect.get("grpo.async_grpo.in_flight_weight_updates") is True  # accepted, said to do nothing


def test_nemo_rls_fp8_async_recipe_on_its_16_ranks(tmp_path):
    """Its 2 nodes of 8: 8 trainer ranks, 8 rollout ranks. Refused for one key that cannot act here (extra stop
    tokens), not for async; approved once that key is set to what megatron-fp8 runs."""
    staged = _staged(tmp_path / "train.jsonl")
    env = {**os.environ, "WORLD_SIZE": "16", "RANK": "0", "LOCAL_WORLD_SIZE": "8"}
    argv = ["config", "--config", str(ASYNC_FP8), f"data.train.data_path={staged}"]
    refused = _warm_cli.run(argv, timeout=300, cwd=tmp_path, env=env)
    assert refused.returncode != 0
    refusal = refused.stderr.split("this run cannot start:", 1)[1]  # the no-effect warning before it lists async keys
    assert "policy.generation.stop_token_ids" in refusal and "async_grpo" not in refusal
    approved = _warm_cli.run([*argv, "policy.generation.stop_token_ids=null"], timeout=300, cwd=tmp_path, env=env)
    assert approved.returncode == 0, approved.stderr[-3000:]
    assert "approved: every check" in approved.stdout
    assert "separate rollout ranks" in approved.stdout


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["grpo.async_grpo.enabled=true"], "grpo.async_grpo.enabled needs separate rollout ranks"),
        ([*SPLIT, "grpo.async_grpo.max_trajectory_age_steps=-1"], "max_trajectory_age_steps must be >= 0"),
        (["loss_fn.force_on_policy_ratio=true", "grpo.updates_per_step=2"], "force_on_policy_ratio needs one"),
        (
            ["loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=32"],
            "force_on_policy_ratio needs one",
        ),
    ],
    ids=["colocated", "negative-age", "two-epochs", "two-updates"],
)
def test_refusals(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_split_async_is_accepted_and_an_uncorrected_arm_is_warned(caplog):
    from megatron_fp8.rl.driver.preflight import _argument_problems

    cfg = load_config(None, [*SPLIT, "grpo.async_grpo.enabled=true"])
    assert cfg.grpo.async_grpo.ahead == 1
    assert (
        load_config(
            None, [*SPLIT, "grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=0"]
        ).grpo.async_grpo.ahead
        == 0
    )
    with caplog.at_level(logging.WARNING):
        assert _argument_problems(cfg, n_steps=2, arm_names=("bf16", "fp8_tis")) == []
    warned = [r.getMessage() for r in caplog.records if "async_grpo" in r.getMessage()]
    assert len(warned) == 1 and "arm(s) bf16 do not correct" in warned[0]
