"""Tests of the reference FP8 engine (CPU emulator and oracle of vLLM's W8A8 blockwise numerics)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megatron_fp8.errors import ConfigError, ManifestError, QuantInputError, RefitError, WeightStreamError
from megatron_fp8.quant import dequantize_blockwise, quantize_blockwise, quantize_per_token_group
from megatron_fp8.rollout.reference.engine import ReferenceFP8Engine
from megatron_fp8.rollout.reference.linear import bf16_linear, w8a8_block_fp8_linear, w8a8_block_fp8_matmul
from megatron_fp8.vocab import SCALE_SUFFIX

FP8_QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "ignored_layers": [],
}
PROMPTS = [[5, 17, 42, 99, 3, 250, 77], [11, 300, 12], [200, 201, 202, 9, 8]]


def _build_in_test(kind: str, folder: Path) -> Path:
    common = dict(
        vocab_size=384,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        initializer_range=0.05,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    if kind == "tiny":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        cfg = transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def _checkpoint(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        from megatron_fp8.models import tiny_model_path  # lazy: fall back to building the model here
    except ImportError:
        return _build_in_test(kind, tmp_path_factory.mktemp(kind))
    return tiny_model_path(kind, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint("tiny", tmp_path_factory)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint("tiny-moe", tmp_path_factory)


@pytest.fixture(scope="module")
def fp8_engine(dense_path: Path) -> ReferenceFP8Engine:
    return ReferenceFP8Engine.from_hf_checkpoint(dense_path, quantization=FP8_QUANT)


def _hf_model(path: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    return model.eval()


def _prefill_logits(engine: ReferenceFP8Engine, ids: list[list[int]]) -> torch.Tensor:
    hidden, _ = engine.model.prefill(ids, max(map(len, ids)))
    return engine.model.logits(hidden).float()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (dtype included), for FP8 and float tensors of any rank."""
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _bf16_stream(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


# ---------------------------------------------------------------------------- the W8A8 linear


def _float64_block_formula(qa, sa, qw, sw, bn=128, bk=128) -> torch.Tensor:
    m, k = qa.shape
    n = qw.shape[0]
    out = torch.zeros((m, n), dtype=torch.float64)
    for kb in range(k // bk):
        part = qa[:, kb * bk : (kb + 1) * bk].double() @ qw[:, kb * bk : (kb + 1) * bk].double().t()
        sw_n = sw[:, kb].double().repeat_interleave(bn)[:n]
        out += part * sa[:, kb].double()[:, None] * sw_n[None, :]
    return out


def test_w8a8_linear_equals_float64_block_formula_and_differs_from_bf16_by_fp8_error():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 384, generator=g) * torch.linspace(0.1, 4, 384)).to(torch.bfloat16)
    w = torch.randn(200, 384, generator=g).to(torch.bfloat16)  # N=200: a partial edge block along N
    qw, sw = quantize_blockwise(w)
    qa, sa = quantize_per_token_group(x)
    ref = _float64_block_formula(qa, sa, qw, sw)
    ours32 = w8a8_block_fp8_matmul(qa, sa, qw, sw, out_dtype=torch.float32)
    magnitude = _float64_block_formula(qa.float().abs().to(qa.dtype), sa, qw.float().abs().to(qw.dtype), sw)
    assert torch.all((ours32.double() - ref).abs() <= 4e-7 * magnitude + 1e-30)
    ours = w8a8_block_fp8_linear(x, qw, sw, name="w")
    assert ours.dtype == torch.bfloat16 and ours.shape == (7, 200)
    assert torch.equal(ours, ours32.to(torch.bfloat16))
    exact = x.double() @ w.double().t()
    rel_fp8 = float((ours.double() - exact).norm() / exact.norm())
    rel_bf16 = float((bf16_linear(x, w).double() - exact).norm() / exact.norm())
    assert rel_bf16 < 5e-3 < rel_fp8 < 0.1


