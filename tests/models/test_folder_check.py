"""A model folder checked against its own weights without loading them (issue 21, item 4): ``config`` refuses a
config.json that lacks a dimension or disagrees with the safetensors headers, naming the key, tensor and file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fp8.models import resolve_model
from megatron_fp8.models.folder_check import folder_problems, header_shapes

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def folder(tmp_path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(resolve_model("tiny"), dest)
    return dest


def _edit(folder: Path, **changes) -> None:
    path = folder / "config.json"
    hf = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    path.write_text(json.dumps(hf))


def test_the_shipped_models_pass():
    for name in ("tiny", "tiny-moe"):
        assert folder_problems(resolve_model(name)) == [], name


def test_headers_give_every_shape_without_reading_tensors(folder):
    shapes = header_shapes(folder)
    hf = json.loads((folder / "config.json").read_text())
    assert shapes["model.embed_tokens.weight"][0] == (hf["vocab_size"], hf["hidden_size"])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": None}, "gives no integer hidden_size"),
        ({"vocab_size": "big"}, "gives no integer vocab_size"),
        ({"hidden_size": 512}, "model.embed_tokens.weight of shape"),
        ({"num_key_value_heads": 1}, "model.layers.0.self_attn.k_proj.weight of shape"),
        ({"intermediate_size": 100}, "model.layers.0.mlp.gate_proj.weight of shape"),
        ({"num_hidden_layers": 7}, "says num_hidden_layers=7, but the weights hold layers 0..3"),
    ],
    ids=["missing-hidden", "non-int-vocab", "hidden", "kv-heads", "intermediate", "layers"],
)
def test_a_config_json_that_disagrees_with_its_weights_is_refused(folder, changes, message):
    _edit(folder, **changes)
    problems = folder_problems(folder)
    assert any(message in p for p in problems), problems


def test_a_truncated_shard_and_a_folder_without_weights_are_named(folder):
    shard = folder / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:5])
    assert "not a safetensors file (truncated download?)" in folder_problems(folder)[0]
    shard.unlink()
    assert "holds no *.safetensors weights" in folder_problems(folder)[0]


def test_config_refuses_it_in_one_message(folder):
    _edit(folder, num_hidden_layers=7)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_fp8.cli", "config", f"model.name_or_path={folder}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "this run cannot start" in proc.stderr and "num_hidden_layers=7" in proc.stderr
    assert "please report it" not in proc.stderr
