"""bench/packing.py in smoke mode: three micro-batch layouts of the train phase side by side, JSON and PNG written.

Structure and token counts only, never timings (a shared 2-core machine makes them noise at these sizes).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.megatron  # builds the embedded tiny model through Megatron-Bridge, like tests/megatron


def test_bench_packing_smoke(tmp_path):
    out = tmp_path / "packing.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "bench/packing.py",
        *("--rows", "8", "--min-response", "4", "--max-response", "48", "--micro-rows", "2"),
        *("--tokens", "160", "--round", "16", "--repeats", "1", "--out", str(out)),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())

    assert list(summary["layouts"]) == ["padded", "dynamic", "packed"]
    for key in ("machine", "settings", "batch", "ratios", "exactness"):
        assert key in summary
    assert summary["machine"]["cpu"] and summary["machine"]["torch_threads"] == 1
    assert summary["settings"]["rows"] == 8 and summary["batch"]["response_lengths"]["max"] == 48
    ratio = {name: x["tokens"]["computed_over_real"] for name, x in summary["layouts"].items()}
    assert ratio["packed"] <= ratio["dynamic"] <= ratio["padded"]
    assert ratio["packed"] <= 1.1
    real = {x["tokens"]["real"] for x in summary["layouts"].values()}
    assert real == {2 * summary["batch"]["real_tokens"]}  # the same rows, one scoring + one train pass each
    for x in summary["layouts"].values():
        assert len(x["seconds"]) == 1 and x["median_seconds"] > 0 and math.isfinite(x["speedup_vs_padded"])
    assert summary["layouts"]["padded"]["speedup_vs_padded"] == 1.0

    exact = summary["exactness"]
    assert exact["same_initial_weights"] and exact["within_bound"]
    for name in ("dynamic", "packed"):
        for key in ("logprob_max_abs_diff", "loss_rel_diff", "grad_norm_rel_diff"):
            assert exact[name][key] <= 1e-4, (name, key, exact[name][key])
    assert (tmp_path / "packing.png").stat().st_size > 0
    assert "speed-up" in proc.stdout
