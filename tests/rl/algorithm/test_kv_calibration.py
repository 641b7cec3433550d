"""FP8 KV-cache scale calibration: percentile math, names, max over ranks, hooks on a tiny Qwen3."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from megatron_fp8.errors import ConfigError, NonFiniteError
from megatron_fp8.rl.algorithm.kv_calibration import (
    KVAmaxRecorder,
    attach_kv_amax_hooks,
    compute_kv_scales,
    kv_scale_name,
    split_megatron_qkv,
)


def _record_series(rec: KVAmaxRecorder, layer: int, values: list[float]) -> None:
    for x in values:
        rec.record(layer, torch.tensor([0.0, x]), torch.tensor([-2.0 * x, 0.0]), torch.tensor([0.5 * x]))


def test_percentile_of_per_call_amax_times_margin_over_448():
    rec = KVAmaxRecorder()
    _record_series(rec, 0, [float(i) for i in range(1, 1002)])  # 1 .. 1001
    scales = compute_kv_scales(rec)
    # linear interpolation: position 0.999 * (1001 - 1) = 999 -> the 1000th value, 1000.0
    assert scales["model.layers.0.self_attn.attn.q_scale"].item() == pytest.approx(1000.0 * 1.05 / 448, rel=1e-6)
    assert scales["model.layers.0.self_attn.attn.k_scale"].item() == pytest.approx(2000.0 * 1.05 / 448, rel=1e-6)
    assert scales["model.layers.0.self_attn.attn.v_scale"].item() == pytest.approx(500.0 * 1.05 / 448, rel=1e-6)

    rec = KVAmaxRecorder()
    _record_series(rec, 0, [4.0, 1.0, 3.0, 2.0])
    # q: median of {1, 2, 3, 4} is 2.5; k = {2, 4, 6, 8}: 75th percentile at position 0.75 * 3 = 2.25 -> 6.5
    assert compute_kv_scales(rec, percentile=50, margin=1.0)[kv_scale_name(0, "q")].item() == pytest.approx(2.5 / 448)
    assert compute_kv_scales(rec, percentile=75, margin=2.0)[kv_scale_name(0, "k")].item() == pytest.approx(
        6.5 * 2.0 / 448
    )
    assert compute_kv_scales(rec, percentile=100, margin=1.0)[kv_scale_name(0, "v")].item() == pytest.approx(2.0 / 448)


def test_names_shapes_dtypes_and_zero_amax():
    rec = KVAmaxRecorder()
    for layer in (1, 0, 2):
        rec.record(layer, torch.ones(2, 3), torch.zeros(4), torch.full((3,), -8.0, dtype=torch.bfloat16))
    scales = compute_kv_scales(rec, margin=1.0)
    assert list(scales) == [f"model.layers.{i}.self_attn.attn.{w}_scale" for i in range(3) for w in "qkv"]
    for name, s in scales.items():
        assert s.dtype == torch.float32 and s.shape == torch.Size([]) and s.device.type == "cpu", name
    assert scales[kv_scale_name(2, "k")].item() == 1.0  # amax 0 -> 1.0, never 0/inf
    assert scales[kv_scale_name(2, "v")].item() == pytest.approx(8.0 / 448)
    # the names are what vLLM 0.32's cache-scale mapper keeps as they are (canonical form)
    assert all(re.fullmatch(r"model\.layers\.\d+\.self_attn\.attn\.[qkv]_scale", n) for n in scales)


def test_errors_name_the_layer():
    rec = KVAmaxRecorder()
    with pytest.raises(ConfigError, match="attach_kv_amax_hooks"):
        compute_kv_scales(rec)
    rec.record(0, torch.ones(1), torch.ones(1), torch.ones(1))
    rec.record(2, torch.ones(1), torch.ones(1), torch.ones(1))
    with pytest.raises(ConfigError, match=r"layers \[1\]"):
        compute_kv_scales(rec)
    with pytest.raises(ConfigError, match=r"layers \[1, 3\]"):
        compute_kv_scales(rec, num_layers=4)
    rec.reset()
    rec.record(0, torch.ones(1), torch.tensor([float("inf")]), torch.ones(1))
    with pytest.raises(NonFiniteError, match=r"model\.layers\.0\.self_attn\.attn\.k_scale") as info:
        compute_kv_scales(rec)
    assert info.value.name == "model.layers.0.self_attn.attn.k_scale"
    with pytest.raises(ConfigError, match="percentile"):
        compute_kv_scales(rec, percentile=0)
    with pytest.raises(ConfigError, match="valid names"):
        kv_scale_name(0, "o")


def test_paused_and_reset():
    rec = KVAmaxRecorder()
    with rec.paused():
        rec.record(0, torch.ones(1), torch.ones(1), torch.ones(1))
    assert rec.layers() == [] and rec.enabled
    rec.record(0, torch.ones(1), torch.ones(1), torch.ones(1))
    assert rec.num_calls(0) == 1
    rec.reset()
    assert rec.layers() == []


# --------------------------------------------------------------------------- max over ranks (real gloo group)

# rank -> {layer: per-call values}; rank 0 holds layers 0-1, rank 1 holds 1-2 (like pipeline stages overlapping
# through data parallelism): layer 1 must take the larger of the two ranks' percentiles.
_RANK_SERIES = {
    0: {0: [1.0, 2.0, 3.0], 1: [5.0, 7.0]},
    1: {1: [6.0, 9.0, 4.0], 2: [0.5]},
}


def _gloo_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rec = KVAmaxRecorder()
        for layer, values in _RANK_SERIES[rank].items():
            _record_series(rec, layer, values)
        scales = compute_kv_scales(rec, percentile=100.0, margin=1.0)
        torch.save(scales, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_max_over_ranks_with_a_real_gloo_group(tmp_path):
    tmp.start_processes(
        _gloo_worker,
        args=(2, str(tmp_path / "init"), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="fork",
    )
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    assert list(r0) == list(r1) and len(r0) == 9
    for name in r0:
        assert torch.equal(r0[name], r1[name]), name
    expected_q = {0: 3.0, 1: 9.0, 2: 0.5}  # max over ranks of each rank's max
    for layer, amax in expected_q.items():
        assert r0[kv_scale_name(layer, "q")].item() == pytest.approx(amax / 448)
        assert r0[kv_scale_name(layer, "k")].item() == pytest.approx(2 * amax / 448)


# --------------------------------------------------------------------------- Megatron-Core fused qkv layout


def test_split_megatron_qkv_follows_the_interleaved_group_layout():
    ng, hpg, hn = 2, 3, 4
    # build the fused vector by hand: per group, hpg query heads, then k, then v; value = 100*group + 10*slot + dim
    parts = []
    for g in range(ng):
        for slot in range(hpg + 2):
            parts.extend(100 * g + 10 * slot + d for d in range(hn))
    mixed = torch.tensor(parts, dtype=torch.float32).repeat(5, 1, 1)  # [sq=5, b=1, ng*(hpg+2)*hn]
    q, k, v = split_megatron_qkv(mixed, num_query_groups=ng, heads_per_group=hpg, head_dim=hn)
    assert q.shape == (5, 1, ng * hpg, hn) and k.shape == (5, 1, ng, hn) and v.shape == (5, 1, ng, hn)
    for g in range(ng):
        for h in range(hpg):
            assert q[0, 0, g * hpg + h].tolist() == [100 * g + 10 * h + d for d in range(hn)]
        assert k[0, 0, g].tolist() == [100 * g + 10 * hpg + d for d in range(hn)]
        assert v[0, 0, g].tolist() == [100 * g + 10 * (hpg + 1) + d for d in range(hn)]
    with pytest.raises(ConfigError, match="linear_qkv"):
        split_megatron_qkv(mixed, num_query_groups=ng, heads_per_group=2, head_dim=hn)


# --------------------------------------------------------------------------- hooks on a tiny HF Qwen3


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        rope_theta=10000.0,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    return model


def test_hf_qwen3_hooks_record_what_reaches_attention():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = _tiny_qwen3()
    seen: dict[int, list[tuple[float, float, float]]] = {}

    def oracle(module, query, key, value, *args, **kwargs):
        # query/key are post q_norm/k_norm and post RoPE, [B, heads, T, D]: what the KV cache stores
        seen.setdefault(module.layer_idx, []).append(tuple(float(t.detach().abs().amax()) for t in (query, key, value)))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("kvcal_oracle", oracle)
    model.set_attn_implementation("kvcal_oracle")

    rec = KVAmaxRecorder()
    raw_k: list[float] = []
    raw = model.model.layers[0].self_attn.k_proj.register_forward_hook(
        lambda _m, _a, out: raw_k.append(float(out.abs().amax()))
    )
    ids = torch.randint(0, 96, (2, 8))
    with torch.no_grad(), attach_kv_amax_hooks(model, rec) as handle:
        assert handle.layers == (0, 1)
        model(input_ids=ids)
        model(input_ids=ids[:, :5])
        with rec.paused():
            model(input_ids=ids)
    raw.remove()
    assert rec.layers() == [0, 1]
    for layer in (0, 1):
        hist = rec.history(layer)
        assert hist.shape == (2, 3)  # the paused call was not recorded
        torch.testing.assert_close(hist, torch.tensor(seen[layer][:2]), rtol=1e-6, atol=0)
    # k is recorded after k_norm and RoPE, not the raw projection
    assert not math.isclose(rec.history(0)[0, 1].item(), raw_k[0], rel_tol=1e-3)

    # hooks are gone after the context
    model(input_ids=ids)
    assert rec.num_calls(0) == 2

    scales = compute_kv_scales(rec, percentile=100.0, margin=1.0)
    assert len(scales) == 6
    k_amax = max(s[1] for s in seen[1][:2])
    assert scales[kv_scale_name(1, "k")].item() == pytest.approx(k_amax / 448, rel=1e-6)


def test_attach_rejects_models_without_attention():
    with pytest.raises(ConfigError, match="no recognizable attention"):
        attach_kv_amax_hooks(torch.nn.Linear(2, 2), KVAmaxRecorder())
    with pytest.raises(ConfigError, match="valid names"):
        attach_kv_amax_hooks(torch.nn.Linear(2, 2), KVAmaxRecorder(), kind="jax")


# --------------------------------------------------------------------------- hooks on a real Megatron-Core GPTModel


class _TensorRecorder(KVAmaxRecorder):
    """Keeps the full q/k/v tensors as well, to compare the two Megatron sources element by element."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict[int, list[tuple[torch.Tensor, ...]]] = {}

    def record(self, layer_idx, q, k, v):
        super().record(layer_idx, q, k, v)
        self.tensors.setdefault(layer_idx, []).append(tuple(t.detach().clone() for t in (q, k, v)))


