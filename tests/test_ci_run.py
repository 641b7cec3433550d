""".ci/run: fail-fast, and its last line names the step that failed (a stand-in ``make`` on PATH records the calls)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _ci(tmp_path: Path, failing: str | None) -> tuple[subprocess.CompletedProcess, list[str]]:
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(REPO / ".ci" / "run", repo / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    make = bin_dir / "make"
    make.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n[ "$*" != "{failing}" ]\n')
    make.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    return proc, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize(("failing", "ran"), [("test", ["test"]), ("test-vllm011", ["test", "test-vllm011"])])
def test_ci_run_stops_at_the_first_failing_step_and_names_it_last(tmp_path, failing, ran):
    proc, calls = _ci(tmp_path, failing)
    assert proc.returncode != 0 and calls == ran
    assert proc.stdout.strip().splitlines()[-1].startswith(f".ci/run: FAILED at step 'make {failing}'")


def test_ci_run_green_runs_every_step(tmp_path):
    proc, calls = _ci(tmp_path, None)
    assert proc.returncode == 0 and calls == ["test", "test-vllm011"]
    assert proc.stdout.strip().splitlines()[-1].startswith(".ci/run: all steps passed")