def test_w8a8_matmul_is_batch_invariant_and_matches_rowwise_scaled_mm_per_block():
    g = torch.Generator().manual_seed(1)
    qa, sa = quantize_per_token_group(torch.randn(6, 256, generator=g))
    qw, sw = quantize_blockwise(torch.randn(384, 256, generator=g))
    full = w8a8_block_fp8_matmul(qa, sa, qw, sw, out_dtype=torch.float32)
    rows = torch.cat(
        [w8a8_block_fp8_matmul(qa[i : i + 1], sa[i : i + 1], qw, sw, out_dtype=torch.float32) for i in range(6)]
    )
    assert torch.equal(full, rows)
    sw_rows = sw.repeat_interleave(128, dim=0)
    acc = torch.zeros_like(full)  # rowwise _scaled_mm runs on CPU with the pinned torch 2.13
    for kb in range(2):
        cols = slice(kb * 128, (kb + 1) * 128)
        acc += torch._scaled_mm(
            qa[:, cols].contiguous(),
            qw[:, cols].contiguous().t(),
            scale_a=sa[:, kb : kb + 1].contiguous(),
            scale_b=sw_rows[:, kb][None, :].contiguous(),
            out_dtype=torch.float32,
        )
    assert torch.allclose(acc, full, rtol=1e-5, atol=1e-4 * float(full.abs().max()))


def test_blockwise_scaled_mm_is_not_available_on_cpu_which_is_why_we_emulate():
    a = torch.zeros(4, 256).to(torch.float8_e4m3fn)
    b = torch.zeros(256, 256).to(torch.float8_e4m3fn)
    with pytest.raises((RuntimeError, ValueError)):
        torch._scaled_mm(a, b.t(), scale_a=torch.ones(4, 2), scale_b=torch.ones(2, 2), out_dtype=torch.bfloat16)


def test_w8a8_linear_rejects_bad_operands_naming_the_weight():
    qw, sw = quantize_blockwise(torch.randn(128, 200))
    with pytest.raises(QuantInputError, match="layer.w.*multiple of block_k"):
        w8a8_block_fp8_linear(torch.randn(2, 200).bfloat16(), qw, sw, name="layer.w")
    qw, sw = quantize_blockwise(torch.randn(128, 256))
    with pytest.raises(QuantInputError, match=r"layer.w.*\(1, 2\)"):
        w8a8_block_fp8_linear(torch.randn(2, 256).bfloat16(), qw, sw[:, :1].contiguous(), name="layer.w")


