"""The HF-named stream through real Megatron-Bridge, and the quantizing export on it."""

from __future__ import annotations

import pytest
import torch

from bridge_mappings.manifest import Fingerprint, Manifest, checkpoint_tensors
from bridge_mappings.quantized_export import (
    ExportSettings,
    check_tp_divisibility,
    checked_stream,
    preflight,
    quantized_stream,
)
from megatron_fp8.errors import ManifestError, NonFiniteError
from megatron_fp8.models import tiny_model_path
from megatron_fp8.quant import dequantize_blockwise, is_pow2
from megatron_fp8.refit.buckets import pack_buckets
from megatron_fp8.refit.inbucket import PendingPart

pytestmark = pytest.mark.megatron

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _manifest(names: dict[str, tuple[int, ...]], fp8: set[str]) -> Manifest:
    """A manifest as vLLM answers it for all-FP8 linears (vLLM's own answer is tested in test_manifest*)."""
    fp = Fingerprint("x", "0", "{}", 0, 0)
    return Manifest("test", fp, tuple(sorted(fp8)), tuple(sorted(set(names) - fp8)), (), {})


@pytest.fixture(scope="module", params=["tiny", "tiny-llama", "tiny-moe"])
def exported(request):
    from megatron_fp8.megatron import build_megatron_model, export_hf_weights, megatron_parallel

    path = tiny_model_path(request.param)
    with megatron_parallel():
        m = build_megatron_model(path, recipe="blockwise")
        stream = dict(export_hf_weights(m))
    return path, stream


def test_hf_named_stream_is_the_checkpoint(exported):
    path, stream = exported
    ckpt = checkpoint_tensors(path)
    assert set(stream) == set(ckpt)
    for name, t in stream.items():
        assert tuple(t.shape) == ckpt[name], name


def test_quantizing_export_dequantizes_back_within_fp8_rounding(exported):
    path, stream = exported
    shapes = {n: tuple(t.shape) for n, t in stream.items()}
    fp8 = {n for n in stream if any(f".{p}.weight" in n for p in LINEAR)}
    manifest = _manifest(shapes, fp8)
    preflight(shapes, manifest, ExportSettings())
    out = dict(checked_stream(quantized_stream(stream.items(), manifest), manifest, planned=shapes))
    assert set(out) == set(stream) | {n + "_scale_inv" for n in fp8}
    for name, t in stream.items():
        if name in fp8:
            q, s = out[name], out[name + "_scale_inv"]
            assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            assert tuple(s.shape) == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
            deq = dequantize_blockwise(q, s)
            ref = t.float()
            # e4m3 keeps 3 mantissa bits: per element error <= 2**-4 of its binade, or half the
            # smallest subnormal step of the block
            bound = (
                ref.abs() * 2.0**-4
                + s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: t.shape[0], : t.shape[1]] * 2.0**-9
            )
            assert bool(((deq - ref).abs() <= bound).all()), name
        else:
            assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


def test_ue8m0_scales_are_powers_of_two(exported):
    _, stream = exported
    name = next(n for n in stream if n.endswith("q_proj.weight"))
    manifest = _manifest({n: tuple(t.shape) for n, t in stream.items()}, {name})
    out = dict(quantized_stream(stream.items(), manifest, ExportSettings(scale_format="ue8m0")))
    assert bool(is_pow2(out[name + "_scale_inv"]).all())


def test_preflight_lists_differences(exported):
    _, stream = exported
    shapes = {n: tuple(t.shape) for n, t in stream.items()}
    fp8 = {n for n in stream if n.endswith("q_proj.weight")}
    manifest = _manifest(shapes, fp8 | {"model.layers.9.self_attn.q_proj.weight"})
    with pytest.raises(ManifestError, match=r"not in the weight stream.*layers\.9"):
        preflight(shapes, manifest, ExportSettings())


