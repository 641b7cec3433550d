"""FP8 recipes really running in FP8 through TransformerEngine (gpu-marked: Hopper + TE, the container)."""

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

IDS = torch.tensor([[1, 5, 9, 14, 20, 33, 40, 41] * 16])  # 128 tokens: blockwise pads sequences to 128


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_recipe_runs_in_fp8_and_stays_close_to_bf16(recipe):
    from megatron_fp8.megatron import (
        build_megatron_model,
        forward_logits,
        make_optimizer,
        megatron_parallel,
        train_step,
    )
    from megatron_fp8.megatron.step import token_logprobs
    from megatron_fp8.recipes.capability import check
    from megatron_fp8.recipes.registry import get_recipe

    if not check(get_recipe(recipe)).supported:
        pytest.skip(f"needs a GPU/CUDA/TE that runs {recipe} (see `megatron-fp8 doctor`)")
    path = tiny_model_path("tiny")
    ids = IDS.cuda()
    with megatron_parallel():
        ref = forward_logits(build_megatron_model(path, recipe="bf16"), ids)
        m = build_megatron_model(path, recipe=recipe)
        assert m.recipe_application.math == "fp8"
        out = forward_logits(m, ids)
        rel = float((out - ref).norm() / ref.norm())
        assert 0 < rel < 0.1  # FP8 GEMMs: different from BF16, but by FP8 rounding only
        opt = make_optimizer(m, lr=1e-3)
        before = -token_logprobs(m, ids).mean().item()
        for _ in range(3):
            res = train_step(m, opt, lambda lp: -lp.mean(), ids)
            assert res.update_successful
        assert -token_logprobs(m, ids).mean().item() < before


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_packed_sequences_through_te_attention_equal_padded_rows(recipe):
    """Issue 54 on the container: a packed micro-batch goes through TransformerEngine's THD attention (``cu_seqlens``,
    no mask) and gives the padded rows' log-probabilities to BF16 / FP8 rounding (the CPU test of the same path, with
    the local attention: ``tests/megatron/test_microbatch.py``)."""
    from megatron_fp8.megatron import build_megatron_model, megatron_parallel
    from megatron_fp8.megatron.microbatch import BatchLayout
    from megatron_fp8.megatron.step import sequence_logprobs
    from megatron_fp8.recipes.capability import check
    from megatron_fp8.recipes.registry import get_recipe

    if not check(get_recipe(recipe)).supported:
        pytest.skip(f"needs a GPU/CUDA/TE that runs {recipe} (see `megatron-fp8 doctor`)")
    lengths = [96, 40, 128, 17, 64]
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(4, 300, (n,), generator=g)
        mask[i, :n] = 1
    real = mask[:, 1:].bool()
    with megatron_parallel(), torch.no_grad():
        m = build_megatron_model(tiny_model_path("tiny"), recipe=recipe)
        padded = sequence_logprobs(m, ids.cuda(), attention_mask=mask.cuda())
        packed = sequence_logprobs(
            m, ids.cuda(), attention_mask=mask.cuda(), layout=BatchLayout(kind="packed", tokens=256, round_to=16)
        )
    diff = (packed - padded)[real.cuda()].abs()
    assert float(diff.mean()) < 0.05 and float(diff.max()) < 0.5  # BF16/FP8 GEMMs over other shapes, not a leak
