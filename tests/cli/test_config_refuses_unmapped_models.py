"""``config`` refuses a model folder of an architecture megatron-fp8 does not map, exactly as ``grpo`` does.

Both commands run as subprocesses on the same folders: a GPT-2 folder (no ``hidden_size`` key at all) and a
GPT-NeoX folder (every dimension key present, ``config`` approved it before the architecture was checked, and
``grpo`` failed only inside vLLM's FP8 manifest, minutes later). Each must exit 1 with the same one-line refusal
naming ``config.json``, the architecture and the families megatron-fp8 runs, before any model is built.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import _warm_cli
import pytest
import torch
from safetensors.torch import save_file

CLI = [sys.executable, "-m", "megatron_fp8.cli"]

GPT2 = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_embd": 64,
    "n_head": 4,
    "n_layer": 2,
    "vocab_size": 1000,
}
NEOX = {
    "architectures": ["GPTNeoXForCausalLM"],
    "model_type": "gpt_neox",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "vocab_size": 1000,
}


def _folder(root: Path, config: dict[str, object], weight: str) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    save_file({weight: torch.zeros(4, 4)}, str(root / "model.safetensors"))
    return root


@pytest.mark.parametrize(
    ("config", "weight", "arch"),
    [(GPT2, "transformer.wte.weight", "GPT2LMHeadModel"), (NEOX, "gpt_neox.embed_in.weight", "GPTNeoXForCausalLM")],
    ids=["gpt2", "gpt-neox"],
)
def test_config_and_grpo_refuse_the_folder_with_the_same_line(tmp_path, config, weight, arch):
    folder = _folder(tmp_path / "model", config, weight)
    checked = _warm_cli.run(["config", "--model", str(folder)], timeout=300)  # forked by the warm launcher
    out = tmp_path / "run"
    run = _warm_cli.run(
        ["grpo", "--model", str(folder), "--steps", "1", "--no-progress", "--out", str(out)], timeout=300
    )
    for proc in (checked, run):
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    line = next(x for x in checked.stderr.splitlines() if "does not map" in x)
    assert f"{folder / 'config.json'} describes a model of architecture {arch}" in line
    assert "LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM" in line and "--model tiny" in line
    assert line in run.stderr.splitlines()  # grpo refuses with the very same line
    assert "approved" not in checked.stdout
    assert not out.exists()  # refused before --out is touched
