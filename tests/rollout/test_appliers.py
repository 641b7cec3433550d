"""Post-refit verification catches what a 'successful' refit left wrong (planted faults); the rollout path
refuses to generate while its applier serves no good version."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from bridge_mappings.manifest import Fingerprint, Manifest
from bridge_mappings.quantized_export import quantized_stream
from megatron_fp8.errors import EngineNotServingError, RefitError
from megatron_fp8.models import tiny_model_path
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.rollout.engines import ReferenceRolloutEngine
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


def test_rollout_path_refuses_to_generate_while_not_serving_until_a_clean_version_commits():
    """A refit fails after its first write and its rollback fails too (an injected device error in the
    restore): the reference applier reports not serving and the rollout path refuses to generate."""
    path = tiny_model_path("tiny")
    rollout = ReferenceRolloutEngine(path, quantization_config=QCFG, fp8_names=None)
    engine, applier = rollout.engine, rollout.applier
    weights = load_file(str(path / "model.safetensors"))
    fp8 = tuple(sorted(engine.fp8_names))
    manifest = Manifest(
        "test", Fingerprint("x", "0", "{}", 0, 0), fp8, tuple(sorted(set(weights) - set(fp8))), (), QCFG
    )
    refit = ColocatedRefit(applier, timeout=30)
    args = dict(max_new_tokens=5, temperature=0.0, seed=0, eos_token_id=-1)
    before = rollout.generate(PROMPT, **args)
    real_commit, real_restore = engine.commit, engine.restore

    def commit_then_fail(staged):
        real_commit(staged)
        raise RuntimeError("device error after the first write")

    def restore_failing_halfway(snap):
        first = next(iter(snap.tensors))
        engine._tensors[first].copy_(snap.tensors[first])
        raise RuntimeError("device error during restore")

    engine.commit, engine.restore = commit_then_fail, restore_failing_halfway
    with pytest.raises(EngineNotServingError, match="restoring version 0 failed too.*device error during restore"):
        refit.refit(quantized_stream(_perturbed(weights, 1).items(), manifest))
    assert not applier.serving and applier.serving_version == 0
    with pytest.raises(EngineNotServingError, match=r"reference-fp8 refuses to generate.*device error after the first"):
        rollout.generate(PROMPT, **args)
    engine.commit, engine.restore = real_commit, real_restore
    refit.refit(quantized_stream(weights.items(), manifest))  # a clean version: the checkpoint's weights again
    assert applier.serving and applier.serving_version == 2
    after = rollout.generate(PROMPT, **args)
    assert after.token_ids == before.token_ids
    assert all(torch.equal(a, b) for a, b in zip(after.logprobs, before.logprobs, strict=True))
    refit.close()
