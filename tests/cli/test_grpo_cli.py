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


def test_grpo_cli_bad_arm_exits_1(tmp_path):
    from megatron_fp8.cli import main

    assert main(["grpo", "--steps", "1", "--out", str(tmp_path), "--arms", "bf16,fp9"]) == 1
