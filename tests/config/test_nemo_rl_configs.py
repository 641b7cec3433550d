"""NeMo-RL's 18 FP8 example configs (shipped under data/nemo_rl with their parents) load unchanged."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from megatron_fp8.config.explain import explain_rows
from megatron_fp8.config.inheritance import compose_file, leaf_paths, resolve
from megatron_fp8.config.loader import load_config_report
from megatron_fp8.errors import ConfigError

DATA = Path(__file__).parent / "data" / "nemo_rl"
FP8_CONFIGS = (DATA / "FP8_CONFIGS.txt").read_text().split()


def test_all_eighteen_are_shipped_with_license_header():
    assert len(FP8_CONFIGS) == 18
    for rel in FP8_CONFIGS:
        head = (DATA / rel).read_text().splitlines()[:2]
        assert "github.com/NVIDIA-NeMo/RL" in head[0] and "Apache License" in head[1]
    assert (DATA / "LICENSE").is_file()


@pytest.mark.parametrize("rel", FP8_CONFIGS, ids=lambda r: Path(r).stem)
def test_nemo_rl_fp8_config_loads_unchanged(rel, caplog):
    path = DATA / rel
    if "mxfp8" in rel:
        with pytest.raises(ConfigError, match="is_mx: true asks for an MXFP8 rollout, which needs a Blackwell GPU"):
            load_config_report(path)
        return
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.config.loader"):
        loaded = load_config_report(path)
    cfg = loaded.config
    vllm = cfg.policy.generation.vllm_cfg
    assert vllm.precision == "fp8" and cfg.rollout_blockwise
    assert cfg.loss_fn.use_importance_sampling_correction
    # the no-effect keys are listed once, in one warning
    warnings = [r for r in caplog.records if "no effect in megatron-fp8" in r.getMessage()]
    assert len(warnings) == 1 and "checkpointing" in warnings[0].getMessage()
    # every key of the composed file is explained: implemented or no effect
    explained = {r.key for r in explain_rows(loaded)}
    resolved = resolve(compose_file(path))
    for key in leaf_paths(resolved):
        assert key in explained or any(e.startswith(key + ".") for e in explained) or _aliased(key), key


def _aliased(key: str) -> bool:
    return key in ("grpo.max_num_steps",)  # explained under its canonical name, grpo.num_steps


def test_8b_fp8_keys_take_effect():
    loaded = load_config_report(DATA / "examples/configs/grpo_math_8B_megatron_fp8.yaml")
    cfg = loaded.config
    vllm = cfg.policy.generation.vllm_cfg
    assert (vllm.use_deep_gemm, vllm.gpu_memory_utilization, vllm.max_model_len) == (True, 0.5, 4096)
    assert cfg.policy.megatron_cfg.pipeline_model_parallel_size == 2
    assert cfg.policy.megatron_cfg.env_vars == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    assert cfg.training_recipe == "blockwise"
    assert cfg.grpo.num_generations_per_prompt == 32 and cfg.grpo.seed == 42
    assert cfg.model.name_or_path == "meta-llama/Llama-3.1-8B-Instruct"
    assert Path(loaded.sources["policy.generation.vllm_cfg.max_model_len"]).name == "grpo_math_8B_megatron.yaml"
    assert "policy.megatron_cfg.sequence_parallel" in loaded.no_effect
    assert "policy.megatron_cfg.optimizer.use_precision_aware_optimizer" in loaded.no_effect


def test_kv_cache_and_ignored_layer_keywords():
    kv = load_config_report(DATA / "examples/configs/recipes/llm/grpo-qwen3-8b-base-1n8g-fp8-kvcache-megatron.yaml")
    assert kv.config.policy.generation.vllm_cfg.kv_cache_dtype == "fp8"
    assert kv.config.policy.megatron_cfg.tensor_model_parallel_size == 4
    ds = load_config_report(
        DATA / "examples/configs/recipes/llm/performance/grpo-deepseek-v3-64n8g-fp8-async-1off.yaml"
    )
    vllm = ds.config.policy.generation.vllm_cfg
    assert vllm.quantization_ignored_layer_kws == ("a_proj", "b_proj")
    assert vllm.tensor_parallel_size == 16
