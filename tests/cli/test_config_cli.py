"""``megatron-fp8 config``: prints the resolved config; bad keys exit 1 with the key named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_fp8.cli", "config", *args], capture_output=True, text=True, timeout=120
    )


def test_config_json_with_override():
    proc = _run("--config", str(ROOT / "configs" / "llama31_8b_fp8_nemorl_keys.yaml"), "grpo.num_steps=3", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["grpo"]["num_steps"] == 3
    assert data["policy"]["megatron_cfg"]["fp8_cfg"]["fp8_recipe"] == "blockwise"
    assert data["model"]["name_or_path"] == "meta-llama/Llama-3.1-8B-Instruct"


def test_config_yaml_default():
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(proc.stdout)
    assert data["model"]["name_or_path"] == "tiny"


def test_config_bad_key_exits_1():
    proc = _run("grpo.num_step=3")
    assert proc.returncode == 1
    assert "grpo.num_step" in proc.stderr and "did you mean 'grpo.num_steps'" in proc.stderr