def test_checked_stream_refuses_missing_or_wrong_dtype(exported):
    _, stream = exported
    shapes = {n: tuple(t.shape) for n, t in stream.items()}
    fp8 = {n for n in stream if n.endswith("k_proj.weight")}
    manifest = _manifest(shapes, fp8)
    # a BF16 tensor arriving for a manifest name
    with pytest.raises(ManifestError, match="in vLLM's FP8 manifest but arrived as torch.bfloat16"):
        list(checked_stream(stream.items(), manifest))
    # a stream that ends before every manifest weight came
    partial = [(n, t) for n, t in quantized_stream(stream.items(), manifest) if "layers.0.self_attn.k_proj" not in n]
    with pytest.raises(ManifestError, match=r"ended without.*layers\.0\.self_attn\.k_proj"):
        list(checked_stream(partial, manifest))


def test_nan_weight_refused_naming_tensor_and_block(exported):
    _, stream = exported
    name = next(n for n in stream if n.endswith("self_attn.q_proj.weight"))  # [256, 256]
    bad = dict(stream)
    bad[name] = bad[name].clone()
    bad[name][130, 5] = float("nan")
    manifest = _manifest({n: tuple(t.shape) for n, t in bad.items()}, {name})
    with pytest.raises(NonFiniteError, match=rf"{name}.*row_block=1, col_block=0"):
        list(quantized_stream(bad.items(), manifest))


def test_tp_divisibility_names_weight_and_working_sizes():
    shapes = {
        "model.layers.0.self_attn.k_proj.weight": (128, 256),
        "model.layers.0.self_attn.o_proj.weight": (256, 384),
    }
    check_tp_divisibility(shapes, shapes, tp_size=1)
    with pytest.raises(ManifestError, match=r"k_proj.*N=128 / TP 2.*TP sizes that work: \[1\]"):
        check_tp_divisibility(shapes, shapes, tp_size=2)
    with pytest.raises(ManifestError, match=r"o_proj.*K=384 / TP 2"):
        check_tp_divisibility({"model.layers.0.self_attn.o_proj.weight": (256, 384)}, shapes, tp_size=2)


def test_refit_stream_through_the_bridge_adapter_equals_quantized_export():
    from bridge_mappings.quantized_export import refit_stream
    from megatron_fp8.megatron import build_megatron_model, export_hf_weights, megatron_parallel

    path = tiny_model_path("tiny")
    with megatron_parallel():
        m = build_megatron_model(path)
        plain = dict(export_hf_weights(m))
        fp8 = {n for n in plain if n.endswith(("q_proj.weight", "down_proj.weight"))}
        manifest = _manifest({n: tuple(t.shape) for n, t in plain.items()}, fp8)
        got = dict(refit_stream(m, manifest))
        parts = dict(refit_stream(m, manifest, in_bucket=True))  # what GRPO's refit sends: quantized in the bucket
    want = dict(quantized_stream(plain.items(), manifest))
    assert list(got) == list(want) == list(parts)
    assert {n for n, t in parts.items() if isinstance(t, PendingPart)} == fp8 | {n + "_scale_inv" for n in fp8}
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name
        held = parts[name].materialize() if isinstance(parts[name], PendingPart) else parts[name]
        assert torch.equal(held.view(torch.uint8), want[name].view(torch.uint8)), name


def test_in_bucket_quantized_stream_packs_the_wire_of_the_eager_one():
    g = torch.Generator().manual_seed(5)
    stream = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(300, 260, generator=g).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.randn(260, generator=g).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(128, 129, generator=g).bfloat16(),
        "model.layers.0.mlp.experts.weight": torch.randn(2, 130, 200, generator=g).bfloat16(),
    }
    fp8 = {n for n in stream if n.endswith("proj.weight") or "experts" in n}
    manifest = _manifest({n: tuple(t.shape) for n, t in stream.items()}, fp8)
    for settings in (ExportSettings(), ExportSettings(scale_format="ue8m0")):
        for bucket_bytes in (1 << 20, 4096):
            eager = pack_buckets(
                quantized_stream(stream.items(), manifest, settings, nonfinite="defer"),
                version=1,
                bucket_bytes=bucket_bytes,
            )
            lazy = pack_buckets(
                quantized_stream(stream.items(), manifest, settings, in_bucket=True),
                version=1,
                bucket_bytes=bucket_bytes,
            )
            for a, b in zip(eager, lazy, strict=True):
                assert a.metas == b.metas and a.checksum == b.checksum and torch.equal(a.payload, b.payload)
