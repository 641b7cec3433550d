"""``policy.precision: float16`` in the trainer: Megatron-Core's dynamic loss scale and FP16 weights on CPU.

The CPU trainer computes in float32; FP16 is emulated as :mod:`megatron_fp8.megatron.optim` says (FP16-rounded
weights, the loss scaled through the model config's ``grad_scale_func`` before Megatron-Core's backward, a scaled
gradient beyond FP16's range skips the step and backs the scale off). The scaler's rule is checked against
Megatron-Core's own ``DynamicGradScaler`` (run with its ``device='cuda'`` allocations sent to the CPU).
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron import build_megatron_model, make_optimizer, megatron_parallel, train_step
from megatron_fp8.megatron.optim import AdamConfig, DynamicLossScaler, LossScaleConfig, MegatronDDPAdam
from megatron_fp8.megatron.step import megatron_optimizer_fields
from megatron_fp8.models import tiny_model_path

IDS = torch.randint(4, 360, (2, 16), generator=torch.Generator().manual_seed(0))


def _loss(lp: torch.Tensor) -> torch.Tensor:
    return -lp.mean()


@pytest.fixture(scope="module")
def parallel():
    with megatron_parallel() as state:
        yield state


def _fp16_model():
    return build_megatron_model(tiny_model_path("dense"), dtype="fp32", round_to=torch.float16)


def _weights(m) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.model[0].parameters()]


def _megatron_scaler(monkeypatch, **kwargs):
    """Megatron-Core's ``DynamicGradScaler`` with its ``torch.tensor(..., device='cuda')`` made on the CPU."""
    from megatron.core.optimizer import grad_scaler

    def tensor(*args, device=None, **kw):
        return torch.tensor(*args, **kw)

    shim = types.SimpleNamespace(tensor=tensor, float=torch.float, max=torch.max)
    monkeypatch.setattr(grad_scaler, "torch", shim)
    return grad_scaler.DynamicGradScaler(**kwargs)


@pytest.mark.parametrize("hysteresis,interval", [(2, 3), (1, 1), (3, 5)])
def test_scaler_follows_megatron_dynamic_grad_scaler(monkeypatch, hysteresis, interval):
    config = LossScaleConfig(initial_scale=2.0**20, min_scale=4.0, growth_interval=interval, hysteresis=hysteresis)
    ours = DynamicLossScaler(config)
    theirs = _megatron_scaler(
        monkeypatch,
        initial_scale=config.initial_scale,
        min_scale=config.min_scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=interval,
        hysteresis=hysteresis,
    )
    rng = random.Random(hysteresis * 100 + interval)
    pattern = [True] * 25 + [rng.random() < 0.4 for _ in range(200)] + [False] * 12
    for found_inf in pattern:
        ours.update(found_inf)
        theirs.update(found_inf)
        assert torch.equal(ours.scale, theirs.scale)
        assert ours.state_dict()["growth_tracker"] == theirs.state_dict()["growth_tracker"]
        assert ours.state_dict()["hysteresis_tracker"] == theirs.state_dict()["hysteresis_tracker"]
        assert torch.equal(ours.inv_scale, theirs.inv_scale)
    assert ours.skipped_steps == sum(pattern)
    restored = DynamicLossScaler(config)
    restored.load_state_dict(ours.state_dict())
    assert torch.equal(restored.scale, ours.scale) and restored.skipped_steps == ours.skipped_steps
    assert restored.state_dict()["hysteresis_tracker"] == ours.state_dict()["hysteresis_tracker"]


def test_loss_scale_settings_are_checked():
    with pytest.raises(ConfigError, match="min_scale"):
        LossScaleConfig(initial_scale=1.0, min_scale=2.0)
    with pytest.raises(ConfigError, match="hysteresis"):
        LossScaleConfig(hysteresis=0)


def test_megatron_optimizer_config_fields():
    """What the GPU path hands Megatron-Core's ``OptimizerConfig``: FP16 with the dynamic scaler's settings; BF16 and
    float32 as before (no loss-scale fields)."""
    from megatron.core.optimizer import OptimizerConfig

    config = AdamConfig(lr=1e-5, clip_grad=1.0, fp16=True)
    fp16 = megatron_optimizer_fields(config, torch.float16)
    assert fp16["fp16"] is True and fp16["bf16"] is False and fp16["params_dtype"] == torch.float16
    assert fp16["loss_scale"] is None  # dynamic: get_megatron_optimizer builds its DynamicGradScaler
    assert (fp16["initial_loss_scale"], fp16["min_loss_scale"]) == (2.0**32, 1.0)
    assert (fp16["loss_scale_window"], fp16["hysteresis"]) == (1000, 2)
    built = OptimizerConfig(**fp16)
    assert built.fp16 and not built.bf16 and built.initial_loss_scale == 2.0**32
    bf16 = megatron_optimizer_fields(AdamConfig(lr=1e-5), torch.bfloat16)
    assert bf16["bf16"] is True and "fp16" not in bf16 and "loss_scale" not in bf16
    fp32 = megatron_optimizer_fields(AdamConfig(lr=1e-5), torch.float32)
    assert fp32["bf16"] is False and "fp16" not in fp32
    assert not OptimizerConfig(**fp32).fp16
    with pytest.raises(ConfigError, match="by 2"):
        megatron_optimizer_fields(AdamConfig(lr=1e-5, loss_scale=LossScaleConfig(growth_factor=4.0)), torch.float16)


