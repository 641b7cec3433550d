"""Post-refit verification catches what a 'successful' refit left wrong (planted faults)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from bridge_mappings.manifest import Fingerprint, Manifest
from bridge_mappings.quantized_export import quantized_stream
from megatron_fp8.errors import RefitError
from megatron_fp8.models import tiny_model_path
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.rollout.reference.applier import ReferenceEngineApplier
from megatron_fp8.rollout.reference.engine import ReferenceFP8Engine

QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
TARGET = "model.layers.1.mlp.down_proj.weight"
PROMPT = [[5, 17, 33, 40, 2]]


@pytest.fixture()
def setup():
    path = tiny_model_path("tiny")
    weights = load_file(str(path / "model.safetensors"))
    engine = ReferenceFP8Engine.from_hf_checkpoint(path, quantization=QCFG)
    fp8 = tuple(sorted(engine.fp8_names))
    manifest = Manifest(
        "test", Fingerprint("x", "0", "{}", 0, 0), fp8, tuple(sorted(set(weights) - set(fp8))), (), QCFG
    )
    applier = ReferenceEngineApplier(engine)
    return engine, applier, ColocatedRefit(applier, timeout=30), weights, manifest


def _perturbed(weights, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        n: (t.float() + 0.3 * t.float().std() * torch.randn(t.shape, generator=g)).to(t.dtype)
        for n, t in weights.items()
    }


def test_planted_stale_scale_is_caught(setup):
    engine, applier, refit, weights, manifest = setup
    refit.refit(quantized_stream(_perturbed(weights, 1).items(), manifest))
    real_commit = engine.commit

    def commit_leaving_one_scale_stale(staged):
        old = engine._tensors[TARGET + "_scale_inv"].clone()
        out = real_commit(staged)
        engine._tensors[TARGET + "_scale_inv"].copy_(old)  # the bug: this scale kept its previous version
        return out

    engine.commit = commit_leaving_one_scale_stale
    with pytest.raises(RefitError, match=rf"{TARGET}_scale_inv: the engine holds a different \(stale\) scale"):
        refit.refit(quantized_stream(_perturbed(weights, 2).items(), manifest))
    assert applier.serving_version == 1  # the unverified version is never reported as served


def test_planted_zero_scale_is_caught_after_commit(setup):
    engine, applier, refit, weights, manifest = setup
    real_commit = engine.commit

    def commit_zeroing_a_scale(staged):
        out = real_commit(staged)
        engine._tensors[TARGET + "_scale_inv"].zero_()  # the bug: a scale lost on the way in
        return out

    engine.commit = commit_zeroing_a_scale
    with pytest.raises(RefitError, match=rf"{TARGET}_scale_inv: zero, negative or non-finite scale"):
        refit.refit(quantized_stream(weights.items(), manifest))


def test_zero_scale_in_the_stream_is_refused_before_anything_changes(setup):
    engine, applier, refit, weights, manifest = setup
    refit.refit(quantized_stream(weights.items(), manifest))
    before = engine.generate(PROMPT, max_new_tokens=6).token_ids
    snapshot = {n: t.clone() for n, t in engine.named_weights()}
    items = dict(quantized_stream(_perturbed(weights, 3).items(), manifest))
    items[TARGET + "_scale_inv"] = torch.zeros_like(items[TARGET + "_scale_inv"])
    with pytest.raises(RefitError, match=TARGET):
        refit.refit(items.items())
    for n, t in engine.named_weights():
        same = (
            torch.equal(t.view(torch.uint8), snapshot[n].view(torch.uint8))
            if t.dtype == torch.float8_e4m3fn
            else (torch.equal(t, snapshot[n]))
        )
        assert same, n
    assert engine.generate(PROMPT, max_new_tokens=6).token_ids == before
    assert applier.serving_version == 1
