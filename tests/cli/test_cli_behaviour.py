"""The command line behaves like a good CLI (issue 21, items 5 and 6): a table of careless inputs, each with its exit
code and the one line that names what to fix; overrides anywhere; readable outputs."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fp8.config import load_config
from megatron_fp8.files import write_atomically

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_fp8.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("grpo", "--arms", ""), 2, "--arms '' has an empty arm name"),
        (("grpo", "--arms", "bf16,,fp8"), 2, "has an empty arm name"),
        (("grpo", "--out", ""), 2, "--out '' names no folder"),
        (("config", "--bogus"), 2, "unrecognized arguments: --bogus"),
        (("config", "grpo.arms=bf16,"), 1, "grpo.arms: 'bf16,' has an empty item"),
        (("report", "README.md"), 2, "is a file; report wants the run folder that holds metrics.jsonl"),
        (("config", "policy.generation.top_p=0.5"), 1, "--allow-no-effect"),
    ],
    ids=["empty-arms", "empty-arm", "empty-out", "unknown-option", "empty-list-item", "report-file", "no-effect"],
)
def test_careless_input_gets_one_line_and_the_right_exit_code(args, code, message):
    proc = _cli(*args)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "please report it" not in proc.stderr


def test_a_huge_config_file_is_refused_at_once(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"a: 1\n" * 300_000)  # 1.5 MB
    proc = _cli("config", "--config", str(big))
    assert proc.returncode == 1 and "not a config file (the limit is 1 MiB" in proc.stderr


def test_overrides_may_stand_anywhere_and_a_comma_list_is_a_list():
    proc = _cli("config", "grpo.num_steps=3", "--json", "grpo.seed=4", "grpo.arms=bf16,fp8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"num_steps": 3' in proc.stdout and '"seed": 4' in proc.stdout
    assert load_config(None, ["grpo.arms=bf16,fp8"]).grpo.arms == load_config(None, ["grpo.arms=[bf16, fp8]"]).grpo.arms


def test_outputs_are_written_with_the_users_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_atomically(tmp_path / "summary.md", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # mkstemp alone would leave 0600, unreadable to teammates


def test_doctor_fits_one_screen_and_all_gives_every_reason():
    short = _cli("doctor")
    full = _cli("doctor", "--all")
    assert short.returncode == 0 and full.returncode == 0, short.stderr[-2000:]
    assert len(short.stdout.splitlines()) <= 45, short.stdout  # a row per recipe, its first blocking reason
    assert len(full.stdout.splitlines()) > len(short.stdout.splitlines())
