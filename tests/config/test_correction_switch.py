"""``loss_fn.use_importance_sampling_correction`` decides whether the IS correction runs, for every arm and rollout
precision (issue 38); the arms follow it, and what contradicts it is refused naming both keys.

Given, the key decides (NeMo-RL); not given, the arms decide (the side-by-side ``bf16, fp8, fp8_tis`` comparison of
the embedded default). The refusals run as a user runs them: ``megatron-fp8 config`` in a subprocess.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import _warm_cli
import pytest

from megatron_fp8.config import load_config
from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.driver.preflight import preflight

CLI = [sys.executable, "-m", "megatron_fp8.cli"]
NEMO_RL = Path(__file__).parent / "data" / "nemo_rl" / "examples" / "configs"
KEY = "loss_fn.use_importance_sampling_correction"


def _config_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``megatron-fp8 config *args`` in a process of its own (the suite's warm launcher, tests/_warm_cli.py)."""
    return _warm_cli.run(["config", *args], timeout=300)


def test_the_default_keeps_its_three_arms_and_the_arms_decide():
    """The embedded default does not give the key: fp8_tis corrects with TIS C=2, bf16 and fp8 do not."""
    cfg = load_config(None)
    loss = cfg.loss_fn
    assert cfg.grpo.arms == ("bf16", "fp8", "fp8_tis") and loss.use_importance_sampling_correction is None
    assert [loss.arm_corrects(a) for a in cfg.grpo.arms] == [False, False, True]
    assert (loss.is_variant, loss.is_cap) == ("token_tis", 2.0)


@pytest.mark.parametrize(
    ("file", "overrides", "arms", "corrects", "cap"),
    [
        ("grpo_math_8B_megatron_fp8.yaml", [], ("fp8_tis",), True, None),  # on, type null: untruncated
        ("grpo_math_8B_megatron_fp8.yaml", [f"{KEY}=false"], ("fp8",), False, 2.0),
        ("grpo_math_1B_megatron.yaml", [], ("bf16",), False, 2.0),  # off (grpo_math_1B.yaml's default)
        ("grpo_math_1B_megatron.yaml", [f"{KEY}=true"], ("bf16",), True, None),  # on with BF16: corrected
    ],
    ids=["8b-on", "8b-off", "1b-off", "1b-on"],
)
def test_a_nemo_rl_file_runs_the_arm_its_switch_names(file, overrides, arms, corrects, cap):
    cfg = load_config(NEMO_RL / file, overrides)
    assert cfg.grpo.arms == arms
    assert cfg.loss_fn.arm_corrects(arms[0]) is corrects and cfg.loss_fn.is_cap == cap


def test_explicit_arms_that_agree_with_the_key_run():
    """True: bf16 (corrected, as NeMo-RL) and fp8_tis; false: bf16 and fp8."""
    on = load_config(None, [f"{KEY}=true", "grpo.arms=[bf16,fp8_tis]"])
    assert [on.loss_fn.arm_corrects(a) for a in on.grpo.arms] == [True, True]
    off = load_config(None, [f"{KEY}=false", "grpo.arms=[bf16,fp8]"])
    assert [off.loss_fn.arm_corrects(a) for a in off.grpo.arms] == [False, False]


@pytest.mark.parametrize(
    ("overrides", "wants"),
    [
        ([f"{KEY}=true"], ("arm 'fp8' runs without the correction", "grpo.arms=['bf16', 'fp8_tis']", f"{KEY}=false")),
        ([f"{KEY}=false"], ("arm 'fp8_tis' runs with it", "grpo.arms=['bf16', 'fp8']", f"{KEY}=true")),
        ([f"{KEY}=true", "grpo.arms=[fp8]"], ("grpo.arms=['fp8']", "use grpo.arms=['fp8_tis']")),
        ([f"{KEY}=true", "grpo.arms=[fp8_tis]", "loss_fn.is_variant=none"], ("is_variant='none' turns it off",)),
    ],
    ids=["true-with-fp8", "false-with-fp8_tis", "true-only-fp8", "true-with-variant-none"],
)
def test_arms_that_contradict_the_key_are_refused_naming_both(overrides, wants):
    proc = _config_cli(*overrides)
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr
    for want in (*wants, KEY):
        assert want in proc.stderr, proc.stderr
    if not any(o.startswith("loss_fn.is_variant") for o in overrides):
        assert "grpo.arms" in proc.stderr


def test_arms_given_on_the_command_line_are_checked_against_the_key():
    """``grpo --arms fp8`` with the key true: the pre-flight check (shared by config and grpo) refuses it."""
    cfg = load_config(None, [f"{KEY}=true", "grpo.arms=[fp8_tis]"])
    with pytest.raises(ConfigError, match=r"arm 'fp8' runs without the correction") as info:
        preflight(cfg, arms=["fp8"], download=False)
    assert KEY in str(info.value)


@pytest.mark.parametrize("type_", ["null", None], ids=["type-null", "type-omitted"])
def test_a_ratio_without_a_type_is_refused_as_nemo_rl_does(type_):
    """NeMo-RL's loss raises on a ratio with no type; megatron-fp8 refused nothing and dropped the cap."""
    args = ["loss_fn.truncated_importance_sampling_ratio=2"]
    if type_ is not None:
        args.append(f"loss_fn.truncated_importance_sampling_type={type_}")
    proc = _config_cli(*args)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stdout
    assert "loss_fn.truncated_importance_sampling_ratio=2" in proc.stderr
    assert "truncated_importance_sampling_type" in proc.stderr and "a ratio needs a type" in proc.stderr


def test_a_cap_below_one_is_warned_with_what_it_truncates(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.config.loader"):
        cfg = load_config(None, ["loss_fn.is_cap=0.5"])
    assert cfg.loss_fn.is_cap == 0.5
    text = caplog.text
    assert "loss_fn.is_cap=0.5" in text and "the on-policy weight 1 included" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.config.loader"):
        load_config(None, ["loss_fn.is_cap=0.5", "grpo.arms=[bf16,fp8]"])  # nothing corrects: nothing to warn
    assert "is_cap" not in caplog.text


def test_a_run_corrects_the_bf16_arm_when_the_key_says_so(tmp_path):
    """The step itself follows the key: a BF16 rollout with the correction on puts the weights in its loss."""
    out = tmp_path / "run"
    cmd = ["grpo", "--steps", "1", "--out", str(out), "--no-progress", f"{KEY}=true", "grpo.arms=[bf16]"]
    cmd += ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.warm_start_steps=0"]
    proc = _warm_cli.run(cmd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["arm"] == "bf16" and row["is_applied"] is True
