"""Ctrl-C under ``megatron-fp8 launch`` (torchrun in-process): the ranks save and stop, the launcher ends with one
line and exit 130, no ``SignalException`` traceback (plain torchrun ends in one, exit 1); the continue command the
ranks print is a ``megatron-fp8 launch`` command, and run as printed it resumes and finishes.

Ctrl-C is SIGINT to the launcher's process group, as a terminal sends it (torchrun starts its ranks in sessions of
their own, so they get it from the launcher, once).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.processes]

BIN = Path(sys.executable).parent
SMALL = (
    "--arms", "bf16", "--no-progress", "grpo.warm_start_steps=0", "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2", "checkpointing.enabled=true", "checkpointing.save_period=50",
)  # fmt: skip
STEPS = 30  # Ctrl-C goes once step 1 is in metrics.jsonl; a step of this size takes ~0.15 s alone, so the rest leave
# ~4 s for the signal to reach the ranks through the launcher on a loaded machine (4 steps left ~0.5 s)


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}


def test_ctrl_c_under_launch_ends_in_one_line_and_the_printed_command_resumes(tmp_path):
    out = tmp_path / "run"
    argv = ["megatron-fp8", "launch", "--nproc-per-node", "2", "grpo", "--steps", str(STEPS), "--out", str(out), *SMALL]
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the "terminal" the test sends Ctrl-C to
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.is_file() and metrics.read_text().count("\n") >= 1:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("megatron-fp8 launch: SIGINT passed on to every rank")
    assert "INFO [rank 1] megatron_fp8" in stderr, stderr[-3000:]  # each rank's log lines say whose they are
    stops = [line for line in stderr.splitlines() if line.startswith("megatron-fp8 grpo: stopped (interrupted by")]
    assert len(stops) == 1, stderr[-3000:]  # rank 0's line (every rank stopped at the step it names)
    command = shlex.split(stops[0][stops[0].rindex("continue with: ") + len("continue with: ") :])
    assert command == argv, command  # the launch command itself, as the user typed it
    done = metrics.read_text().count("\n")
    assert 1 <= done < STEPS

    again = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {done}" in again.stderr, again.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(STEPS))
