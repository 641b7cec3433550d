"""The three kinds of key (implemented / NeMo-RL-known no effect / unknown), the key-set data, the wiring."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from megatron_fp8.config import RunConfig, load_config
from megatron_fp8.config.explain import EFFECTS, effect_of
from megatron_fp8.config.loader import load_config_report
from megatron_fp8.config.nemo_rl.inheritance import leaf_paths
from megatron_fp8.config.nemo_rl.keys import collect_keys, known_keys
from megatron_fp8.config.wiring import (
    DEEP_GEMM_E8M0_ENV,
    DEEP_GEMM_ENV,
    megatron_parallel_args,
    quantization_ignored_layer_kws,
    vllm_engine_args,
    vllm_env,
)
from megatron_fp8.errors import ConfigError

DATA = Path(__file__).parent / "data" / "nemo_rl"


def test_known_key_is_accepted_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.config.loader"):
        loaded = load_config_report(
            None,
            [
                "policy.generation.top_p=0.9",
                "checkpointing.model_save_format=null",
                "policy.megatron_cfg.sequence_parallel=true",
            ],
        )
    assert loaded.no_effect == {
        "policy.megatron_cfg.sequence_parallel": True,
        "policy.generation.top_p": 0.9,
        "checkpointing.model_save_format": None,
    }
    msgs = [r.getMessage() for r in caplog.records if "no effect in megatron-fp8" in r.getMessage()]
    assert len(msgs) == 1 and "  policy.generation: top_p" in msgs[0] and "  checkpointing: " in msgs[0]
    assert all(len(line) <= 80 for line in msgs[0].splitlines()[1:])  # one line per section, wrapped


def test_default_config_loads_without_no_effect_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.config.loader"):
        assert load_config_report(None).no_effect == {}
    assert not [r for r in caplog.records if "no effect" in r.getMessage()]


def test_unknown_key_is_rejected_with_did_you_mean():
    with pytest.raises(ConfigError, match="did you mean 'policy.generation.vllm_cfg.use_deep_gemm'"):
        load_config(None, ["policy.generation.vllm_cfg.use_deep_gem=true"])
    with pytest.raises(ConfigError, match="unknown key 'checkpointng'"):
        load_config(None, ["checkpointng.enabled=false"])


def test_retired_and_open_keys():
    kk = known_keys()
    assert kk.is_known("logging.log_every") and "metrics.jsonl" in kk.reason("logging.log_every")
    assert kk.is_known("policy.generation.vllm_kwargs.anything_at_all")
    assert not kk.is_known("policy.generation.vllm_cfg.no_such_key")
    assert "no context parallelism yet" in kk.reason("policy.megatron_cfg.context_parallel_size")


def test_shipped_nemo_rl_configs_use_only_known_keys():
    keys, open_ = collect_keys(DATA)
    kk = known_keys()
    assert set(keys) <= kk.keys and set(open_) <= kk.open | kk.keys


def test_every_schema_key_declares_its_effect():
    for key in leaf_paths(RunConfig().to_dict()):
        assert effect_of(key) is not None, f"{key}: add its effect to config.explain.EFFECTS"
    schema_keys = set(leaf_paths(RunConfig().to_dict()))
    assert set(EFFECTS) <= schema_keys, set(EFFECTS) - schema_keys  # no stale entries


def test_vllm_engine_args_observe_each_key():
    vllm = "policy.generation.vllm_cfg"
    cfg = load_config(
        None,
        [f"{vllm}.gpu_memory_utilization=0.35", f"{vllm}.kv_cache_dtype=fp8_e4m3", f"{vllm}.max_model_len=2048"],
    )
    assert vllm_engine_args(cfg) == {
        "gpu_memory_utilization": 0.35,
        "tensor_parallel_size": 1,
        "kv_cache_dtype": "fp8",
        "max_model_len": 2048,
        "enable_sleep_mode": True,  # colocated: the engine sleeps while the trainer trains (sleep_level 2, derived)
    }
    apart = load_config(None, ["policy.generation.colocated.enabled=false"])
    assert "enable_sleep_mode" not in vllm_engine_args(apart)
    awake = load_config(None, ["policy.generation.colocated.sleep_level=0"])
    assert "enable_sleep_mode" not in vllm_engine_args(awake)
    # the BF16 arm of the same run: an FP8 KV cache needs FP8 weights
    assert vllm_engine_args(cfg, rollout_precision="bf16")["kv_cache_dtype"] == "auto"
    # TP 2 (a BF16 rollout: tiny's KV heads do not split into 128-blocks at TP 2)
    tp2 = load_config(None, [f"{vllm}.tensor_parallel_size=2", f"{vllm}.precision=bf16"])
    assert vllm_engine_args(tp2)["tensor_parallel_size"] == 2
    assert "max_model_len" not in vllm_engine_args(load_config())


def test_use_deep_gemm_sets_vllm_env():
    on = load_config(None, ["policy.generation.vllm_cfg.use_deep_gemm=true"])
    assert vllm_env(on) == {DEEP_GEMM_ENV: "1", DEEP_GEMM_E8M0_ENV: "0"}
    assert vllm_env(on, rollout_precision="bf16") == {DEEP_GEMM_ENV: "0"}
    assert vllm_env(load_config()) == {DEEP_GEMM_ENV: "0"}


def test_parallel_sizes_and_ignored_layer_keywords():
    cfg = load_config(
        None,
        [
            "policy.megatron_cfg.pipeline_model_parallel_size=2",
            "policy.generation.vllm_cfg.quantization_ignored_layer_kws=[q_proj,o_proj]",
        ],
    )
    assert megatron_parallel_args(cfg) == {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 2,
        "expert_parallel_size": 1,
    }
    assert quantization_ignored_layer_kws(cfg) == ("q_proj", "o_proj")


def test_is_mx_refused_naming_blackwell_and_megatron_enabled_false_refused():
    with pytest.raises(ConfigError, match="needs a Blackwell GPU"):
        load_config(None, ["policy.generation.vllm_cfg.is_mx=true"])
    with pytest.raises(ConfigError, match="megatron_cfg.enabled: false"):
        load_config(None, ["policy.megatron_cfg.enabled=false"])


def test_unimplemented_layouts_are_refused_naming_the_key():
    """Issue 27: a layout megatron-fp8 does not run is refused before a run, never approved; its default is not."""
    from megatron_fp8.config.refusals import refuse_before_run, unimplemented_layout

    loaded = load_config_report(
        None, ["policy.megatron_cfg.sequence_parallel=true", "policy.megatron_cfg.context_parallel_size=2"]
    )
    problems = unimplemented_layout(loaded.no_effect)
    assert [p.split("=")[0] for p in problems] == [
        "policy.megatron_cfg.context_parallel_size",
        "policy.megatron_cfg.sequence_parallel",
    ]
    with pytest.raises(ConfigError, match=r"this run cannot start:\n  - policy.megatron_cfg.context_parallel_size=2"):
        refuse_before_run(loaded.config, loaded.no_effect)
    defaults = load_config_report(None, ["policy.megatron_cfg.sequence_parallel=false"]).no_effect
    assert unimplemented_layout(defaults) == []
    nemo_rl_8b = load_config_report(DATA / "examples/configs/grpo_math_8B_megatron_fp8.yaml").no_effect
    assert unimplemented_layout(nemo_rl_8b) == []  # its CP 1 / EP 1 / sequence_parallel false ask for nothing
