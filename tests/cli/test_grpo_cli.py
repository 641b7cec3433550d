"""`megatron-fp8 grpo` end to end: real Megatron trainer, reference engines, FP8 refit, outputs."""

from __future__ import annotations

import json

import _warm_cli
import pytest

from megatron_fp8.rl.algorithm.metrics import METRIC_KEYS

REQUIRED_KEYS = {
    "arm",
    "step",
    "reward_mean",
    "gen_kl",
    "token_mult_prob_error",
    "refit_fp8_bytes",
    "refit_scales_bytes",
    "refit_bf16_bytes",
    "refit_seconds",
    "loss",
    "grad_norm",
    "is_weight_mean",
    "is_truncated_fraction",
    "is_applied",
}


@pytest.mark.slow
def test_grpo_cli_two_steps(tmp_path):
    out = tmp_path / "run"
    cmd = [
        "grpo",
        "--steps",
        "2",
        "--out",
        str(out),
        "--no-progress",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=2",
        "grpo.warm_start_steps=1",
    ]
    proc = _warm_cli.run(cmd, timeout=600)  # a process of its own, forked by the suite's warm launcher
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "summary:" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["step"]) for r in rows] == [(a, s) for a in ("bf16", "fp8", "fp8_tis") for s in (0, 1)]
    for r in rows:
        assert REQUIRED_KEYS | set(METRIC_KEYS) <= set(r), sorted(REQUIRED_KEYS - set(r))
        assert 0.0 <= r["reward_mean"] <= 1.0
        fp8 = r["arm"] != "bf16"
        assert (r["refit_fp8_bytes"] > 0) is fp8 and (r["refit_scales_bytes"] > 0) is fp8
        assert r["is_applied"] is (r["arm"] == "fp8_tis")
    summary = (out / "summary.md").read_text()
    for arm in ("bf16", "fp8", "fp8_tis"):
        assert f"| {arm} |" in summary
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "config.yaml").is_file()


def test_grpo_cli_bad_arm_is_a_usage_error_naming_the_flag(tmp_path, capsys):
    from megatron_fp8.cli import main

    assert main(["grpo", "--steps", "1", "--out", str(tmp_path), "--arms", "bf16,fp9"]) == 2
    assert "--arms 'bf16,fp9': unknown arm(s) ['fp9']" in capsys.readouterr().err


def test_grpo_arms_are_what_the_config_checks_see(tmp_path):
    """Issue 57, trip 2: ``--arms bf16`` with the correction switch on is a BF16 rollout corrected (as NeMo-RL runs
    it), not refused for the config's default arms (the FP8 ones, which the switch would contradict)."""
    cmd = ["grpo", "--steps", "1", "--out", str(tmp_path / "run"), "--no-progress", "--arms", "bf16"]
    cmd += ["loss_fn.use_importance_sampling_correction=true", "grpo.num_prompts_per_step=2", "grpo.warm_start_steps=0"]
    proc = _warm_cli.run(cmd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["is_applied"]) for r in rows] == [("bf16", True)]


def test_a_micro_batch_larger_than_an_update_is_refused(capsys):
    """Issue 57, trip 7: 100 sequences per micro-batch when an update holds 64 is a misunderstanding, said before
    the run (``config``, and so ``grpo``), naming the keys and the most it can be."""
    from megatron_fp8.cli import main

    assert main(["config", "policy.train_micro_batch_size=100"]) == 1
    err = capsys.readouterr().err
    assert "policy.train_micro_batch_size=100 is more than an optimizer update's 64 sequences" in err
    assert "set it to at most 64" in err
