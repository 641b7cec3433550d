"""A GRPO job signalled by Slurm mid-run saves, requeues itself and finishes in the next allocation, equal step by
step to an uninterrupted run (issue 25), on the real single-node Slurm of conftest.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from megatron_fp8.rl.state.results import TIMING_SUFFIXES

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STEPS = 12  # the signal lands within the first 2-3 steps; the rest continue in the next allocation
RUN = (
    "--arms", "fp8", "--no-progress", "grpo.warm_start_steps=0", "checkpointing.enabled=true",
    "checkpointing.save_period=10", "logger.tensorboard_enabled=false", "logger.wandb_enabled=false",
)  # fmt: skip


def _rows(path: Path) -> list[dict]:
    drop = {"seconds", "time", "timestamp", "refit_version"}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k not in drop and not k.endswith(TIMING_SUFFIXES)} for r in rows]


def _state(cluster, job: str) -> str:
    out = cluster.run("scontrol", "show", "job", job, check=False).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "UNKNOWN")


def _run_job(cluster, tmp_path: Path, name: str, signal: str | None) -> tuple[list[dict], str]:
    out, ckpt, logs = tmp_path / name / "out", tmp_path / name / "ckpt", tmp_path / name / "logs"
    logs.mkdir(parents=True)
    env = {**cluster.env, "RESULTS_DIR": str(tmp_path / name / "results"), "REQUIRE_GPU": "0", "STEPS": str(STEPS)}
    env["OUT_DIR"] = str(out)
    res = cluster.run(
        "sbatch", "--parsable", f"--output={logs}/%x-%j.out", "--time=10", "--ntasks=1", "slurm/grpo.sbatch",
        "configs/tiny_cpu.yaml", *RUN, f"checkpointing.checkpoint_dir={ckpt}", cwd=REPO, env=env,
    )  # fmt: skip
    job = res.stdout.strip().split(";")[0]
    signalled = signal is None
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        state = _state(cluster, job)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        metrics = out / "metrics.jsonl"
        if not signalled and metrics.is_file() and metrics.read_text().count("\n") >= 1:
            if signal == "USR1":  # what --signal=B:USR1@lead does: the batch shell, which passes it on
                cluster.run("scancel", "--batch", "--signal=USR1", job)
            else:  # the time limit / scancel: SIGTERM to the job's tasks
                cluster.run("scancel", "--signal=TERM", job)
            signalled = True
        time.sleep(0.2)
    log = "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.out")))
    if _state(cluster, job) != "COMPLETED":
        show = cluster.run("scontrol", "show", "job", job, check=False).stdout
        pytest.fail(f"job {job} ended {_state(cluster, job)}\n{show}\n{log[-6000:]}\n{cluster.daemon_logs()}")
    return _rows(out / "metrics.jsonl"), log


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory):
    rows, log = _run_job(slurm_cluster, tmp_path_factory.mktemp("ref"), "ref", None)
    assert len(rows) == STEPS and "requeueing" not in log
    return rows


@pytest.mark.parametrize("signal", ["USR1", "TERM"])
def test_a_signalled_job_requeues_and_continues_exactly(slurm_cluster, tmp_path, uninterrupted, signal):
    rows, log = _run_job(slurm_cluster, tmp_path, "run", signal)
    assert f"stopped (SIG{signal})" in log and "requeueing job" in log, log[-6000:]
    assert "allocation 1 of this job" in log and "resumed from step" in log, log[-6000:]
    assert rows == uninterrupted
