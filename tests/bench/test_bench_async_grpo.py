"""bench/async_grpo.py in smoke mode: the synchronous and the async run side by side on 1 trainer + 1 rollout rank,
JSON written. Structure and ages only, never timings (a shared 2-core machine makes them noise at 2 steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # two 2-process GRPO runs


def test_bench_async_grpo_smoke(tmp_path):
    out = tmp_path / "async_grpo.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "MFP8_ROLE", "ROLLOUT_TASKS"):
        env.pop(k, None)
    cmd = [sys.executable, "bench/async_grpo.py", "--steps", "3", "--warm-start-steps", "0", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    sync, ahead = result["runs"]["sync"], result["runs"]["async"]
    assert sync["ages"] == [0, 0, 0] and ahead["ages"] == [0, 1, 1]
    assert set(result["ratio_async_over_sync"]) == {"steps", "steps_after_first"}
    assert sync["reward_mean_per_step"][0] == ahead["reward_mean_per_step"][0]  # step 0 is generated alike
