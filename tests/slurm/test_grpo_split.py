"""``slurm/grpo.sbatch`` with separate trainer and rollout tasks (``ROLLOUT_TASKS=1``), submitted for real to the
local single-node Slurm (fixture in conftest.py): task 0 trains, task 1 only rolls out (the CPU reference FP8
engine), and every refit goes from the trainer to the rollout task over gloo.

Runs in the host environment (the checkout's .venv) with REQUIRE_GPU=0; results under a temporary RESULTS_DIR.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _submit(cluster, tmp_path: Path, *args: str, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """``slurm/grpo.sbatch ARGS`` on 2 tasks from the repository root, waited for; (exit status, the job's log)."""
    return cluster.submit(
        tmp_path / "logs",
        "slurm/grpo.sbatch",
        *args,
        env=env,
        sbatch_opts=("--ntasks=2",),
        time_limit_min=15,
        timeout=timeout,
    )


def test_grpo_sbatch_one_trainer_one_rollout_task_fp8(slurm_cluster, tmp_path):
    results, out = tmp_path / "results", tmp_path / "grpo-out"
    rc, log = _submit(
        slurm_cluster,
        tmp_path,
        "configs/tiny_cpu.yaml",
        "--arms",
        "fp8",
        "--no-progress",
        "refit.transport=gloo",
        "grpo.warm_start_steps=0",  # the claim is the split and its refits (a warm start is test_sbatch's)
        env={
            "RESULTS_DIR": str(results),
            "OUT_DIR": str(out),
            "REQUIRE_GPU": "0",
            "STEPS": "2",
            "ROLLOUT_TASKS": "1",
        },
        timeout=900,
    )
    assert rc == 0, log
    assert "rollout-only tasks: 1" in log, log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [(r["arm"], r["step"]) for r in rows] == [("fp8", 0), ("fp8", 1)], rows
    for r in rows:
        assert r["engine"] == "reference-fp8", r
        # every refit crossed to the rollout task as FP8 weights + block scales (+ the BF16 rest)
        assert r["refit_fp8_bytes"] > 0 and r["refit_scales_bytes"] > 0, r
        assert 0.5 < r["refit_fp8_bytes"] / r["refit_total_bytes"] < 1.0, r
        assert 0.5 < r["refit_payload_ratio"] < 0.6, r  # FP8 + scales + BF16 rest over the same weights in BF16
    versions = [r["refit_version"] for r in rows]
    assert versions[0] >= 1 and versions[1] == versions[0] + 1, versions  # committed on the rollout task, in order
