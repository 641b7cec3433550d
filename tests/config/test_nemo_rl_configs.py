"""NeMo-RL's 18 FP8 example configs (shipped under data/nemo_rl with their parents) load unchanged."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from megatron_fp8.config.explain import explain_rows
from megatron_fp8.config.loader import load_config_report
from megatron_fp8.config.nemo_rl.inheritance import compose_file, leaf_paths, resolve
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
        assert key in explained or any(e.startswith(key + ".") for e in explained), key


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


EXPERIMENT_KEYS = (
    "policy.megatron_cfg.optimizer.lr",
    "policy.megatron_cfg.optimizer.min_lr",
    "policy.megatron_cfg.optimizer.weight_decay",
    "policy.megatron_cfg.optimizer.adam_beta1",
    "policy.megatron_cfg.optimizer.adam_beta2",
    "policy.megatron_cfg.optimizer.adam_eps",
    "policy.megatron_cfg.optimizer.clip_grad",
    "policy.megatron_cfg.scheduler.lr_warmup_iters",
    "policy.megatron_cfg.scheduler.lr_warmup_init",
    "policy.megatron_cfg.scheduler.lr_decay_style",
    "policy.megatron_cfg.scheduler.lr_decay_iters",
    "policy.generation.max_new_tokens",
    "policy.generation.temperature",
    "policy.train_global_batch_size",
    "policy.train_micro_batch_size",
    "policy.logprob_batch_size",
    "loss_fn.ratio_clip_min",
    "loss_fn.ratio_clip_max",
    "loss_fn.reference_policy_kl_penalty",
    "loss_fn.reference_policy_kl_type",
    "loss_fn.kl_input_clamp_value",
    "loss_fn.kl_output_clamp_value",
    "loss_fn.use_on_policy_kl_approximation",
    "loss_fn.token_level_loss",
    "grpo.num_prompts_per_step",
    "grpo.num_generations_per_prompt",
    "grpo.normalize_rewards",
    "grpo.use_leave_one_out_baseline",
    "grpo.val_period",
    "grpo.max_val_samples",
    "grpo.seed",
)
"""NeMo-RL keys that decide the experiment (optimizer, schedule, lengths, sampling, batches, loss, advantages)."""


def _get(tree: object, path: str) -> object:
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return KeyError
        tree = tree[part]
    return tree


@pytest.mark.parametrize("rel", [r for r in FP8_CONFIGS if "mxfp8" not in r], ids=lambda r: Path(r).stem)
def test_every_experiment_key_a_nemo_rl_file_sets_is_the_value_the_run_uses(rel):
    """Key by key: what the file (with its parents, interpolations resolved) says is what the typed config holds,
    and none of these keys is in the no-effect list; a key the file leaves out keeps megatron-fp8's default."""
    path = DATA / rel
    raw = resolve(compose_file(path))
    loaded = load_config_report(path)
    typed = loaded.config.to_dict()
    given = 0
    for key in EXPERIMENT_KEYS:
        want = _get(raw, key)
        assert key not in loaded.no_effect, key
        if want is KeyError:
            continue
        given += 1
        got = _get(typed, key)
        assert got == want or (isinstance(want, float) and got == pytest.approx(want, rel=1e-12)), (key, got, want)
    steps = _get(raw, "grpo.max_num_steps")
    if steps is not KeyError:
        assert loaded.config.grpo.max_num_steps == steps
    assert given >= 20, given  # the files set most of them (through grpo_math_1B.yaml)
