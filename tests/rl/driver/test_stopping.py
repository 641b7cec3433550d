"""Long runs survive the cluster: SIGTERM / SIGUSR1 / Ctrl-C and ``checkpoint_must_save_by`` save and stop at a safe
point, and the same command continues to exactly the run that was never stopped.

The signals are sent by the run to itself at named points (``MFP8_SIGNAL_AT``: hooks, not sleeps): inside the
rollout, the train step and the refit of a step, and right before a checkpoint save.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import _warm_cli
import pytest

from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.driver.stopping import DEADLINE, EXIT_STOPPED, FAULT_ENV, StopRequests, parse_duration
from megatron_fp8.rl.state.results import TIMING_SUFFIXES

REPO = Path(__file__).resolve().parents[3]
STEPS = 3


def _default_signals() -> None:  # the child gets default handlers (a background shell leaves SIGINT ignored)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


def _grpo(
    out: Path, *overrides: str, fault: str | None = None, steps: int = STEPS, prompts: int = 2
) -> subprocess.CompletedProcess:
    """``prompts`` x 8 samples a step (16 by default: where a stop lands does not depend on it; tiny_cpu: 64)."""
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env[FAULT_ENV] = fault
    argv = [
        "grpo", "--steps", str(steps), "--arms", "fp8", "--no-progress",
        "--out", str(out), "checkpointing.enabled=true", "checkpointing.save_period=2",
        f"checkpointing.checkpoint_dir={out / 'ckpt'}", "grpo.warm_start_steps=0",
        f"grpo.num_prompts_per_step={prompts}", *overrides,
    ]  # fmt: skip
    # a process of its own with default signal handlers, forked by the suite's warm launcher (tests/_warm_cli.py);
    # torchrun's own forwarding is test_one_ranks_signal_stops_every_rank_at_the_same_step's
    return _warm_cli.run(argv, cwd=REPO, env=env, timeout=600)


def _steps(out: Path) -> list[dict]:
    # wall times, and the engine's refit counter (it counts this process's refits: a resumed run's engine starts anew)
    drop = {"seconds", "time", "timestamp", "refit_version"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k not in drop and not k.endswith(TIMING_SUFFIXES)} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = _grpo(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _steps(out)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "stopped_after", "saved"),
    [
        ("rollout:SIGTERM:0", 1, "step_0"),  # inside step 0: it completes, is saved (not due) and the run stops
        ("train:SIGUSR1:1", 2, "step_1"),  # Slurm's warning signal, inside the train step of step 1 (save due)
        ("refit:SIGTERM:0", 1, "step_0"),
        ("save:SIGTERM:1", 2, "step_1"),  # right before the due save of step 1: that save is the one kept
        ("rollout:SIGINT:0", 1, "step_0"),  # Ctrl-C: the same save, exit 130
    ],
    ids=["rollout-sigterm", "train-sigusr1", "refit-sigterm", "save-sigterm", "rollout-ctrl-c"],
)
def test_a_signal_saves_stops_and_the_same_command_continues_exactly(
    tmp_path, uninterrupted, fault, stopped_after, saved
):
    out = tmp_path / "run"
    first = _grpo(out, fault=fault)
    expected_rc = 130 if "SIGINT" in fault else EXIT_STOPPED
    assert first.returncode == expected_rc, first.stderr[-3000:]
    line = [ln for ln in first.stderr.splitlines() if ln.startswith("megatron-fp8 grpo: ")]
    assert len(line) == 1 and f"after {stopped_after} of {STEPS} steps of arm fp8" in line[0], first.stderr[-2000:]
    assert f"ckpt/fp8/{saved}" in line[0] and "continue with: megatron-fp8 grpo --steps 3" in line[0]
    assert "Traceback" not in first.stderr
    ckpts = sorted(p.name for p in (out / "ckpt" / "fp8").iterdir())
    assert ckpts == [saved], ckpts  # complete, and no hidden .tmp left
    assert len(_steps(out)) == stopped_after and (out / "summary.md").is_file()  # partial summary rebuilt
    second = _grpo(out)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"arm fp8: resumed from step {stopped_after}" in second.stderr
    assert _steps(out) == uninterrupted


@pytest.mark.slow
def test_a_second_signal_stops_at_once_without_saving(tmp_path):
    out = tmp_path / "run"
    proc = _grpo(out, fault="rollout:SIGTERM:0,train:SIGTERM:0")
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-3000:]
    assert not (out / "ckpt" / "fp8").exists() or not any((out / "ckpt" / "fp8").iterdir())


@pytest.mark.slow
def test_checkpoint_must_save_by_saves_and_stops_before_the_limit(tmp_path):
    out = tmp_path / "run"
    # a 1 s budget: the run stops once a step plus a save could cross it (after step 0 or 1, as the machine runs;
    # tiny_cpu's 64 samples a step, so that a step is long enough for that)
    proc = _grpo(out, "checkpointing.checkpoint_must_save_by=00:00:00:01", prompts=8)
    assert proc.returncode == EXIT_STOPPED, proc.stderr[-3000:]
    done = next(n for n in (1, 2) if f"after {n} of 3 steps" in proc.stderr)
    assert "checkpoint_must_save_by is near" in proc.stderr
    assert sorted(p.name for p in (out / "ckpt" / "fp8").iterdir()) == [f"step_{done - 1}"]
    assert len(_steps(out)) == done


def test_durations_are_nemo_rl_dd_hh_mm_ss():
    assert parse_duration("00:03:30:00") == 3.5 * 3600
    assert parse_duration("1:00:00:05") == 86405
    assert parse_duration("90") == 90
    for bad in ("3h", "1:2:3:4:5", "-1:00", ""):
        with pytest.raises(ConfigError, match="DD:HH:MM:SS"):
            parse_duration(bad)


def test_the_deadline_is_judged_from_the_longest_step_and_save():
    stop = StopRequests("00:00:01:40")  # 100 s
    assert stop.local_reason() is None  # the loop has not started
    stop.start_loop()
    stop.timed_step(30.0)
    assert stop.local_reason() is None  # 0 + 30 + 30 (a save is assumed as long as a step) <= 100
    stop.timed_save(80.0)
    assert stop.local_reason() == DEADLINE  # 30 + 80 > 100
    stop.request("SIGUSR1")
    assert stop.agreed_reason() == "SIGUSR1"  # a signal wins; one process: no collective


@pytest.mark.slow
@pytest.mark.processes  # two ranks under torchrun
def test_one_ranks_signal_stops_every_rank_at_the_same_step(tmp_path):
    """torchrun, two data-parallel ranks (gloo): only rank 1 gets SIGTERM, inside its train step; both finish that
    step, agree, save it once and exit 75; the same command continues to the uninterrupted two-rank run.

    torchrun runs the signalled run (its forwarding of the signal is the subject). The uninterrupted run and the
    continuation are the same command with torchrun's worker environment, forked by the suite's warm launcher
    (tests/_warm_cli.py); the uninterrupted one runs while the signalled torchrun runs, each with its own
    rendezvous port and folder. What they compute does not depend on either (the same code and settings,
    ``OMP_NUM_THREADS=1`` in every rank; the signal is sent at a named point, not after a time)."""

    def env_of(fault: str | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, "RANK", "WORLD_SIZE", "MFP8_ROLE")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **({FAULT_ENV: fault} if fault else {}))
        return env

    def argv(out: Path) -> list[str]:
        return [
            "grpo", "--steps", str(STEPS), "--arms", "bf16", "--no-progress", "--out", str(out),
            "checkpointing.enabled=true", "checkpointing.save_period=10", f"checkpointing.checkpoint_dir={out / 'c'}",
            "grpo.warm_start_steps=0",
        ]  # fmt: skip

    def start(out: Path, fault: str | None) -> subprocess.Popen:
        env = env_of(fault)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
        cmd += ["megatron_fp8.cli", *argv(out)]
        pipe = subprocess.PIPE
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=pipe, stderr=pipe, text=True, preexec_fn=_default_signals
        )

    def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
        try:
            stdout, stderr = proc.communicate(timeout=900)
            return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    ref, out = tmp_path / "ref", tmp_path / "run"
    first_run = start(out, "train:SIGTERM:1@1")
    try:
        reference = _warm_cli.run(argv(ref), cwd=REPO, env=env_of(None), nprocs=2, timeout=900)
    finally:
        first = finish(first_run)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert first.returncode != 0 and "exitcode  : 75" in first.stderr, first.stderr[-3000:]
    # torchrun reports the first rank that exited (75: saved and stopped); both stopped at the step the one line
    # names: the checkpoint holds step_1 only and the same command continues to the uninterrupted run (below)
    assert first.stderr.count("stopped (SIGTERM) after 2 of 3 steps of arm bf16") == 1  # rank 0's line only
    line = next(x for x in first.stderr.splitlines() if "stopped (SIGTERM)" in x)
    assert "continue with: megatron-fp8 launch --nproc-per-node 2 grpo" in line, line  # plain torchrun, one node
    assert sorted(p.name for p in (out / "c" / "bf16").iterdir()) == ["step_1"]
    second = _warm_cli.run(argv(out), cwd=REPO, env=env_of(None), nprocs=2, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert _steps(out) == _steps(ref)


@pytest.mark.slow
def test_without_checkpointing_a_stopped_run_exits_1_nothing_to_continue_from(tmp_path):
    out = tmp_path / "run"
    proc = _grpo(out, "checkpointing.enabled=false", fault="rollout:SIGTERM:0")
    assert proc.returncode == 1, proc.stderr[-3000:]  # not 75: grpo.sbatch must not requeue a run that saved nothing
    assert "nothing was saved (checkpointing.enabled=false)" in proc.stderr