def test_fp16_model_weights_are_fp16_values_and_the_loss_is_scaled(parallel):
    from megatron.core.utils import get_model_config

    m = _fp16_model()
    assert m.round_to == torch.float16 and m.dtype == torch.float32
    assert all(torch.equal(p, p.half().float()) for p in m.model[0].parameters())
    optimizer = make_optimizer(m, lr=1e-3, loss_scale=LossScaleConfig(initial_scale=256.0, growth_interval=2))
    assert isinstance(optimizer, MegatronDDPAdam) and optimizer.loss_scaler is not None
    assert get_model_config(m.model[0]).grad_scale_func == optimizer.scale_loss
    before = _weights(m)
    results = [train_step(m, optimizer, _loss, IDS) for _ in range(2)]
    assert all(r.update_successful for r in results)
    assert all(torch.equal(p, p.half().float()) for p in m.model[0].parameters())  # rounded after every update
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(m), strict=True))
    assert float(optimizer.get_loss_scale()) == 512.0  # grew after growth_interval=2 clean steps
    # the main copies stay float32 (not rounded)
    assert any(not torch.equal(main, main.half().float()) for _, main in optimizer._pairs)


def test_default_precision_sets_no_grad_scale_func(parallel):
    from megatron.core.utils import get_model_config

    m = build_megatron_model(tiny_model_path("dense"), dtype="fp32")
    optimizer = make_optimizer(m, lr=1e-3)
    assert m.round_to is None and getattr(optimizer, "loss_scaler", None) is None
    assert get_model_config(m.model[0]).grad_scale_func is None


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_overflow_skips_the_step_and_backs_the_scale_off(parallel, caplog, hysteresis):
    """A scale no FP16 backward survives: every step is skipped, the weights stay, the scale halves once the
    hysteresis is used up (Megatron's rule); then a clean step updates."""
    m = _fp16_model()
    optimizer = make_optimizer(m, lr=1e-3, loss_scale=LossScaleConfig(initial_scale=2.0**60, hysteresis=hysteresis))
    before = _weights(m)
    scales = []
    for _ in range(3):
        result = train_step(m, optimizer, _loss, IDS)
        assert not result.update_successful
        scales.append(float(optimizer.get_loss_scale()))
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(m), strict=True))
    expected = [2.0**60 if hysteresis == 2 else 2.0**59, 2.0**59 if hysteresis == 2 else 2.0**58]
    assert scales[:2] == expected and scales[2] == scales[1] / 2
    assert optimizer.loss_scaler.skipped_steps == 3
    assert "step skipped" in caplog.text and "loss scale" in caplog.text
    optimizer.loss_scaler.load_state_dict(optimizer.loss_scaler.state_dict() | {"scale": torch.tensor([64.0])})
    assert train_step(m, optimizer, _loss, IDS).update_successful


def test_resume_equals_uninterrupted(parallel):
    """The optimizer state carries the loss scaler: 1 step + save + load + 2 steps == 3 steps."""
    config = LossScaleConfig(initial_scale=2.0**16, hysteresis=1, growth_interval=1)
    m = _fp16_model()
    optimizer = make_optimizer(m, lr=1e-3, loss_scale=config)
    straight = [train_step(m, optimizer, _loss, IDS).update_successful for _ in range(3)]
    first = _fp16_model()
    opt1 = make_optimizer(first, lr=1e-3, loss_scale=config)
    resumed = [train_step(first, opt1, _loss, IDS).update_successful]
    state = opt1.state_dict()
    assert "loss_scaler" in state
    second = _fp16_model()
    opt2 = make_optimizer(second, lr=1e-3, loss_scale=config)
    opt2.load_state_dict(state)
    resumed += [train_step(second, opt2, _loss, IDS).update_successful for _ in range(2)]
    assert resumed == straight and True in straight
    assert torch.equal(opt2.get_loss_scale(), optimizer.get_loss_scale())
    assert all(torch.equal(a, b) for a, b in zip(_weights(m), _weights(second), strict=True))
    plain = make_optimizer(build_megatron_model(tiny_model_path("dense"), dtype="fp32"), lr=1e-3)
    with pytest.raises(ConfigError, match="policy.precision"):
        opt2.load_state_dict(plain.state_dict())


def test_distributed_fp16_on_cpu_is_refused(parallel):
    m = build_megatron_model(tiny_model_path("dense"), dtype="fp32", round_to=torch.float16)
    with pytest.raises(ConfigError, match="policy.precision.*use_distributed_optimizer"):
        make_optimizer(m, lr=1e-3, distributed=True)
