"""``megatron-fp8 config``: prints the resolved config; bad keys exit 1 with the key named."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import _warm_cli
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    """``megatron-fp8 config *args`` in a process of its own (the suite's warm launcher, tests/_warm_cli.py)."""
    return _warm_cli.run(["config", *args], timeout=120)


def test_config_json_with_override():
    proc = _run("--config", str(ROOT / "configs" / "llama31_8b_fp8_nemorl_keys.yaml"), "grpo.max_num_steps=3", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["grpo"]["max_num_steps"] == 3
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
    assert "grpo.num_step" in proc.stderr and "did you mean 'grpo.max_num_steps'" in proc.stderr


NEMO_RL = ROOT / "tests" / "config" / "data" / "nemo_rl" / "examples" / "configs"


def test_explain_nemo_rl_config_in_80_columns():
    proc = _run("--explain", str(NEMO_RL / "grpo_math_8B_megatron_fp8.yaml"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "config: grpo_math_8B_megatron_fp8.yaml (+3 parent files)" in out
    assert "policy.generation.vllm_cfg.use_deep_gemm = true" in out and "VLLM_USE_DEEP_GEMM" in out
    assert "[grpo_math_8B_megatron.yaml] vLLM engine argument max_model_len" in out
    assert "policy.megatron_cfg.sequence_parallel = false" in out
    assert "no effect: megatron-fp8 trains with tensor" in out
    long_lines = [line for line in out.splitlines() if len(line) > 80]
    assert all(" " not in line for line in long_lines), long_lines  # only a single over-long key may overflow
    assert "no effect in megatron-fp8" in proc.stderr  # the one load warning


def test_explain_json_full_table():
    proc = _run("--explain", str(NEMO_RL / "grpo_math_8B_megatron_fp8.yaml"), "grpo.max_num_steps=7", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    rows = {r["key"]: r for r in data["keys"]}
    assert len(data["files"]) == 4
    assert rows["grpo.max_num_steps"]["value"] == 7 and rows["grpo.max_num_steps"]["source"] == "<override>"
    assert rows["policy.generation.vllm_cfg.gpu_memory_utilization"]["implemented"] is True
    assert rows["data.shuffle"]["implemented"] is True and "rl.data.problems" in rows["data.shuffle"]["effect"]
    assert rows["data.num_workers"]["implemented"] is False and rows["data.num_workers"]["effect"].startswith(
        "no effect"
    )
    assert rows["policy.generation.vllm_cfg.precision"]["source"].endswith("grpo_math_8B_megatron_fp8.yaml")


def test_explain_mxfp8_config_exits_1_naming_blackwell():
    proc = _run("--explain", str(NEMO_RL / "recipes/llm/performance/grpo-qwen3-32b-4n4g-mxfp8-rollout.yaml"))
    assert proc.returncode == 1 and "Blackwell" in proc.stderr
