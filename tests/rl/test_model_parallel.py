"""Issue 27: GRPO with Megatron-Core tensor parallelism, under torchrun with gloo, on the embedded tiny model.

Each layout runs the real ``megatron-fp8 grpo`` command (BF16 and FP8 arms, 2 steps, tensorwise training
recipe) and is compared with the run that has the same data-parallel size and no model parallelism:

* TP=2 (2 processes, one replica) against one process;
* TP=2 x DP=2 (4 processes) against DP=2 (2 processes).

A rollout is a function of (seed, step, data-parallel rank), so step 0 samples exactly what the reference run
samples (equal rewards); the losses, gradient norms and mismatch metrics agree up to the order of the
reductions (the vocabulary-parallel cross entropy, the TP all-reduces: stated tolerances below); step 1's
rewards and sample, generated after the first refit, equal the reference run's, so every engine received the
weights the reference run's engine did (each TP rank refits its own colocated engine with the gathered weights:
``refit_*_bytes`` in ``metrics.jsonl`` count every engine, so they are TP x the reference's per replica).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
COMMON = ("--steps", "2", "--arms", "bf16,fp8", "policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise")
REL = 1e-5
"""Relative tolerance of losses and gradient norms (float32 reductions in another order)."""
ABS_KL, REL_KL = 1e-7, 1e-2
"""Tolerance of the mismatch metrics (nats per token): a KL of ~3e-5 is a difference of two log-probabilities of
~1e-2 each, so last-bit differences of the weights after an update move it by ~1e-7 absolute, < 1% relative."""


def _grpo(out: Path, processes: int, *overrides: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MFP8_ROLE", "ROLLOUT_TASKS")}
    env["OMP_NUM_THREADS"] = "1"
    grpo = [sys.executable, "-m", "megatron_fp8.cli", "grpo", "--out", str(out), *COMMON, *overrides]
    if processes > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
        cmd += ["-m", "megatron_fp8.cli", *grpo[3:]]
    else:
        cmd = grpo
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(got: list[dict], ref: list[dict], *, engines_per_replica: int) -> None:
    assert [(r["arm"], r["step"]) for r in got] == [(r["arm"], r["step"]) for r in ref] != []
    for g, r in zip(got, ref, strict=True):
        where = f"arm {r['arm']} step {r['step']}"
        assert g["reward_mean"] == r["reward_mean"], where  # the same samples, scored the same
        assert g["sample"] == r["sample"], where
        assert g["loss"] == pytest.approx(r["loss"], rel=REL), where
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=REL), where
        assert g["gen_kl"] == pytest.approx(r["gen_kl"], abs=ABS_KL, rel=REL_KL), where
        assert g["refit_max_rel_error"] == r["refit_max_rel_error"] == 0.0, where
        for cls in ("fp8", "scales", "bf16"):  # each TP rank's engine got what the reference's engine got
            assert g[f"refit_{cls}_bytes"] == engines_per_replica * r[f"refit_{cls}_bytes"], (where, cls)
    assert any(r["refit_fp8_bytes"] > 0 for r in ref)  # the FP8 arm moved FP8 bytes


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[dict]:
    return _grpo(tmp_path_factory.mktemp("tp1") / "out", 1)


def test_tensor_parallel_2_equals_one_process(tmp_path, one_process):
    got = _grpo(tmp_path / "tp2", 2, "policy.megatron_cfg.tensor_model_parallel_size=2")
    _assert_same_run(got, one_process, engines_per_replica=2)


def test_micro_batches_accumulate_to_the_whole_batch_update(tmp_path, one_process):
    """``policy.train_micro_batch_size`` (NeMo-RL's key): 3 sequences per forward/backward, gradients
    accumulated, one update per step; ``policy.logprob_batch_size``: the trainer scores the rollout 5 sequences
    per forward. The same run as the whole batch at once (float32 sums in another order)."""
    got = _grpo(tmp_path / "micro3", 1, "policy.train_micro_batch_size=3", "policy.logprob_batch_size=5")
    _assert_same_run(got, one_process, engines_per_replica=1)


def test_tensor_parallel_2_by_data_parallel_2_equals_data_parallel_2(tmp_path):
    ref = _grpo(tmp_path / "dp2", 2)
    got = _grpo(tmp_path / "tp2dp2", 4, "policy.megatron_cfg.tensor_model_parallel_size=2")
    _assert_same_run(got, ref, engines_per_replica=2)


def test_pipeline_parallelism_is_refused_before_the_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MFP8_ROLE", "ROLLOUT_TASKS")}
    cmd = [sys.executable, "-m", "megatron_fp8.cli", "config", "policy.megatron_cfg.pipeline_model_parallel_size=2"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "pipeline_model_parallel_size=2" in text and "one pipeline stage" in text and "approved" not in text


def test_global_batch_splits_a_step_into_updates_and_micro_batches_stay_exact(tmp_path, one_process):
    """``policy.train_global_batch_size`` (NeMo-RL's key): the step's samples as updates of 16, each seeing
    the policy the previous one left (the PPO ratio moves: approx KL > 0 at the second update); micro-batches
    of 4 inside them give the same run."""
    whole = _grpo(tmp_path / "g16", 1, "policy.train_global_batch_size=16")
    micro = _grpo(tmp_path / "g16m4", 1, "policy.train_global_batch_size=16", "policy.train_micro_batch_size=4")
    for g, r in zip(whole, one_process, strict=True):
        assert g["reward_mean"] == r["reward_mean"] or g["step"] > 0  # step 0 samples before any update
        assert r["ppo_approx_kl"] == 0.0 and g["ppo_approx_kl"] > 0.0  # one update vs a second on moved weights
    _assert_same_run(micro, whole, engines_per_replica=1)


def test_update_rows_over_data_parallel_ranks():
    from megatron_fp8.config import load_config
    from megatron_fp8.errors import ConfigError
    from megatron_fp8.rl.distributed import DataParallel
    from megatron_fp8.rl.phases import update_rows

    cfg = load_config(None, ["policy.train_global_batch_size=16"])
    assert update_rows(32, cfg, DataParallel()) == [slice(0, 16), slice(16, 32)]
    assert update_rows(16, cfg, DataParallel(rank=1, world_size=2)) == [slice(0, 8), slice(8, 16)]
    assert update_rows(32, load_config(None, []), DataParallel()) == [slice(0, 32)]
    with pytest.raises(ConfigError, match="train_global_batch_size=16 over 3"):
        update_rows(12, cfg, DataParallel(rank=0, world_size=3))
    with pytest.raises(ConfigError, match="train_global_batch_size=12 must divide the step's"):
        load_config(None, ["policy.train_global_batch_size=12"])
