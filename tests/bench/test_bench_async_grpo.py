"""bench/async_grpo.py in smoke mode: the synchronous and the async run side by side on 1 trainer + 1 rollout rank,
JSON written. Structure and ages only, never timings (a shared 2-core machine makes them noise at 2 steps).

The bench's ``main`` runs in this process; its two runs' ranks are forks of the suite's warm launcher
(tests/_warm_cli.py, torchrun's worker environment per rank) instead of ``torchrun`` (``make bench``'s), which would
start 2 fresh interpreters per run (~12 s of imports each). The arguments are the bench's own (:func:`grpo_argv`);
torchrun starting ``megatron-fp8 grpo`` ranks is tests/rl/driver/test_sharded_rollout.py's claim."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.processes]  # two 2-process GRPO runs


def _bench():
    spec = importlib.util.spec_from_file_location("bench_async_grpo", REPO / "bench" / "async_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_async_grpo_smoke(tmp_path, warm_cli):
    out = tmp_path / "async_grpo.json"
    bench = _bench()

    def launch(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        return warm_cli.run(argv, env=env, cwd=REPO, nprocs=2, timeout=900)

    bench.main(["--steps", "3", "--warm-start-steps", "0", "--out", str(out)], launch=launch)
    result = json.loads(out.read_text())
    sync, ahead = result["runs"]["sync"], result["runs"]["async"]
    assert sync["ages"] == [0, 0, 0] and ahead["ages"] == [0, 1, 1]
    assert set(result["ratio_async_over_sync"]) == {"steps", "steps_after_first"}
    assert sync["reward_mean_per_step"][0] == ahead["reward_mean_per_step"][0]  # step 0 is generated alike
