"""Issue 27: GRPO with Megatron-Core tensor and pipeline parallelism and the distributed optimizer, over gloo, on the
embedded tiny model.

Each layout runs the real ``megatron-fp8 grpo`` command (BF16 and FP8 arms, 2 steps, tensorwise training
recipe, NeMo-RL's KL penalty to the reference policy and leave-one-out baseline) and is compared with the run that
has the same data-parallel size and no model parallelism:

* TP=2 (2 processes, one replica) against one process;
* PP=2 (2 stages of 2 layers; micro-batches of 16 through Megatron-Core's 1F1B schedule, scoring in forward-only
  micro-batches of 32) against one process;
* TP=2 x DP=2 (4 processes) against DP=2 (2 processes);
* PP=2 x DP=2 (4 processes: Megatron's tp-cp-ep-dp-pp rank order puts the replicas at ranks {0, 2} and {1, 3})
  against DP=2;
* DP=2 with ``use_distributed_optimizer`` (Adam state sharded over the replicas) against DP=2: bit for bit;
* EP=2 on ``tiny-moe`` (2 of its 4 experts per rank, tokens all-gathered by Megatron-Core's allgather dispatcher,
  the experts loaded and exported by their global ids) against DP=2 on ``tiny-moe``.

Each rank's engine generates its own part of its replica's samples (``rollout_prompts_per_rank``: at TP=2 each of
the 2 ranks half of what the one process generates), and the parts are all-gathered within the replica. A sample's
seed is a function of (seed, step, its index among the step's samples), not of the rank that generates it, so step
0 samples exactly what the reference run samples (equal rewards); the losses, gradient norms and mismatch metrics agree up to the order of the
reductions (the vocabulary-parallel cross entropy, the TP all-reduces: stated tolerances below); step 1's
rewards and sample, generated after the first refit, equal the reference run's, so every engine received the
weights the reference run's engine did, up to the BF16 rounding of main weights that an update reduced in another
order leaves apart in their last bits (``REL_GEN_KL_UPDATED``) (each TP rank refits its own colocated engine with the gathered weights:
``refit_*_bytes`` in ``metrics.jsonl`` count every engine, so they are TP x the reference's per replica).

The exact equalities (rewards, samples) hold between runs computing alike: every run here, the one-process
reference included, is a process of its own forked by the suite's warm launcher (tests/_warm_cli.py: each rank gets
torchrun's worker environment, ``RANK``/``WORLD_SIZE``/``MASTER_PORT``..., and ``OMP_NUM_THREADS=1``), so each
engine's CPU GEMMs sum in the same order; a reference computed in the pytest process (its default thread count)
would not be one. torchrun itself launches the 2-rank sharded-rollout layout
(tests/rl/driver/test_sharded_rollout.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.processes]

REPO = Path(__file__).resolve().parents[3]
COMMON = (
    "policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise",
    # NeMo-RL's loss and baseline: every layout also swaps its shards of the reference policy in and out
    "loss_fn.reference_policy_kl_penalty=0.1",
    "grpo.use_leave_one_out_baseline=true",
    # 2 supervised warm-start steps, not tiny_cpu's 8: each layout still warm-starts through its own TP/PP/EP/DP
    # machinery (and every later equality starts from that checkpoint), the rewards are already > 0 (~0.04 -> 0.13
    # over the 2 steps), and each run is ~3.5 s of compute per rank shorter
    "grpo.warm_start_steps=2",
)
REL = 1e-5
"""Relative tolerance of losses and gradient norms (float32 reductions in another order)."""
ABS_LOSS = 1e-6
"""Absolute tolerance of the loss: a mean of per-token terms of size ~|advantage| ~ 1 that cancel (a group's
advantages sum to 0), so float32 reductions in another order move it by ~1e-7 while it is itself ~1e-3."""
ABS_KL, REL_KL = 1e-7, 1e-2
"""Tolerance of the mismatch metrics (nats per token) where both runs' engines hold the same BF16 weights, bit for
bit: at step 0 (the warm start's checkpoint) for ``gen_kl``, at every step for ``kl_penalty`` (policy against
reference, both the trainer's own, float32 reductions in another order)."""
REL_GEN_KL_UPDATED = 0.25
"""Relative tolerance of ``gen_kl`` after an update. Two runs that reduce in another order end the update with float32
main weights that differ in their last bits; each element near a BF16 rounding boundary then reaches the engine one
BF16 step (2**-8 relative) apart. ``gen_kl`` (~2e-5) is half the mean square of per-token log-prob differences of
~5e-3 between the engine's and the trainer's BF16 arithmetic, rounding noise whose pattern such a step redraws:
on an AMX CPU the micro-batched update moved the BF16 arm's step-1 ``gen_kl`` by 11.6% (2.018e-5 -> 2.252e-5,
its mean |difference| by 3%) while its loss, gradient norm and ``kl_penalty`` agreed to 1e-6; on an AVX2 CPU the
same comparison held at 1%. A layout that refits wrong weights moves it by orders of
magnitude (and changes the samples, compared exactly)."""


def _grpo(
    cli, out: Path, processes: int, *overrides: str, steps: int = 2, arms: str = "bf16,fp8", check: bool = True
) -> list[dict]:
    """``megatron-fp8 grpo`` on ``processes`` ranks (torchrun's worker environment; ``cli`` is the suite's warm
    launcher, tests/_warm_cli.py: each rank its own process, forked after the imports)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MFP8_ROLE", "ROLLOUT_TASKS")}
    env["OMP_NUM_THREADS"] = "1"
    argv = ["grpo", "--out", str(out), "--steps", str(steps), "--arms", arms, *COMMON, *overrides]
    proc = cli.run(argv, cwd=REPO, env=env, nprocs=processes, timeout=600)
    if not check:
        assert proc.returncode != 0
        return [{"stderr": proc.stderr}]
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(got: list[dict], ref: list[dict], *, engines_per_replica: int) -> None:
    assert [(r["arm"], r["step"]) for r in got] == [(r["arm"], r["step"]) for r in ref] != []
    for g, r in zip(got, ref, strict=True):
        where = f"arm {r['arm']} step {r['step']}"
        assert g["reward_mean"] == r["reward_mean"], where  # the same samples, scored the same
        assert g["sample"] == r["sample"], where
        assert g["loss"] == pytest.approx(r["loss"], rel=REL, abs=ABS_LOSS), where
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=REL), where
        rel_gen_kl = REL_KL if r["step"] == 0 else REL_GEN_KL_UPDATED
        assert g["gen_kl"] == pytest.approx(r["gen_kl"], abs=ABS_KL, rel=rel_gen_kl), where
        assert g["kl_penalty"] == pytest.approx(r["kl_penalty"], abs=ABS_KL, rel=REL_KL), where
        assert g["refit_max_rel_error"] == r["refit_max_rel_error"] == 0.0, where
        for cls in ("fp8", "scales", "bf16"):  # each TP rank's engine got what the reference's engine got
            assert g[f"refit_{cls}_bytes"] == engines_per_replica * r[f"refit_{cls}_bytes"], (where, cls)
        # every engine generated its own part: the replica's samples split evenly over its ranks, none twice
        per_rank, ref_per_rank = g["rollout_prompts_per_rank"], r["rollout_prompts_per_rank"]
        assert sum(per_rank) == sum(ref_per_rank) > 0, where
        assert per_rank == [sum(ref_per_rank) // len(per_rank)] * len(per_rank), where
        assert len(per_rank) == engines_per_replica * len(ref_per_rank), where
    assert any(r["refit_fp8_bytes"] > 0 for r in ref)  # the FP8 arm moved FP8 bytes
    assert all(r["kl_penalty"] > 0 for r in ref if r["step"] > 0)  # the policy left the reference after step 0


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, warm_cli) -> list[dict]:
    return _grpo(warm_cli, tmp_path_factory.mktemp("tp1") / "out", 1)


@pytest.fixture(scope="module")
def data_parallel_2(tmp_path_factory, warm_cli) -> list[dict]:
    return _grpo(warm_cli, tmp_path_factory.mktemp("dp2") / "out", 2)


def test_tensor_parallel_2_equals_one_process(tmp_path, one_process, warm_cli):
    got = _grpo(warm_cli, tmp_path / "tp2", 2, "policy.megatron_cfg.tensor_model_parallel_size=2")
    _assert_same_run(got, one_process, engines_per_replica=2)


def test_micro_batches_accumulate_to_the_whole_batch_update(tmp_path, one_process, warm_cli):
    """``policy.train_micro_batch_size`` (NeMo-RL's key): 3 sequences per forward/backward, gradients
    accumulated, one update per step; ``policy.logprob_batch_size``: the trainer scores the rollout 5 sequences
    per forward. The same run as the whole batch at once (float32 sums in another order)."""
    got = _grpo(warm_cli, tmp_path / "micro3", 1, "policy.train_micro_batch_size=3", "policy.logprob_batch_size=5")
    _assert_same_run(got, one_process, engines_per_replica=1)


def test_data_parallel_2_updates_as_one_process(data_parallel_2, one_process):
    """Each replica's loss is divided by the whole batch's token count (NeMo-RL's global normalization, an
    all-reduce of the replicas' counts), so DDP's mean of their gradients is one process's update: the same loss and
    gradient norm, step after step (the samples the same, the reward mean over both replicas' halves)."""
    assert [(r["arm"], r["step"]) for r in data_parallel_2] == [(r["arm"], r["step"]) for r in one_process] != []
    for g, r in zip(data_parallel_2, one_process, strict=True):
        where = f"arm {r['arm']} step {r['step']}"
        assert g["reward_mean"] == pytest.approx(r["reward_mean"], rel=1e-6), where
        assert g["loss"] == pytest.approx(r["loss"], rel=REL, abs=ABS_LOSS), where
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=REL), where


def test_tensor_parallel_2_by_data_parallel_2_equals_data_parallel_2(tmp_path, data_parallel_2, warm_cli):
    got = _grpo(warm_cli, tmp_path / "tp2dp2", 4, "policy.megatron_cfg.tensor_model_parallel_size=2")
    _assert_same_run(got, data_parallel_2, engines_per_replica=2)


PP2 = ("policy.megatron_cfg.pipeline_model_parallel_size=2", "policy.train_micro_batch_size=16")


def test_pipeline_parallel_2_equals_one_process(tmp_path, one_process, warm_cli):
    """Two stages, each its own colocated engine refit with the whole model (the bridge broadcasts each stage's
    layers); 4 micro-batches of 16 per update through the 1F1B schedule, the old policy scored 32 rows per
    forward-only micro-batch, log-probabilities broadcast from the last stage."""
    got = _grpo(warm_cli, tmp_path / "pp2", 2, *PP2, "policy.logprob_batch_size=32")
    _assert_same_run(got, one_process, engines_per_replica=2)


def test_pipeline_parallel_2_by_data_parallel_2_equals_data_parallel_2(tmp_path, data_parallel_2, warm_cli):
    got = _grpo(warm_cli, tmp_path / "pp2dp2", 4, *PP2)
    _assert_same_run(got, data_parallel_2, engines_per_replica=2)


def test_pipeline_checkpoint_resumes_exactly_and_another_layout_is_refused(tmp_path, warm_cli):
    """PP=2 with the distributed optimizer: 1 step, a checkpoint per stage, then a rerun to 2 steps resumes and its
    second step equals the uninterrupted run's exactly; the same checkpoint under TP=2 is refused by name. The FP8
    arm only (its checkpoint holds what the BF16 arm's does, and its refits FP8 weights and scales)."""
    ckpt = ("checkpointing.enabled=true", "checkpointing.save_period=1")
    zero1 = "policy.megatron_cfg.optimizer.use_distributed_optimizer=true"
    run = (*PP2, zero1, *ckpt)
    whole = _grpo(warm_cli, tmp_path / "whole", 2, *run, f"checkpointing.checkpoint_dir={tmp_path / 'c1'}", arms="fp8")
    resumed_dir = f"checkpointing.checkpoint_dir={tmp_path / 'c2'}"
    _grpo(warm_cli, tmp_path / "split", 2, *run, resumed_dir, steps=1, arms="fp8")
    split = _grpo(warm_cli, tmp_path / "split", 2, *run, resumed_dir, arms="fp8")
    keys = ("arm", "step", "reward_mean", "sample", "loss", "grad_norm", "gen_kl", "refit_fp8_bytes")

    def rows(run: list[dict]) -> list[dict]:
        return sorted(({k: r[k] for k in keys} for r in run), key=lambda r: (r["arm"], r["step"]))

    assert rows(split) == rows(whole) and len(whole) == 2 and whole[0]["refit_fp8_bytes"] > 0
    other = ("policy.megatron_cfg.tensor_model_parallel_size=2", "policy.train_micro_batch_size=16")
    refused = _grpo(
        warm_cli, tmp_path / "split", 2, *other, zero1, *ckpt, resumed_dir, steps=3, arms="fp8", check=False
    )[0]["stderr"]
    assert "pipeline_model_parallel_size" in refused and "tensor_model_parallel_size" in refused


def test_distributed_optimizer_is_the_unsharded_run_bit_for_bit(tmp_path, data_parallel_2, warm_cli):
    """Each replica keeps the FP32 main weights and moments of half the elements; AdamW is element-wise, the
    gradient norm global, so every metric equals the unsharded run exactly."""
    got = _grpo(warm_cli, tmp_path / "zero1", 2, "policy.megatron_cfg.optimizer.use_distributed_optimizer=true")
    keys = ("reward_mean", "sample", "loss", "grad_norm", "gen_kl", "refit_fp8_bytes", "refit_bf16_bytes")
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in data_parallel_2]


MOE = ("model.name_or_path=tiny-moe", "checkpointing.enabled=false")


def test_expert_parallel_2_equals_data_parallel_2_on_the_moe_model(tmp_path, warm_cli):
    """The same two replicas, their experts split over them: every step equals the run that keeps all 4 experts on
    each rank (MoE batches are padded to one length over the replicas in both runs)."""
    ref = _grpo(warm_cli, tmp_path / "moe_dp2", 2, *MOE)
    got = _grpo(warm_cli, tmp_path / "moe_ep2", 2, *MOE, "policy.megatron_cfg.expert_model_parallel_size=2")
    _assert_same_run(got, ref, engines_per_replica=1)


def test_expert_parallel_checkpoint_resumes_exactly(tmp_path, warm_cli):
    """EP=2: each expert-parallel rank writes its own shard (its experts); 1 step + resume equals 2 steps (the FP8
    arm, as in the pipeline-parallel resume above)."""
    moe = ("model.name_or_path=tiny-moe", "policy.megatron_cfg.expert_model_parallel_size=2")
    ckpt = ("checkpointing.enabled=true", "checkpointing.save_period=1")
    whole = _grpo(
        warm_cli, tmp_path / "whole", 2, *moe, *ckpt, f"checkpointing.checkpoint_dir={tmp_path / 'c1'}", arms="fp8"
    )
    again = f"checkpointing.checkpoint_dir={tmp_path / 'c2'}"
    _grpo(warm_cli, tmp_path / "split", 2, *moe, *ckpt, again, steps=1, arms="fp8")
    files = {p.name for p in (tmp_path / "c2" / "fp8" / "step_0").iterdir()}
    assert {"model_tp00_pp00_ep00.pt", "model_tp00_pp00_ep01.pt", "optim_tp00_pp00_ep01.pt"} <= files, files
    split = _grpo(warm_cli, tmp_path / "split", 2, *moe, *ckpt, again, arms="fp8")
    keys = ("arm", "step", "reward_mean", "sample", "loss", "grad_norm", "gen_kl", "refit_fp8_bytes")

    def rows(run: list[dict]) -> list[dict]:
        return sorted(({k: r[k] for k in keys} for r in run), key=lambda r: (r["arm"], r["step"]))

    assert rows(split) == rows(whole) and len(whole) == 2 and whole[0]["refit_fp8_bytes"] > 0


def test_expert_parallelism_needs_a_moe_model_and_splits_its_experts_evenly(warm_cli):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MFP8_ROLE", "ROLLOUT_TASKS")}
    for overrides, message in (
        (("policy.megatron_cfg.expert_model_parallel_size=2",), "'tiny' has no routed experts"),
        ((*MOE, "policy.megatron_cfg.expert_model_parallel_size=3"), "does not split the model's 4 experts evenly"),
    ):
        proc = warm_cli.run(["config", *overrides], cwd=REPO, env=env, timeout=300)
        assert proc.returncode != 0 and message in proc.stderr and "approved" not in proc.stdout, proc.stderr
    # a limit of this machine's CPU optimizer: `config` (which plans a run for a GPU node too) notes it, a run here
    # is refused before it touches a model
    cpu_only = (
        "model.name_or_path=tiny-moe",
        "policy.megatron_cfg.optimizer.use_distributed_optimizer=true",
        "policy.megatron_cfg.expert_model_parallel_size=2",
    )
    message = "the CPU distributed optimizer shards over the dense data-parallel ranks"
    planned = warm_cli.run(["config", *cpu_only], cwd=REPO, env=env, timeout=300)
    assert planned.returncode == 0 and message in planned.stdout and "on this machine (no GPU)" in planned.stdout
    run = warm_cli.run(["grpo", "--steps", "1", *cpu_only], cwd=REPO, env=env, timeout=300)
    assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]


def test_global_batch_splits_a_step_into_updates_and_micro_batches_stay_exact(tmp_path, one_process, warm_cli):
    """``policy.train_global_batch_size`` (NeMo-RL's key): the step's samples as updates of 16, each seeing
    the policy the previous one left (the PPO ratio moves: approx KL > 0 at the second update); micro-batches
    of 4 inside them give the same run."""
    whole = _grpo(warm_cli, tmp_path / "g16", 1, "policy.train_global_batch_size=16")
    micro = _grpo(
        warm_cli, tmp_path / "g16m4", 1, "policy.train_global_batch_size=16", "policy.train_micro_batch_size=4"
    )
    for g, r in zip(whole, one_process, strict=True):
        assert g["reward_mean"] == r["reward_mean"] or g["step"] > 0  # step 0 samples before any update
        assert r["ppo_approx_kl"] == 0.0 and g["ppo_approx_kl"] > 0.0  # one update vs a second on moved weights
    _assert_same_run(micro, whole, engines_per_replica=1)


def test_update_rows_over_data_parallel_ranks():
    from megatron_fp8.config import load_config
    from megatron_fp8.errors import ConfigError
    from megatron_fp8.rl.cluster.distributed import DataParallel
    from megatron_fp8.rl.driver.train_settings import update_rows

    cfg = load_config(None, ["policy.train_global_batch_size=16"])
    assert update_rows(32, cfg, DataParallel()) == [slice(0, 16), slice(16, 32)]
    assert update_rows(16, cfg, DataParallel(rank=1, world_size=2)) == [slice(0, 8), slice(8, 16)]
    assert update_rows(32, load_config(None, []), DataParallel()) == [slice(0, 32)]
    with pytest.raises(ConfigError, match="train_global_batch_size=16 over 3"):
        update_rows(12, cfg, DataParallel(rank=0, world_size=3))
    with pytest.raises(ConfigError, match="train_global_batch_size=12 must divide the step's"):
        load_config(None, ["policy.train_global_batch_size=12"])


PACKED = (
    "policy.sequence_packing.enabled=true",
    "policy.sequence_packing.train_mb_tokens=128",
    "policy.sequence_packing.logprob_mb_tokens=256",
)
DYNAMIC = (
    "policy.dynamic_batching.enabled=true",
    "policy.dynamic_batching.train_mb_tokens=128",
    "policy.dynamic_batching.logprob_mb_tokens=256",
    "policy.dynamic_batching.sequence_length_round=1",  # the tiny model's rows are 6-12 tokens
)


def _assert_fewer_tokens(got: list[dict], ref: list[dict], *, replicas_ranks: int = 1, fewer: bool = True) -> None:
    """The same real tokens as the padded run (per rank of a replica: each scores and trains all of its rows), fewer
    computed (at most as many with ``fewer=False``)."""
    for g, r in zip(got, ref, strict=True):
        assert g["trainer_tokens_real_per_rank"] == r["trainer_tokens_real_per_rank"] * replicas_ranks
        computed, padded = sum(g["trainer_tokens_computed_per_rank"]), sum(r["trainer_tokens_computed_per_rank"])
        assert computed < padded * replicas_ranks if fewer else computed <= padded * replicas_ranks


@pytest.mark.parametrize("layout", ["packed", "dynamic"])
def test_packed_and_dynamic_micro_batches_equal_the_padded_run(tmp_path, one_process, warm_cli, layout):
    """Issue 54: ``policy.sequence_packing`` (NeMo-RL's packer, micro-batches of <= 128 tokens, Megatron-Core's THD
    path) and ``policy.dynamic_batching`` (rows of similar length up to 128 tokens) in every trainer pass (old-policy
    and reference scores, the update): the same run as the padded one, with fewer tokens computed."""
    got = _grpo(warm_cli, tmp_path / layout, 1, *(PACKED if layout == "packed" else DYNAMIC))
    _assert_same_run(got, one_process, engines_per_replica=1)
    _assert_fewer_tokens(got, one_process)
    if layout == "packed":
        assert all(r["trainer_padding_share"] < 0.1 for r in got), [r["trainer_padding_share"] for r in got]


@pytest.mark.parametrize("layout", [("policy.megatron_cfg.tensor_model_parallel_size=2",), PP2], ids=["tp2", "pp2"])
def test_packed_micro_batches_under_model_parallelism_equal_one_process(tmp_path, one_process, warm_cli, layout):
    """Packed sequences over two tensor-parallel ranks (vocabulary-parallel log-probabilities of a THD micro-batch)
    and over two pipeline stages (every bin padded to the longest, one activation shape per pass through the 1F1B
    schedule: at the tiny model's 6-12-token rows that fill is as much as the padded rows', so only "not more"): the
    padded one-process run."""
    got = _grpo(warm_cli, tmp_path / "packed", 2, *layout, *PACKED)
    _assert_same_run(got, one_process, engines_per_replica=2)
    _assert_fewer_tokens(got, one_process, replicas_ranks=2, fewer=layout != PP2)
