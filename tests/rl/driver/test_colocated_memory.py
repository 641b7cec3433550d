"""A colocated arm's memory phase by phase (``rl.driver.colocated``): the hooks ``run_step`` calls, in its order, on
the reference engine and a tiny Megatron trainer; and a GRPO run with the schedule equals one without it."""

from __future__ import annotations

import json

import _warm_cli
import pytest
import torch
from safetensors.torch import load_file

from bridge_mappings.manifest import Fingerprint, Manifest
from bridge_mappings.quantized_export import quantized_stream
from megatron_fp8.config import load_config
from megatron_fp8.errors import EngineNotServingError, RefitError
from megatron_fp8.megatron import build_megatron_model, make_optimizer, megatron_parallel
from megatron_fp8.models import tiny_model_path
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.rl.driver.colocated import colocated_memory
from megatron_fp8.rollout.engines import ReferenceRolloutEngine
from megatron_fp8.rollout.sleep import RecordingSleepControl, SleepCall

QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
ARGS = dict(max_new_tokens=4, temperature=0.0, seed=0, eos_token_id=-1)
PROMPTS = [[5, 17, 33, 40, 2]]


@pytest.fixture(scope="module")
def trainer():
    with megatron_parallel(seed=3):
        model = build_megatron_model(tiny_model_path("tiny"), dtype="fp32")
        yield model, make_optimizer(model, lr=1e-2)


def _engine():
    return ReferenceRolloutEngine(tiny_model_path("tiny"), quantization_config=QCFG, fp8_names=None)


@pytest.mark.parametrize("for_logprob", [False, True])
def test_hooks_in_run_step_order(trainer, for_logprob):
    model, optimizer = trainer
    engine = _engine()
    cfg = load_config(None, [f"policy.offload_optimizer_for_logprob={str(for_logprob).lower()}"])
    memory = colocated_memory(engine, model, optimizer, cfg)
    assert memory is not None and engine.applier is memory.sleep.applier  # refits go through the schedule
    control = memory.sleep.control
    assert isinstance(control, RecordingSleepControl) and memory.sleep.level == 2
    assert not memory.sleep.gives_memory_back  # vLLM's applier keeps probing its prefix cache: nothing was unmapped

    memory.before_generation()
    assert memory.offload.offloaded
    engine.generate(PROMPTS, **ARGS)
    memory.after_generation()
    assert memory.sleep.state == "asleep" and memory.offload.offloaded is for_logprob
    with pytest.raises(EngineNotServingError):
        engine.generate(PROMPTS, **ARGS)
    memory.before_update()
    assert not memory.offload.offloaded
    memory.after_train()
    assert memory.offload.offloaded

    weights = load_file(str(tiny_model_path("tiny") / "model.safetensors"))
    fp8 = tuple(sorted(engine.engine.fp8_names))
    manifest = Manifest("t", Fingerprint("x", "0", "{}", 0, 0), fp8, tuple(sorted(set(weights) - set(fp8))), (), QCFG)
    refit = ColocatedRefit(engine.applier, timeout=30)
    with pytest.raises(RefitError, match="asleep"):  # a refit outside the schedule's wake-up is refused
        refit.refit(quantized_stream(weights.items(), manifest))
    memory.refit(lambda: refit.refit(quantized_stream(weights.items(), manifest)))
    assert control.calls == [
        SleepCall("sleep", level=2),
        SleepCall("wake_up", tags=("weights",)),
        SleepCall("wake_up", tags=("kv_cache",)),
    ]
    assert memory.sleep.state == "serving" and engine.generate(PROMPTS, **ARGS).token_ids
    memory.before_update()  # leave the shared optimizer on its device for the next case


def test_no_schedule_without_sleep_or_colocation(trainer):
    model, optimizer = trainer
    for override in ("policy.generation.colocated.sleep_level=0", "policy.generation.colocated.enabled=false"):
        engine = _engine()
        before = engine.applier
        assert colocated_memory(engine, model, optimizer, load_config(None, [override])) is None
        assert engine.applier is before


@pytest.mark.slow
def test_grpo_with_the_schedule_equals_grpo_without(tmp_path):
    """Offload round trips and the sleep schedule change nothing a step computes (FP8 KV cache: its scales are
    rewritten after every wake-up)."""

    def run(out, *extra):
        cmd = ["grpo", "--steps", "2", "--arms", "fp8_tis", "--no-progress"]
        cmd += ["--out", str(out), "policy.generation.vllm_cfg.kv_cache_dtype=fp8", "grpo.warm_start_steps=2", *extra]
        proc = _warm_cli.run(cmd, timeout=900)  # a process of its own, forked by the suite's warm launcher
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    slept, a = run(tmp_path / "a", "policy.offload_optimizer_for_logprob=true")
    assert "runs against a recording control" in slept.stderr
    _, b = run(tmp_path / "b", "policy.generation.colocated.sleep_level=0")
    keys = ("loss", "grad_norm", "reward_mean", "ppo_approx_kl", "refit_max_rel_error")
    assert [[m[k] for k in keys] for m in a] == [[m[k] for k in keys] for m in b]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in a)
