"""Cross-field validation rules and the TP divisibility check."""

from __future__ import annotations

import pytest

from megatron_fp8.config import KNOWN_MODELS, load_config, tp_sizes_that_work, validate_tp_divisibility
from megatron_fp8.errors import ConfigError

V = "policy.generation.vllm_cfg"


def _err(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return str(info.value)


def test_block_size_needs_the_other_three_keys():
    msg = _err(f"{V}.quantization_config.weight_block_size=[128,128]", f"{V}.quantization_config.fmt=e4m3")
    assert f"{V}.quantization_config.quant_method" in msg
    assert f"{V}.quantization_config.activation_scheme" in msg
    assert f"{V}.quantization_config.fmt," not in msg
    ok = load_config(
        None,
        [
            f"{V}.quantization_config.weight_block_size=[128,128]",
            f"{V}.quantization_config.fmt=e4m3",
            f"{V}.quantization_config.quant_method=fp8",
            f"{V}.quantization_config.activation_scheme=dynamic",
        ],
    )
    assert ok.rollout_blockwise


def test_moe_rejects_per_tensor_rollout():
    msg = _err("model.name_or_path=tiny-moe", f"{V}.quantization_config.quant_method=fp8")
    assert "MoE" in msg and "per-tensor" in msg and "weight_block_size" in msg
    dense = load_config(None, [f"{V}.quantization_config.quant_method=fp8"])
    assert not dense.rollout_blockwise
    moe = load_config(None, ["model.name_or_path=tiny-moe"])
    assert moe.model.is_moe and moe.rollout_blockwise


def test_fp8_kv_cache_needs_fp8_precision():
    msg = _err(f"{V}.kv_cache_dtype=fp8", f"{V}.precision=bf16")
    assert f"{V}.kv_cache_dtype: fp8 needs {V}.precision: fp8" in msg
    assert load_config(None, [f"{V}.kv_cache_dtype=fp8"]).policy.generation.vllm_cfg.kv_cache_dtype == "fp8"


def test_unknown_training_recipe_lists_valid():
    msg = _err("policy.megatron_cfg.fp8_cfg.fp8_recipe=blockwize")
    assert "did you mean 'blockwise'" in msg
    for name in ("tensorwise", "blockwise", "fp8_param", "delayed", "mxfp8"):
        assert name in msg
    assert load_config(None, ["policy.megatron_cfg.fp8_cfg.enabled=false"]).training_recipe == "bf16"


def test_fp8_param_maps_to_recipe_and_rejects_tensorwise():
    assert load_config(None, ["policy.megatron_cfg.fp8_cfg.fp8_param=true"]).training_recipe == "fp8_param"
    msg = _err("policy.megatron_cfg.fp8_cfg.fp8_param=true", "policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise")
    assert "fp8_param" in msg and "blockwise" in msg


def test_block_scale_env_var_must_be_one():
    msg = _err("policy.megatron_cfg.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0")
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES" in msg


def test_tp_divisibility_in_validation_names_projection_and_sizes():
    msg = _err(f"{V}.tensor_parallel_size=2")
    assert f"{V}.tensor_parallel_size=2" in msg and "k_proj/v_proj" in msg
    assert "TP sizes that work for this model: 1" in msg
    # BF16 rollout has no block constraint
    assert load_config(None, [f"{V}.tensor_parallel_size=2", f"{V}.precision=bf16"])


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("loss_fn.is_cap=0", "loss_fn.is_cap"),
        ("grpo.arms=[bf16,fp9]", "fp9"),
        ("grpo.arms=[bf16,bf16]", "twice"),
        ("grpo.num_generations_per_prompt=0", "grpo.num_generations_per_prompt"),
        ("kv_cache.percentile=120", "kv_cache.percentile"),
        ("kv_cache.margin=0.9", "kv_cache.margin"),
        (f"{V}.gpu_memory_utilization=1.5", "gpu_memory_utilization"),
        ("policy.megatron_cfg.fp8_cfg.num_last_layers_in_bf16=9", "exceeds the model's 4 layers"),
        ("loss_fn.ratio_clip_min=1.2", "loss_fn.ratio_clip_min"),
        ("refit.bucket_size_mb=0", "refit.bucket_size_mb"),
    ],
)
def test_range_rules(override, needle):
    assert needle in _err(override)


def test_is_bounds_order():
    assert "loss_fn.is_lower" in _err("loss_fn.is_lower=2.0", "loss_fn.is_upper=0.5")


def test_validate_tp_divisibility_function():
    llama = KNOWN_MODELS["llama-3.1-8b"]
    dims = (llama.hidden_size, llama.intermediate_size, llama.num_attention_heads, llama.num_key_value_heads)
    for tp in (1, 2, 4, 8):
        validate_tp_divisibility(*dims, llama.head_dim, tp)
    with pytest.raises(ConfigError, match="attention heads do not split"):
        validate_tp_divisibility(*dims, llama.head_dim, 3)
    qwen_moe = KNOWN_MODELS["qwen3-30b-a3b"]
    args = (qwen_moe.hidden_size, qwen_moe.intermediate_size, 32, 4, 128)
    with pytest.raises(ConfigError) as info:
        validate_tp_divisibility(*args, 4, moe_intermediate_size=768)
    assert "experts" in str(info.value) and "192" in str(info.value)
    assert tp_sizes_that_work(*args, moe_intermediate_size=768) == (1, 2)
    with pytest.raises(ConfigError, match="integer >= 1"):
        validate_tp_divisibility(*args, 0)


def test_trainer_tp_must_split_heads_and_hold_whole_blocks():
    """Trainer TP is checked at load (on the known dimensions) as well as the rollout TP."""
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3 does not split .* sizes that work for this"):
        load_config(None, ["policy.megatron_cfg.tensor_model_parallel_size=3"])
    with pytest.raises(ConfigError, match=r"not whole 128x128 blocks under the 'blockwise' FP8 recipe"):
        load_config(None, ["policy.megatron_cfg.tensor_model_parallel_size=2"])
    cfg = load_config(
        None, ["policy.megatron_cfg.tensor_model_parallel_size=2", "policy.megatron_cfg.fp8_cfg.enabled=false"]
    )
    assert cfg.policy.megatron_cfg.tensor_model_parallel_size == 2  # BF16 training: heads split evenly, no blocks
