"""The FP8 report's four experiments as shipped configs (issue 56), and NeMo-RL's own DAPO recipe: each is approved
by ``megatron-fp8 config`` with its data staged, at the GPU count it is written for, with its DAPO keys acting."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_fp8.config import load_config
from megatron_fp8.config.loader import load_config_report
from megatron_fp8.config.refusals import refuse_before_run
from megatron_fp8.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
NEMO_RL = Path(__file__).parent / "data" / "nemo_rl" / "examples" / "configs"
DAPO_KEYS = (
    "grpo.use_dynamic_sampling",
    "grpo.batch_multiplier",
    "grpo.dynamic_sampling_max_gen_batches",
    "grpo.reward_scaling",
    "grpo.reward_shaping",
    "grpo.overlong_filtering",
    "loss_fn.ratio_clip_c",
    "loss_fn.ratio_clip_max",
    "policy.precision",
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """DAPO-Math-17k-shaped training rows (``prompt[0].content``, ``reward_model.ground_truth``) and AIME-2024-shaped
    validation rows (``problem``, ``answer``), where the configs read them (``DATA_DIR``)."""
    root = tmp_path_factory.mktemp("data")
    (root / "dapo-math-17k").mkdir()
    (root / "aime24").mkdir()
    train = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": f"Solve: what is {i} + {i}?\n\nAnswer: $Answer"}],
            "reward_model": {"ground_truth": str(2 * i), "style": "rule-lax"},
        }
        for i in range(48)
    ]
    (root / "dapo-math-17k" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    val = [{"problem": f"What is {i} x 3?", "answer": str(3 * i)} for i in range(30)]
    (root / "aime24" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val))
    return root


REPORT = {  # config -> (GPUs, what it must set)
    "dapo_qwen3_8b_base_fp8_rollout.yaml": (8, {"arms": ("bf16", "fp8", "fp8_tis"), "kv": "auto", "precision": "bfloat16"}),
    "dapo_qwen3_8b_base_fp8_kv.yaml": (8, {"arms": ("fp8_tis",), "kv": "fp8", "precision": "bfloat16"}),
    "dapo_qwen3_30b_a3b_fp8_rollout.yaml": (16, {"arms": ("bf16", "fp8_tis"), "kv": "auto", "precision": "bfloat16"}),
    "dapo_qwen3_30b_a3b_fp16_fp8_rollout.yaml": (16, {"arms": ("fp8", "fp8_tis"), "kv": "auto", "precision": "float16"}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REPORT))
def test_each_report_config_is_approved_by_config_with_its_dapo_keys(name, data_dir, warm_cli, monkeypatch):
    gpus, want = REPORT[name]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MFP8_ROLE", "ROLLOUT_TASKS")}
    env |= {"DATA_DIR": str(data_dir), "WORLD_SIZE": str(gpus)}
    proc = warm_cli.run(["config", "--config", f"configs/{name}"], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "approved: every check" in proc.stdout and "# memory plan per GPU by phase" in proc.stdout
    assert ": fits" in proc.stdout and "EXCEEDS" not in proc.stdout
    assert "data: 78 rows read and checked" in proc.stdout
    assert "# dynamic sampling: generation rounds of 96 prompts x 16 = 1536 samples until 32 x 16 = 512" in proc.stdout
    monkeypatch.setenv("DATA_DIR", str(data_dir))  # the file's ${oc.env:DATA_DIR,data}
    cfg = load_config(REPO / "configs" / name)
    g = cfg.grpo
    assert g.use_dynamic_sampling and g.batch_multiplier == 3 and g.round_prompts == 96  # 32 x 3 prompts a round
    assert g.num_prompts_per_step * g.num_generations_per_prompt == 512 and cfg.policy.train_global_batch_size == 512
    assert g.reward_shaping.enabled and g.reward_shaping.max_response_length == cfg.policy.generation.max_new_tokens
    assert cfg.policy.generation.max_new_tokens == 20480 and cfg.loss_fn.is_cap == 2.0
    assert (cfg.loss_fn.ratio_clip_min, cfg.loss_fn.ratio_clip_max) == (0.2, 0.28)  # clip-higher
    assert g.arms == want["arms"] and cfg.policy.generation.vllm_cfg.precision == "fp8"
    assert cfg.policy.generation.vllm_cfg.kv_cache_dtype == want["kv"] and cfg.policy.precision == want["precision"]
    assert cfg.data.train.input_key == "prompt[0].content" and cfg.data.train.output_key == "reward_model.ground_truth"
    if want["precision"] == "float16":  # a first scale FP16 gradients do not overflow at once
        assert cfg.policy.megatron_cfg.optimizer.initial_loss_scale == 2.0**16
    if "30b" in name:  # the report's rollout at TP 1 / EP 1: one whole engine per GPU
        assert cfg.model.is_moe and cfg.policy.generation.vllm_cfg.tensor_parallel_size == 1


def test_nemo_rls_dapo_recipe_loads_with_its_dapo_keys_acting(data_dir):
    """NeMo-RL's ``dapo-qwen2.5-7b.v2.yaml`` (written for its DTensor trainer, so Megatron is switched on) with its
    DAPOMath17K / DAPOMathAIME2024 rows staged: every DAPO key acts; the run is refused only for its context and
    sequence parallelism, which the refusal names."""
    rows = str(data_dir / "dapo-math-17k" / "train.jsonl")
    overrides = [
        f"data.train.data_path={rows}",
        f"data.validation.data_path={rows}",  # DAPOMathAIME2024 has DAPO-Math-17k's columns
        "policy.megatron_cfg.enabled=true",
    ]
    loaded = load_config_report(NEMO_RL / "recipes" / "llm" / "dapo-qwen2.5-7b.v2.yaml", overrides)
    cfg, no_effect = loaded.config, loaded.no_effect
    assert not [k for k in no_effect if k.startswith(DAPO_KEYS)], sorted(no_effect)
    g = cfg.grpo
    assert g.use_dynamic_sampling and g.batch_multiplier == 3 and g.round_prompts == 512 * 3
    assert g.dynamic_sampling_max_gen_batches == 10  # grpo_math_1B.yaml's value, inherited
    assert g.reward_scaling.enabled and g.reward_scaling.target_min == -1.0
    assert g.reward_shaping.enabled and g.reward_shaping.overlong_buffer_length == 2048
    assert g.reward_shaping.max_response_length == 14336
    assert cfg.loss_fn.ratio_clip_c == 10 and cfg.loss_fn.ratio_clip_max == 0.28
    assert cfg.data.train.input_key == "prompt[0].content"
    with pytest.raises(ConfigError) as refused:
        refuse_before_run(cfg, no_effect)
    message = str(refused.value)
    assert (
        "policy.megatron_cfg.context_parallel_size=2" in message
        and "policy.megatron_cfg.sequence_parallel=True" in message
    )
    assert "use_dynamic_sampling" not in message and "batch_multiplier" not in message
