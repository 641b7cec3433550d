"""Megatron-Core's activation recompute (``policy.megatron_cfg.activation_checkpointing``) on CPU.

Recompute changes memory, never the numbers: full and selective recompute give the losses and gradient norms of the
run without it, while the recomputed modules really run twice per training step (once in the forward, once in the
backward pass). On CPU this needs patch 4 of ``bridge_mappings._patches`` (no CUDA RNG state to save).
"""

from __future__ import annotations

import pytest
import torch

from megatron_fp8.config import load_config
from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron import build_megatron_model, make_optimizer, megatron_parallel, train_step
from megatron_fp8.megatron.build import RecomputeSettings
from megatron_fp8.models import tiny_model_path
from megatron_fp8.rl.driver.arm import recompute_settings

IDS = torch.randint(4, 360, (4, 12), generator=torch.Generator().manual_seed(1))


def _run(kind: str, recompute: RecomputeSettings | None, module: str) -> tuple[list[tuple[float, float]], int]:
    with megatron_parallel(seed=5):
        m = build_megatron_model(tiny_model_path(kind), dtype="fp32", recompute=recompute)
        calls = []
        target = dict(m.model[0].named_modules())[module]
        handle = target.register_forward_hook(lambda *_: calls.append(1))
        optimizer = make_optimizer(m, lr=1e-2)
        results = [train_step(m, optimizer, lambda lp: -lp.mean(), IDS) for _ in range(2)]
        handle.remove()
    return [(r.loss, r.grad_norm) for r in results], len(calls)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_full_recompute_reruns_every_layer_and_changes_no_number(kind):
    layer = "module.decoder.layers.0"
    plain, plain_calls = _run(kind, None, layer)
    full, full_calls = _run(kind, RecomputeSettings(granularity="full"), layer)
    assert full == plain
    assert (plain_calls, full_calls) == (2, 4)  # 2 steps: one forward each, plus one recompute each with "full"


def test_selective_recompute_reruns_core_attention_only():
    attention = "module.decoder.layers.0.self_attention.core_attention"
    plain, plain_calls = _run("dense", None, attention)
    selective, calls = _run("dense", RecomputeSettings(granularity="selective"), attention)
    assert selective == plain and (plain_calls, calls) == (2, 4)
    _, mlp_calls = _run("dense", RecomputeSettings(granularity="selective"), "module.decoder.layers.0.mlp")
    assert mlp_calls == 2  # not in recompute_modules


def test_nemo_rl_keys_reach_the_settings():
    assert recompute_settings(load_config(None, [])) is None
    cfg = load_config(None, ["policy.megatron_cfg.activation_checkpointing=true"])
    assert recompute_settings(cfg) == RecomputeSettings(granularity="full")
    cfg = load_config(
        None,
        [
            "policy.megatron_cfg.activation_checkpointing=true",
            "policy.megatron_cfg.recompute_granularity=selective",
            "policy.megatron_cfg.recompute_modules=[core_attn,mlp]",
        ],
    )
    assert recompute_settings(cfg) == RecomputeSettings(granularity="selective", modules=("core_attn", "mlp"))
    with pytest.raises(ConfigError, match="'full' or 'selective'"):
        RecomputeSettings(granularity="block")
