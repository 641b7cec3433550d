"""``megatron-fp8 grpo policy.precision=float16``: the key acts (it used to run as if unset, with a warning).

On a CPU the trainer computes in float32 with its weights rounded to FP16 and Megatron-Core's dynamic loss scale
(``fp32 (fp16 weights)``); the run log's build line, ``metrics.jsonl`` and ``summary.md`` say so. With Megatron-Core's
initial loss scale (2**32, NeMo-RL sets none) the first steps overflow and are skipped, as on a GPU.
"""

from __future__ import annotations

import json

import _warm_cli
import torch

from megatron_fp8.recipes.precision import math_label, precision_sentence


def test_grpo_trains_fp16(tmp_path):
    has_gpu = torch.cuda.is_available()
    label = "fp8 (fp16 weights)" if has_gpu else math_label("bf16-emulated", "float32", rounded="float16")
    sentence = precision_sentence(recipe="blockwise", label=label)
    out = tmp_path / "run"
    run = _warm_cli.run(
        ["grpo", "--steps", "2", "--arms", "fp8", "--no-progress", "--out", str(out), "policy.precision=float16"]
        + ["grpo.warm_start_steps=0", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2"],
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "policy.precision" not in run.stderr or "no effect" not in run.stderr  # no longer a no-effect key
    built = [line for line in run.stderr.splitlines() if "megatron.build: built " in line]
    assert built and all(line.endswith(f": {sentence}") for line in built), built
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["training_math"] == label for r in records)
    if not has_gpu:
        assert "FP16 emulated" in sentence
        assert "FP16: gradients overflow at loss scale 4.29497e+09; step skipped" in run.stderr
        assert records[0]["update_successful"] is False  # (a step whose advantages are all 0 has no gradient)
    assert f"| blockwise ({label}) |" in (out / "summary.md").read_text()


def test_refit_sends_an_fp16_trainer_as_the_bf16_engine_holds_it():
    """Non-FP8 tensors of an FP16 (or float32) trainer go out as BF16; the FP8 manifest's weights stay as the trainer
    holds them and are quantized from its FP16 values: the same bytes from a float32 trainer holding FP16 values
    (the CPU emulation) as from an FP16 one."""
    from megatron_fp8.quant.blockwise import quantize_blockwise
    from megatron_fp8.rl.driver.runtime import rollout_dtype_stream

    g = torch.Generator().manual_seed(0)
    w16 = (torch.randn(256, 384, generator=g) * 0.02).half()
    norm = torch.randn(384, generator=g).half()
    stream = [("q.weight", w16), ("norm.weight", norm), ("f32.weight", norm.float())]
    out = dict(rollout_dtype_stream(stream, keep={"q.weight"}))
    assert out["q.weight"] is w16 and out["norm.weight"].dtype == torch.bfloat16
    assert torch.equal(out["norm.weight"], norm.to(torch.bfloat16)) and out["f32.weight"].dtype == torch.bfloat16
    q16, s16 = quantize_blockwise(w16, backend="torch")
    q32, s32 = quantize_blockwise(w16.float(), backend="torch")
    assert torch.equal(q16.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(s16, s32)
    default = dict(rollout_dtype_stream(stream))  # the BF16 / float32 trainer's path is unchanged
    assert all(t.dtype == torch.bfloat16 for t in default.values())


def test_the_loss_scale_keys_reach_the_optimizer(tmp_path):
    """``policy.megatron_cfg.optimizer.initial_loss_scale`` (Megatron-Core's field, passed through by NeMo-RL): from
    2**10 the first step's gradients do not overflow, so it trains (where 2**32 skips it, above)."""
    out = tmp_path / "run"
    run = _warm_cli.run(
        ["grpo", "--steps", "1", "--arms", "fp8", "--no-progress", "--out", str(out), "policy.precision=float16"]
        + ["policy.megatron_cfg.optimizer.initial_loss_scale=1024", "policy.megatron_cfg.optimizer.hysteresis=1"]
        + ["grpo.warm_start_steps=0", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2"],
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "gradients overflow" not in run.stderr
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert record["update_successful"] is True and record["grad_norm"] > 0
    bad = _warm_cli.run(["config", "policy.megatron_cfg.optimizer.min_loss_scale=4096", "policy.precision=float16",
                         "policy.megatron_cfg.optimizer.initial_loss_scale=1024"], timeout=300)  # fmt: skip
    assert bad.returncode != 0 and "need 0 < min_loss_scale <= initial_loss_scale" in bad.stderr, bad.stderr[-2000:]
