"""Loading run configs: defaults, NeMo-RL keys, overrides, strict keys and types."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_fp8.config import RunConfig, config_from_dict, default_config_text, load_config
from megatron_fp8.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def test_package_default_equals_repo_copy():
    assert default_config_text() == (CONFIGS / "tiny_cpu.yaml").read_text()
    assert load_config(None) == load_config(CONFIGS / "tiny_cpu.yaml")


def test_default_is_tiny_with_three_arms():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    assert cfg.model.name_or_path == "tiny" and cfg.model.is_moe is False
    assert (cfg.model.hidden_size, cfg.model.num_attention_heads, cfg.model.head_dim) == (256, 4, 64)
    assert cfg.grpo.arms == ("bf16", "fp8", "fp8_tis")
    assert cfg.training_recipe == "blockwise" and cfg.rollout_blockwise


def test_nemorl_keys_load_unchanged():
    cfg = load_config(CONFIGS / "llama31_8b_fp8_nemorl_keys.yaml")
    vllm = cfg.policy.generation.vllm_cfg
    assert (vllm.precision, vllm.use_deep_gemm, vllm.gpu_memory_utilization) == ("fp8", True, 0.5)
    assert (vllm.num_first_layers_in_bf16, vllm.num_last_layers_in_bf16) == (0, 0)
    fp8 = cfg.policy.megatron_cfg.fp8_cfg
    assert (fp8.enabled, fp8.fp8, fp8.fp8_recipe, fp8.fp8_param) == (True, "e4m3", "blockwise", False)
    assert cfg.policy.megatron_cfg.optimizer.clip_grad == 1.0
    assert cfg.policy.megatron_cfg.env_vars == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    assert cfg.loss_fn.use_importance_sampling_correction is True and cfg.loss_fn.correction_enabled
    # NeMo-RL's switch on, no grpo.arms, no truncation type: the one corrected FP8 arm, untruncated (issue 38)
    assert cfg.grpo.arms == ("fp8_tis",) and (cfg.loss_fn.is_variant, cfg.loss_fn.is_cap) == ("token_tis", None)
    assert cfg.model.name_or_path == "meta-llama/Llama-3.1-8B-Instruct"
    assert cfg.model.hidden_size == 4096  # filled from the known-model table


@pytest.mark.parametrize("name", ["qwen3_8b_fp8.yaml", "llama31_8b_fp8.yaml"])
def test_hopper_configs_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.training_recipe == "blockwise" and cfg.rollout_blockwise
    assert cfg.loss_fn.is_variant == "token_tis" and cfg.loss_fn.is_cap == 2.0


def test_dotted_overrides():
    cfg = load_config(
        None,
        [
            "grpo.max_num_steps=3",
            "grpo.arms=[bf16,fp8_tis]",
            "policy.generation.vllm_cfg.gpu_memory_utilization=0.3",
            "+refit.bucket_size_mb=64",
            "policy.megatron_cfg.env_vars.MY_FLAG=7",
        ],
    )
    assert cfg.grpo.max_num_steps == 3 and cfg.grpo.arms == ("bf16", "fp8_tis")
    assert cfg.policy.generation.vllm_cfg.gpu_memory_utilization == 0.3
    assert cfg.refit.bucket_size_mb == 64
    assert cfg.policy.megatron_cfg.env_vars["MY_FLAG"] == "7"


def test_older_pow2_spellings_are_aliases():
    cfg = load_config(None, ["policy.generation.vllm_cfg.use_weight_pow2_scale=true", "grpo.max_num_steps=5"])
    assert cfg.policy.generation.vllm_cfg.pow2_weight_scaling_factors is True
    assert cfg.grpo.max_num_steps == 5
    with pytest.raises(ConfigError, match="alias"):
        load_config(
            None,
            [
                "policy.generation.vllm_cfg.use_activation_pow2_scale=true",
                "policy.generation.vllm_cfg.pow2_activation_scaling_factors=false",
            ],
        )


def test_unknown_key_did_you_mean_full_path():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["policy.generation.vllm_cfg.precison=fp8"])
    msg = str(info.value)
    assert "'policy.generation.vllm_cfg.precison'" in msg
    assert "did you mean 'policy.generation.vllm_cfg.precision'" in msg
    with pytest.raises(ConfigError, match="unknown key 'grp'; did you mean 'grpo'"):
        load_config(None, ["grp.num_steps=1"])


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("grpo.max_num_steps=abc", "grpo.max_num_steps", "int"),
        ("policy.megatron_cfg.fp8_cfg.enabled=3", "policy.megatron_cfg.fp8_cfg.enabled", "bool"),
        ("rollout.engine=smoke", "rollout.engine", "'auto'"),
        ("grpo.arms=3", "grpo.arms", "list of str"),  # a comma list string is a list (grpo.arms=bf16,fp8)
        ("loss_fn.is_variant=tis", "loss_fn.is_variant", "'token_tis'"),
    ],
)
def test_type_errors_name_key_and_type(override, key, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert key in str(info.value) and expected in str(info.value)


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(None, ["grpo"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_model_name_conflict(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  name_or_path: tiny\npolicy:\n  model_name: Qwen/Qwen3-8B\n")
    with pytest.raises(ConfigError, match="disagree"):
        load_config(f)


def test_roundtrip_to_dict_and_yaml(tmp_path):
    cfg = load_config(CONFIGS / "qwen3_8b_fp8.yaml")
    assert config_from_dict(cfg.to_dict()) == cfg
    out = tmp_path / "dump.yaml"
    out.write_text(cfg.dump_yaml())
    assert load_config(out) == cfg


def test_a_key_of_another_section_is_named_where_it_lives():
    """Issue 38 (8): ``grpo.lr`` has no near miss in ``grpo``; the refusal names the section that has ``lr``."""
    with pytest.raises(ConfigError, match=r"'lr' is a key of another section: policy\.megatron_cfg\.optimizer\.lr"):
        load_config(None, ["grpo.lr=1e-4"])
