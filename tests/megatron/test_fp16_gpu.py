"""``policy.precision: float16`` on a GPU: an FP16 Megatron-Core model, Megatron-Core's FP16 optimizer with its
dynamic loss scale, the loss scaled through the model config's ``grad_scale_func`` (gpu-marked: CUDA + TE)."""

from __future__ import annotations

import pytest
import torch

from bridge_mappings.adapter import transformer_engine_available
from megatron_fp8.models import tiny_model_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.megatron,
    pytest.mark.skipif(
        not transformer_engine_available(),
        reason="needs TransformerEngine with CUDA (the image from `make image`)",
    ),
]

IDS = torch.tensor([[1, 5, 9, 14, 20, 33, 40, 41] * 16])


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_fp16_model_trains_with_megatrons_fp16_optimizer(recipe):
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.utils import get_model_config

    from megatron_fp8.megatron import build_megatron_model, make_optimizer, megatron_parallel, train_step
    from megatron_fp8.megatron.optim import LossScaleConfig
    from megatron_fp8.recipes.capability import check
    from megatron_fp8.recipes.registry import get_recipe

    if not check(get_recipe(recipe)).supported:
        pytest.skip(f"needs a GPU/CUDA/TE that runs {recipe} (see `megatron-fp8 doctor`)")
    ids = IDS.cuda()
    with megatron_parallel():
        m = build_megatron_model(tiny_model_path("tiny"), recipe=recipe, dtype=torch.float16)
        assert m.provider.fp16 and not m.provider.bf16 and m.provider.params_dtype == torch.float16
        assert all(p.dtype == torch.float16 for p in m.model[0].parameters())
        optimizer = make_optimizer(m, lr=1e-3, loss_scale=LossScaleConfig(initial_scale=2.0**32))
        inner = getattr(optimizer, "chained_optimizers", [optimizer])[0]  # get_megatron_optimizer chains them
        scaler = inner.grad_scaler
        assert isinstance(scaler, DynamicGradScaler) and float(scaler.scale) == 2.0**32
        assert get_model_config(m.model[0]).grad_scale_func == optimizer.scale_loss
        results = [train_step(m, optimizer, lambda lp: -lp.mean(), ids) for _ in range(40)]
        skipped = sum(not r.update_successful for r in results)
        assert 0 < skipped < 40, skipped  # 2**32 overflows first, then the scale settles and the steps apply
        assert float(scaler.scale) < 2.0**32
        assert all(torch.isfinite(p).all() for p in m.model[0].parameters())