# ---------------------------------------------------------------------------- BF16 parity with transformers


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bf16_engine_logits_match_transformers(kind, dense_path, moe_path):
    path = dense_path if kind == "dense" else moe_path
    engine = ReferenceFP8Engine.from_hf_checkpoint(path)
    assert engine.fp8_names == frozenset()
    hf = _hf_model(path)
    ids = PROMPTS[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.float()[0]
    ours = _prefill_logits(engine, [ids])[0]
    scale = float(ref.abs().max())
    assert float((ours - ref).abs().max()) < 0.03 * scale
    assert float((ours - ref).abs().mean()) < 0.004 * scale
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * scale
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_tied_embeddings_and_batching_match_transformers(tmp_path):
    cfg = transformers.Qwen3Config(
        vocab_size=384,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        initializer_range=0.05,
    )
    torch.manual_seed(7)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    engine = ReferenceFP8Engine.from_hf_checkpoint(tmp_path)
    assert "lm_head.weight" not in dict(engine.named_weights())
    hf = _hf_model(tmp_path)
    batch = _prefill_logits(engine, PROMPTS)
    for j, ids in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits.float()[0]
        ours = batch[j, : len(ids)]
        assert torch.equal(ours, _prefill_logits(engine, [ids])[0])  # right padding changes nothing
        assert float((ours - ref).abs().max()) < 0.03 * float(ref.abs().max())


# ---------------------------------------------------------------------------- generation


def test_greedy_generation_is_deterministic_batch_independent_and_logprobs_equal_score(fp8_engine):
    res = fp8_engine.generate(PROMPTS, max_new_tokens=6)
    again = fp8_engine.generate(PROMPTS, max_new_tokens=6)
    assert again.token_ids == res.token_ids
    assert all(torch.equal(x, y) for x, y in zip(again.logprobs, res.logprobs, strict=True))
    assert res.finish_reasons == ("length",) * 3 and all(len(t) == 6 for t in res.token_ids)
    for j, ids in enumerate(PROMPTS):
        alone = fp8_engine.generate([ids], max_new_tokens=6)
        assert alone.token_ids[0] == res.token_ids[j]
        assert torch.equal(alone.logprobs[0], res.logprobs[j])
    scored = fp8_engine.score(
        [p + list(t) for p, t in zip(PROMPTS, res.token_ids, strict=True)], response_start=[len(p) for p in PROMPTS]
    )
    for got, want in zip(scored, res.logprobs, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert bool((want <= 0).all())


def test_sampling_is_reproducible_with_a_seed_and_top_p_limit_is_greedy(fp8_engine):
    a = fp8_engine.generate(PROMPTS, max_new_tokens=6, temperature=0.8, seed=11)
    b = fp8_engine.generate(PROMPTS, max_new_tokens=6, temperature=0.8, seed=11)
    c = fp8_engine.generate(PROMPTS, max_new_tokens=6, temperature=0.8, seed=12)
    assert a.token_ids == b.token_ids
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
    assert a.token_ids != c.token_ids
    scored = fp8_engine.score(
        [p + list(t) for p, t in zip(PROMPTS, a.token_ids, strict=True)],
        response_start=[len(p) for p in PROMPTS],
        temperature=0.8,
    )
    for got, want in zip(scored, a.logprobs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    narrow = fp8_engine.generate(PROMPTS, max_new_tokens=4, temperature=0.8, top_p=1e-6, seed=5)
    assert narrow.token_ids == fp8_engine.generate(PROMPTS, max_new_tokens=4).token_ids


def test_eos_finishes_a_sequence_and_is_kept(fp8_engine):
    greedy = fp8_engine.generate(PROMPTS, max_new_tokens=5)
    eos = greedy.token_ids[0][1]
    res = fp8_engine.generate(PROMPTS, max_new_tokens=5, eos_token_id=eos)
    first = greedy.token_ids[0].index(eos)
    assert res.token_ids[0] == greedy.token_ids[0][: first + 1]
    assert res.finish_reasons[0] == "stop"
    for j in (1, 2):
        cut = greedy.token_ids[j].index(eos) + 1 if eos in greedy.token_ids[j] else 5
        assert res.token_ids[j] == greedy.token_ids[j][:cut]


def test_generate_and_score_reject_bad_requests(dense_path):
    engine = ReferenceFP8Engine(json.loads((dense_path / "config.json").read_text()))
    with pytest.raises(ConfigError, match="never loaded"):
        engine.generate([[1, 2]], max_new_tokens=2)
    engine.load_weights(_bf16_stream(dense_path).items())
    with pytest.raises(ConfigError, match="outside"):
        engine.generate([[1, 10_000]], max_new_tokens=2)
    with pytest.raises(ConfigError, match="response_start"):
        engine.score([[1, 2, 3]], response_start=0)


# ---------------------------------------------------------------------------- weight loading / refit


def _fp8_stream(state: dict[str, torch.Tensor], fp8_names: frozenset[str]):
    for name, t in state.items():
        if name in fp8_names:
            q, s = quantize_blockwise(t)
            yield name, q
            yield name + SCALE_SUFFIX, s
        else:
            yield name, t


def test_bf16_weight_for_an_fp8_name_is_quantized_on_arrival(fp8_engine, dense_path):
    held = dict(fp8_engine.named_weights())
    name = "model.layers.0.mlp.down_proj.weight"
    q, s = quantize_blockwise(_bf16_stream(dense_path)[name])
    assert held[name].dtype == torch.float8_e4m3fn
    assert _same(held[name], q)
    assert torch.equal(held[name + SCALE_SUFFIX], s)


def test_bad_stream_raises_naming_the_tensor_and_changes_nothing(dense_path):
    engine = ReferenceFP8Engine.from_hf_checkpoint(dense_path, quantization=FP8_QUANT)
    before = engine.state_dict()
    state = _bf16_stream(dense_path)
    good = ("model.layers.0.input_layernorm.weight", state["model.layers.0.input_layernorm.weight"] * 2)
    q_name = "model.layers.1.self_attn.q_proj.weight"
    q, s = quantize_blockwise(state[q_name] * 3)
    cases = [
        (
            [good, ("model.layers.9.mlp.up_proj.weight", state["model.norm.weight"])],
            "model.layers.9.mlp.up_proj.weight",
        ),
        ([good, ("model.norm.weight", state["model.norm.weight"][:10])], r"expected shape \(256,\), got \(10,\)"),
        ([good, (q_name, q)], "without"),
        ([good, (q_name + SCALE_SUFFIX, s)], "without their weight"),
        ([good, (q_name, q), (q_name + SCALE_SUFFIX, s[:, :1])], r"float32 \(2, 2\)"),
        ([good, ("model.norm.weight", q[0])], "model.norm.weight"),
        ([good, ("model.embed_tokens.weight" + SCALE_SUFFIX, s)], "stale"),
        ([good, good], "twice"),
        ([good, ("model.layers.0.self_attn.attn.k_scale", torch.tensor(float("nan")))], "k_scale"),
    ]
    for items, pattern in cases:
        with pytest.raises(WeightStreamError, match=pattern):
            engine.load_weights(items)
        after = engine.state_dict()
        assert all(_same(before[n], after[n]) for n in before)
    assert engine.version == 1


def test_refit_updates_in_place_and_changes_generations(dense_path):
    engine = ReferenceFP8Engine.from_hf_checkpoint(dense_path, quantization=FP8_QUANT)
    ptrs = {n: t.data_ptr() for n, t in engine.named_weights()}
    before = engine.generate(PROMPTS, max_new_tokens=6)
    g = torch.Generator().manual_seed(3)
    state = {
        n: (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(torch.bfloat16) if t.dim() == 2 else t
        for n, t in _bf16_stream(dense_path).items()
    }
    sent = dict(_fp8_stream(state, engine.fp8_names))
    loaded = engine.load_weights(sent.items())
    assert loaded == frozenset(state)
    assert {n: t.data_ptr() for n, t in engine.named_weights()} == ptrs
    held = dict(engine.named_weights())
    for name, t in sent.items():
        assert _same(held[name], t.to(held[name].dtype)), name
    after = engine.generate(PROMPTS, max_new_tokens=6)
    assert after.token_ids != before.token_ids


def test_stage_abort_and_stale_commit(fp8_engine, dense_path):
    state = _bf16_stream(dense_path)
    before = fp8_engine.state_dict()
    staged = fp8_engine.stage([("model.norm.weight", state["model.norm.weight"] + 1)])
    fp8_engine.abort(staged)
    with pytest.raises(RefitError, match="aborted"):
        fp8_engine.commit(staged)
    assert torch.equal(fp8_engine.state_dict()["model.norm.weight"], before["model.norm.weight"])
    first = fp8_engine.stage([("model.norm.weight", state["model.norm.weight"])])
    second = fp8_engine.stage([("model.norm.weight", state["model.norm.weight"])])
    fp8_engine.commit(first)
    with pytest.raises(RefitError, match="stage again"):
        fp8_engine.commit(second)


def test_saved_fp8_checkpoint_reloads_to_an_identical_engine(dense_path, tmp_path):
    engine = ReferenceFP8Engine.from_hf_checkpoint(
        dense_path, quantization={**FP8_QUANT, "ignored_layers": ["model.layers.0.self_attn.qkv_proj"]}
    )
    assert "model.layers.0.self_attn.k_proj.weight" not in engine.fp8_names
    assert "model.layers.1.self_attn.k_proj.weight" in engine.fp8_names
    g = torch.Generator().manual_seed(9)
    state = {
        n: (t.float() * (1 + 0.1 * torch.randn(t.shape, generator=g))).to(torch.bfloat16)
        for n, t in _bf16_stream(dense_path).items()
    }
    engine.load_weights(_fp8_stream(state, engine.fp8_names))
    engine.load_weights([("model.layers.1.self_attn.attn.k_scale", torch.tensor(0.02))])
    folder = engine.save_fp8_checkpoint(tmp_path / "fp8")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    reloaded = ReferenceFP8Engine.from_hf_checkpoint(folder)
    assert reloaded.fp8_names == engine.fp8_names
    a, b = engine.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys()
    assert all(_same(a[n], b[n]) for n in a)
    assert (
        reloaded.generate(PROMPTS, max_new_tokens=5).token_ids == engine.generate(PROMPTS, max_new_tokens=5).token_ids
    )
    x = reloaded.generate(PROMPTS, max_new_tokens=5, temperature=1.0, seed=2)
    y = engine.generate(PROMPTS, max_new_tokens=5, temperature=1.0, seed=2)
    assert x.token_ids == y.token_ids
    assert all(torch.equal(p, q) for p, q in zip(x.logprobs, y.logprobs, strict=True))


def test_fp8_kv_cache_emulation_changes_logprobs_slightly(dense_path, fp8_engine):
    kv = ReferenceFP8Engine.from_hf_checkpoint(dense_path, quantization=FP8_QUANT, kv_cache_dtype="fp8")
    layers = kv.model_config.num_hidden_layers
    scales = [(f"model.layers.{i}.self_attn.attn.{s}_scale", torch.tensor(0.02)) for i in range(layers) for s in "kv"]
    kv.load_weights(scales)
    ids = [p + [1, 2, 3, 4] for p in PROMPTS]
    base = torch.cat(fp8_engine.score(ids, response_start=2))
    quant = torch.cat(kv.score(ids, response_start=2))
    diff = (base - quant).abs()
    assert float(diff.max()) > 0
    assert float(diff.mean()) < 0.05 * float(base.abs().mean())


# ---------------------------------------------------------------------------- configuration and manifest


def test_manifest_and_config_errors(dense_path):
    cfg = json.loads((dense_path / "config.json").read_text())
    with pytest.raises(ManifestError, match="qkv_proj"):
        ReferenceFP8Engine(cfg, quantization=FP8_QUANT, fp8_names={"model.layers.0.self_attn.q_proj.weight"})
    with pytest.raises(ManifestError, match="BF16"):
        ReferenceFP8Engine(cfg, quantization=FP8_QUANT, fp8_names={"model.norm.weight"})
    with pytest.raises(ManifestError, match="not weights"):
        ReferenceFP8Engine(cfg, quantization=FP8_QUANT, fp8_names={"model.layers.0.mlp.gate_up_proj.weight"})
    with pytest.raises(ConfigError, match="ignored_layers"):
        ReferenceFP8Engine(cfg, quantization={**FP8_QUANT, "ignored_layers": ["model.layers.0.attn"]})
    with pytest.raises(ConfigError, match="quantization is None"):
        ReferenceFP8Engine(cfg, fp8_names={"model.layers.0.mlp.up_proj.weight"})
    with pytest.raises(ConfigError, match=r"valid names: \['auto'"):
        ReferenceFP8Engine(cfg, kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="qwen3_moe"):
        ReferenceFP8Engine({**cfg, "model_type": "llama"})
    with pytest.raises(ConfigError, match="weight_block_size"):
        ReferenceFP8Engine(cfg, quantization={**FP8_QUANT, "weight_block_size": None})
    with pytest.raises(ManifestError, match="K_in=320"):
        ReferenceFP8Engine({**cfg, "intermediate_size": 320}, quantization=FP8_QUANT)
    assert ReferenceFP8Engine({**cfg, "intermediate_size": 320}).fp8_names == frozenset()
    partial = ReferenceFP8Engine(cfg, quantization={**FP8_QUANT, "ignored_layers": ["model.layers.1.mlp.down_proj"]})
    assert "model.layers.1.mlp.down_proj.weight" not in partial.fp8_names
    assert "model.layers.1.mlp.up_proj.weight" in partial.fp8_names
    with pytest.raises(ConfigError, match="BF16"):
        ReferenceFP8Engine(cfg).save_fp8_checkpoint(dense_path.parent / "never")


def test_moe_fp8_engine_runs_experts_in_fp8_close_to_bf16(moe_path):
    bf16 = ReferenceFP8Engine.from_hf_checkpoint(moe_path)
    fp8 = ReferenceFP8Engine.from_hf_checkpoint(moe_path, quantization=FP8_QUANT)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in fp8.fp8_names
    assert "model.layers.0.mlp.gate.weight" not in fp8.fp8_names
    held = dict(fp8.named_weights())
    w = _bf16_stream(moe_path)["model.layers.1.mlp.experts.2.up_proj.weight"]
    deq = dequantize_blockwise(
        held["model.layers.1.mlp.experts.2.up_proj.weight"],
        held["model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"],
    )
    assert float((deq - w.float()).abs().max()) <= float(w.float().abs().max()) / 16
    a = _prefill_logits(bf16, [PROMPTS[0]])[0]
    b = _prefill_logits(fp8, [PROMPTS[0]])[0]
    assert float((a - b).abs().max()) > 0
    cos = torch.nn.functional.cosine_similarity(a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True), dim=-1)
    assert float(cos.min()) > 0.95  # FP8 noise (and the odd flipped expert), not a different model