def _mcore_gpt(*, qk_norm_and_rope: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        use_cpu_initialization=True,
        qk_layernorm=qk_norm_and_rope,
        normalization="RMSNorm",
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_norm_and_rope, normalization="RMSNorm")
    return GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=64,
        max_sequence_length=32,
        position_embedding_type="rope" if qk_norm_and_rope else "none",
    )


@pytest.mark.megatron
def test_megatron_core_hooks_and_fused_qkv_layout():
    from bridge_mappings.adapter import cpu_device_patches
    from megatron_fp8.megatron.parallel import megatron_parallel

    ids = torch.randint(0, 64, (2, 8))
    pos = torch.arange(8)[None].expand(2, 8)
    causal = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1)
    with cpu_device_patches(), megatron_parallel():
        # without QK-norm and RoPE, the split linear_qkv output must equal core_attention's inputs exactly:
        # this checks split_megatron_qkv against Megatron-Core's own layout
        model = _mcore_gpt(qk_norm_and_rope=False)
        core, fused = _TensorRecorder(), _TensorRecorder()
        with attach_kv_amax_hooks(model, core) as h1, attach_kv_amax_hooks(model, fused, megatron_source="linear_qkv"):
            assert h1.layers == (0, 1)
            with torch.no_grad():
                model(ids, pos, causal)
        for layer in (0, 1):
            for a, b in zip(core.tensors[layer][0], fused.tensors[layer][0], strict=True):
                assert torch.equal(a, b)

        # with QK-norm + RoPE, core_attention sees the normed, rotated q/k; v is the same from both sources
        model = _mcore_gpt(qk_norm_and_rope=True)
        core, fused = KVAmaxRecorder(), KVAmaxRecorder()
        with attach_kv_amax_hooks(model, core), attach_kv_amax_hooks(model, fused, megatron_source="linear_qkv"):
            model(ids, pos, causal).sum().backward()
        for layer in (0, 1):
            c, f = core.history(layer), fused.history(layer)
            assert c.shape == (1, 3) and c[0, 2] == f[0, 2]
            assert not torch.isclose(c[0, 1], f[0, 1])
        scales = compute_kv_scales(core)
        assert list(scales) == [kv_scale_name(i, w) for i in (0, 1) for w in "qkv"]


@pytest.mark.gpu
def test_cuda_tensors_record_without_leaving_the_device_and_scales_come_back_on_cpu():
    rec = KVAmaxRecorder()
    for x in (1.0, 3.0, 2.0):
        q = torch.full((4, 8), x, device="cuda", dtype=torch.bfloat16)
        rec.record(0, q, -2 * q, q / 2)
    assert rec._history[0][0].device.type == "cuda"
    scales = compute_kv_scales(rec, percentile=100.0, margin=1.0)
    assert scales[kv_scale_name(0, "k")].device.type == "cpu"
    assert scales[kv_scale_name(0, "k")].item() == pytest.approx(6.0 / 448)
