"""The memory plan per phase (``config.memory_plan``): what ``config`` prints and refuses for the shipped configs."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import _warm_cli
import pytest

from megatron_fp8.config import load_config
from megatron_fp8.config.memory import engine_weight_bytes
from megatron_fp8.config.memory_plan import (
    REFIT_BUCKETS_IN_FLIGHT,
    SLEEPING_ENGINE_BYTES,
    memory_report,
    plan_memory,
    sleep_level,
    trainer_offloads,
    what_would_fit,
)
from megatron_fp8.config.validate import validate_config
from megatron_fp8.errors import ConfigError
from megatron_fp8.models.dims import KNOWN_MODELS

REPO = Path(__file__).resolve().parents[2]
H100 = (80 * 10**9, "H100 80 GB")
LLAMA = KNOWN_MODELS["llama-3.1-8b"]
GB = 10**9


def _replaced(obj: object, path: str, **changes: object) -> object:
    head, _, rest = path.partition(".")
    inner = getattr(obj, head)
    return dataclasses.replace(
        obj, **{head: _replaced(inner, rest, **changes) if rest else dataclasses.replace(inner, **changes)}
    )


def _phases(plan) -> dict[str, dict[str, int]]:
    return {p.phase: dict(p.parts) for p in plan.phases}


def test_shipped_8b_plan_sleeps_the_engine_while_training():
    cfg = load_config(REPO / "configs" / "llama31_8b_fp8.yaml")
    assert sleep_level(cfg) == 2 and trainer_offloads(cfg)
    plan = plan_memory(cfg, LLAMA, gpu=H100, processes=8)
    p = _phases(plan)
    w = 2 * LLAMA.num_parameters // 2  # BF16 weights / TP 2
    assert p["training"]["trainer weights"] == w and p["training"]["gradients"] == 2 * w
    assert p["training"]["optimizer state"] == 12 * (LLAMA.num_parameters // 4) // 2  # sharded over DP 4
    assert p["training"]["sleeping engine (assumed)"] == SLEEPING_ENGINE_BYTES and "engine" not in p["training"]
    assert p["generation"] == {"engine": 40 * GB, "trainer weights": w}  # optimizer and gradients offloaded
    assert set(p["refit"]) == {
        "trainer weights",
        "woken engine weights",
        "refit's staged version",
        "rollback snapshot (engine weights)",
        "sleeping engine (assumed)",
    }
    staged = engine_weight_bytes(cfg, LLAMA)
    assert 8.5 * GB < staged < 9.5 * GB  # the FP8 version of 8B (1 B per linear weight, BF16 embeddings and norms)
    # the refit stream stays on the GPU and its buckets are the version staged there until the commit (the whole
    # version: every rank receives all of it), more than the buckets in flight
    assert p["refit"]["refit's staged version"] == staged > REFIT_BUCKETS_IN_FLIGHT * (cfg.refit.bucket_size_mb << 20)
    # the image's vLLM 0.11 loads in place: its rollback source is a copy of the engine's weights on the GPU
    assert p["refit"]["rollback snapshot (engine weights)"] == p["refit"]["woken engine weights"] == staged
    assert plan.fits and plan.peak.phase == "generation" and round(plan.peak.total / GB, 1) == 48.0
    # pinned host copies of the offloaded state only: no version of the refit in host memory
    assert plan.host_bytes == p["training"]["optimizer state"]
    # the engine awake throughout (sleep level 0): the trainer's whole state next to the engine's budget
    awake = plan_memory(_replaced(cfg, "policy.generation.colocated", sleep_level=0), LLAMA, gpu=H100, processes=8)
    assert not awake.offload and all("engine awake" in ph or "engine" in ph for ph in _phases(awake).values())
    assert awake.peak.total == 40 * GB + sum(v for k, v in p["training"].items() if "engine" not in k) + 2 * staged
    # level 1 keeps the engine's weights in host memory
    level1 = plan_memory(_replaced(cfg, "policy.generation.colocated", sleep_level=1), LLAMA, gpu=H100, processes=8)
    assert level1.host_bytes == plan.host_bytes + _phases(level1)["refit"]["woken engine weights"]


def test_a_plan_over_the_gpu_is_refused_naming_what_fits():
    cfg = load_config(REPO / "configs" / "llama31_8b_fp8_nemorl_keys.yaml")
    cfg = _replaced(cfg, "policy.megatron_cfg.optimizer", use_distributed_optimizer=False)  # NeMo-RL's keys alone
    plan = plan_memory(cfg, LLAMA, gpu=H100, processes=8)
    assert not plan.fits and plan.peak.phase == "training" and round(plan.peak.total / GB, 1) == 146.5
    fixes = what_would_fit(cfg, LLAMA, gpu=H100, processes=8)
    assert fixes[0].startswith("policy.megatron_cfg.optimizer.use_distributed_optimizer=true (peak training 62.2 GB")
    assert any(f.startswith("policy.megatron_cfg.tensor_model_parallel_size=2") for f in fixes)
    assert not any("sleep_level" in f for f in fixes)  # already level 2
    lines, problem = memory_report(cfg)
    assert any(line.startswith("  training: ") for line in lines)
    assert problem is not None and "exceeds the GPU in its training phase" in problem
    assert "use_distributed_optimizer=true" in problem and "--allow-over-memory" in problem
    # the same file with the engine awake: the sleep level is among the fixes
    awake = _replaced(cfg, "policy.megatron_cfg.optimizer", use_distributed_optimizer=True)
    awake = _replaced(awake, "policy.generation.colocated", sleep_level=0)
    assert not plan_memory(awake, LLAMA, gpu=H100, processes=8).fits
    assert what_would_fit(awake, LLAMA, gpu=H100, processes=8)[0].startswith(
        "policy.generation.colocated.sleep_level=2"
    )


def _config(*args: str) -> subprocess.CompletedProcess:
    """``megatron-fp8 config *args`` in a process of its own (the suite's warm launcher, tests/_warm_cli.py)."""
    return _warm_cli.run(["config", *args], timeout=120)


def test_config_refuses_over_memory_unless_allowed():
    path = str(REPO / "configs" / "llama31_8b_fp8_nemorl_keys.yaml")
    over = "policy.megatron_cfg.optimizer.use_distributed_optimizer=false"
    refused = _config("--config", path, over)
    assert refused.returncode == 1 and "the memory plan exceeds the GPU in its training phase" in refused.stderr
    assert "#   training: trainer weights 16.1 GB + gradients 32.1 GB + optimizer state 96.4 GB" in refused.stdout
    allowed = _config("--config", path, over, "--allow-over-memory")
    assert allowed.returncode == 0, allowed.stderr
    assert "running over the GPU's memory (grpo.allow_over_memory)" in allowed.stderr and "approved" in allowed.stdout
    fits = _config("--config", path)
    assert fits.returncode == 0 and "peak: training 62.2 GB of 80 GB" in fits.stdout


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("policy.megatron_cfg.empty_unused_memory_level=3", "empty_unused_memory_level must be 0, 1 or 2"),
        ("policy.generation.colocated.sleep_level=3", "sleep_level must be one of (0, 1, 2)"),
        ("policy.megatron_cfg.optimizer.optimizer_cpu_offload=true", "set policy.megatron_cfg.optimizer.use_distrib"),
        ("policy.megatron_cfg.optimizer.optimizer_offload_fraction=0.5", "acts only with optimizer_cpu_offload"),
        (
            "policy.megatron_cfg.optimizer.use_distributed_optimizer=true,"
            "policy.megatron_cfg.optimizer.optimizer_cpu_offload=true",
            "keeps the whole optimizer state on the GPU",
        ),
        ("policy.offload_optimizer_for_logprob=true", None),
    ],
)
def test_memory_keys_are_refused_by_value(override, message):
    if message is None:  # colocated, the engine sleeps: the key acts
        cfg = load_config(None, [override])
        awake = _replaced(cfg, "policy.generation.colocated", sleep_level=0)
        with pytest.raises(ConfigError, match="nothing is offloaded: drop it"):
            validate_config(awake)
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, override.split(","))


def test_sleep_level_needs_a_colocated_engine():
    cfg = load_config(None, ["policy.generation.colocated.enabled=false"])
    assert sleep_level(cfg) == 0 and not trainer_offloads(cfg)
    with pytest.raises(ConfigError, match="rollout ranks keep their engines awake"):
        validate_config(_replaced(cfg, "policy.generation.colocated", sleep_level=2))
    plan = plan_memory(cfg, LLAMA, gpu=H100, processes=8)
    assert [p.phase for p in plan.phases] == ["training", "refit"]


def test_optimizer_cpu_offload_moves_its_share_of_the_state_off_the_gpu():
    cfg = load_config(REPO / "configs" / "llama31_8b_fp8.yaml")
    base = plan_memory(cfg, LLAMA, gpu=H100, processes=8)
    half = _replaced(cfg, "policy.megatron_cfg.optimizer", optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    plan = plan_memory(half, LLAMA, gpu=H100, processes=8)
    optim = _phases(base)["training"]["optimizer state"]
    assert _phases(plan)["training"]["optimizer state"] == optim - int(optim * 0.5)
    assert plan.host_bytes == base.host_bytes  # offloaded during generation anyway: the same host copy
