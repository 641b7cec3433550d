"""bench/verify.py in smoke mode: three applier settings timed side by side, ratios and JSON written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_verify_smoke(tmp_path):
    out = tmp_path / "verify.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "bench/verify.py", "--layers", "1", "--shrink", "8", "--repeats", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert set(summary["settings"]) == {"bare", "verify", "verify+rollback"}
    for key in ("device", "version_bytes", "verification_fraction_of_refit", "rollback_fraction_of_refit"):
        assert key in summary
    assert summary["settings"]["bare"]["ratio_to_bare"] == 1.0
    assert "verification:" in proc.stdout
