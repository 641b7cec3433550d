"""Issue 38 (5, 6): ``python -m megatron_fp8`` is the command line (what ``torchrun ... -m megatron_fp8`` runs), and
``--model NAME`` on ``grpo`` and ``config`` stands for ``model.name_or_path=NAME``, as README says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_fp8", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_python_dash_m_megatron_fp8_is_the_command_line():
    proc = _cli("--version")
    assert proc.returncode == 0 and "megatron-fp8" in proc.stdout + proc.stderr


def test_model_flag_sets_the_model_and_an_empty_one_is_refused():
    proc = _cli("config", "--model", "tiny-moe")
    assert proc.returncode == 0, proc.stderr
    assert "name_or_path: tiny-moe" in proc.stdout
    bad = _cli("grpo", "--model", "", "--steps", "1")
    assert bad.returncode != 0 and "--model '' names no model" in bad.stderr
    assert "Traceback" not in bad.stderr
