"""A stopped run's advice works when run as printed, and ``--overwrite`` acts or is refused (issue 38).

Every run goes through the real CLI; the stop is a real signal the process sends itself at a chosen point
(:data:`~megatron_fp8.rl.driver.stopping.FAULT_ENV`, an environment variable: the printed command does not carry it).
The printed command is then split with :func:`shlex.split` and run as it is, with the installed ``megatron-fp8``
first on ``PATH``.

* SIGTERM with checkpointing off: the advice adds ``--overwrite`` (it used to print the same command, which was
  refused because the folder "already holds another run's outputs"); run, it starts over and finishes.
* Ctrl-C with checkpointing on and no ``--out``: the checkpoint lies in the run's own folder (not a ``checkpoints/``
  shared by every run of the working directory), the advice names that folder; run, it resumes and finishes.
  ``--overwrite`` there starts over (its checkpoints go with its outputs); ``--overwrite`` against checkpoints in
  a ``checkpoint_dir`` outside ``--out`` is refused, naming them.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import _warm_cli
import pytest

from megatron_fp8.cli import EXIT_ERROR, EXIT_INTERRUPTED
from megatron_fp8.rl.driver.stopping import FAULT_ENV

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
SMALL = (
    "--arms", "bf16", "--no-progress", "grpo.warm_start_steps=0", "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
)  # fmt: skip


def _default_signals() -> None:  # the child gets default handlers (a background shell leaves SIGINT ignored)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _run(argv: list[str], cwd: Path, *, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    if fault:
        env[FAULT_ENV] = fault
    # ``megatron-fp8 ...`` as printed, in a process of its own with default signal handlers, forked by the suite's
    # warm launcher (tests/_warm_cli.py); the console script itself is tests/cli/test_entry_points.py's
    assert argv[0] == "megatron-fp8", argv
    return _warm_cli.run(argv[1:], cwd=cwd, env=env, timeout=600)


def _printed_command(stderr: str) -> list[str]:
    line = next(x for x in stderr.splitlines() if x.startswith("megatron-fp8 grpo: stopped ("))
    return shlex.split(line[line.rindex(": megatron-fp8 ") + 2 :])


def _steps(out: Path) -> list[tuple[str, int]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(r["arm"], r["step"]) for r in map(json.loads, lines)]


def test_sigterm_without_checkpoints_advises_a_command_that_starts_over(tmp_path):
    out = tmp_path / "run"
    first = _run(
        ["megatron-fp8", "grpo", "--steps", "2", "--out", str(out), *SMALL], tmp_path, fault="rollout:SIGTERM:0"
    )
    assert first.returncode == EXIT_ERROR, first.stderr[-3000:]  # nothing to continue from
    command = _printed_command(first.stderr)
    assert (
        f"nothing was saved (checkpointing.enabled=false); the completed steps' metrics are in {out};" in first.stderr
        and "start over with" in first.stderr
    )
    assert command[-1] == "--overwrite" and command[:2] == ["megatron-fp8", "grpo"], command
    assert _steps(out) == [("bf16", 0)]
    again = _run(command, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already holds" not in again.stderr and "Traceback" not in again.stderr
    assert _steps(out) == [("bf16", 0), ("bf16", 1)]  # started over: the stopped run's step replaced, not appended
    assert "stopped" not in (out / "summary.md").read_text().lower()


def test_ctrl_c_with_checkpoints_and_no_out_continues_in_the_runs_own_folder(tmp_path):
    cwd = tmp_path / "work"
    cwd.mkdir()
    argv = ["megatron-fp8", "grpo", "--steps", "2", *SMALL, "checkpointing.enabled=true", "checkpointing.save_period=5"]
    first = _run(argv, cwd, fault="rollout:SIGINT:0")
    assert first.returncode == EXIT_INTERRUPTED, first.stderr[-3000:]
    (out,) = (cwd / "out").iterdir()  # a new folder for the run: out/grpo-<time>
    assert (out / "checkpoints" / "bf16" / "step_0" / "checkpoint.json").is_file()
    assert not (cwd / "checkpoints").exists()  # no folder shared by every run of the working directory
    command = _printed_command(first.stderr)
    saved = Path("out") / out.name / "checkpoints" / "bf16" / "step_0"  # relative, as the run named its folder
    saved_line = f"the last completed step is saved in {saved} (folder names count steps from 0); continue with: "
    assert saved_line in first.stderr, first.stderr[-2000:]
    assert command[-2:] == ["--out", str(out.relative_to(cwd))] and "--overwrite" not in command, command

    again = _run(command, cwd)  # run as printed: resumes after step 1 and finishes
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step 1" in again.stderr, again.stderr[-3000:]
    assert _steps(out) == [("bf16", 0), ("bf16", 1)]
    assert sorted(p.name for p in (out / "checkpoints" / "bf16").iterdir()) == ["step_0", "step_1"]

    # --overwrite against checkpoints outside --out: refused, naming them, before anything is touched
    other = cwd / "other"
    refused = _run(
        [*command[:-2], "--out", str(other), "--overwrite", f"checkpointing.checkpoint_dir={out / 'checkpoints'}"], cwd
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"checkpointing.checkpoint_dir={out / 'checkpoints'} holds checkpoints (bf16 step 2)" in refused.stderr
    assert not other.exists()

    # --overwrite on the run's own folder: its checkpoints go with its outputs and the run starts over
    over = _run([*command, "--overwrite", "--steps", "1"], cwd)
    assert over.returncode == 0, over.stderr[-3000:]
    assert "resumed" not in over.stderr
    assert _steps(out) == [("bf16", 0)]
    assert sorted(p.name for p in (out / "checkpoints" / "bf16").iterdir()) == ["step_0"]
