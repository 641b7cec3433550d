"""The layout and per-GPU memory estimate that ``megatron-fp8 config`` prints (megatron_fp8.config.memory)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fp8.config import load_config
from megatron_fp8.config.memory import TRAINER_BYTES_PER_PARAM, estimate_memory
from megatron_fp8.models.dims import KNOWN_MODELS
from megatron_fp8.models.tiny import TINY_MODELS

REPO = Path(__file__).resolve().parents[2]
H100 = (80 * 10**9, "H100 80 GB")


@pytest.mark.parametrize(
    ("key", "published"),
    [("llama-3.1-8b", 8.03e9), ("qwen3-8b", 8.19e9), ("qwen3-30b-a3b", 30.5e9)],
)
def test_parameter_counts_match_the_published_sizes(key, published):
    assert KNOWN_MODELS[key].num_parameters == pytest.approx(published, rel=5e-3)


def test_tiny_parameter_count_equals_the_built_checkpoint():
    from safetensors.torch import load_file

    from megatron_fp8.models import tiny_model_path

    built = sum(t.numel() for t in load_file(str(tiny_model_path("tiny") / "model.safetensors")).values())
    assert TINY_MODELS["tiny"].vocab_size and KNOWN_MODELS["tiny"].num_parameters == built


def _replaced(obj: object, path: str, **changes: object) -> object:
    """``obj`` (nested frozen dataclasses) with ``changes`` made in the section at dotted ``path``."""
    head, _, rest = path.partition(".")
    inner = getattr(obj, head)
    return dataclasses.replace(
        obj, **{head: _replaced(inner, rest, **changes) if rest else dataclasses.replace(inner, **changes)}
    )


def test_estimate_is_the_documented_formula():
    cfg = load_config(REPO / "configs" / "qwen3_8b_fp8.yaml", [])
    est = estimate_memory(cfg, KNOWN_MODELS["qwen3-8b"], gpu=H100, processes=16)  # docs/cluster.md: 2 x 8 GPUs
    params = KNOWN_MODELS["qwen3-8b"].num_parameters
    assert cfg.policy.megatron_cfg.optimizer.use_distributed_optimizer  # 12 B of the 18 B sharded over DP 8
    assert (est.model_parallel, est.data_parallel) == (2, 8)
    assert est.trainer_bytes == (params * 6 + params * 12 // 8) // 2
    assert est.engine_bytes == int(0.5 * H100[0])  # colocated vLLM, gpu_memory_utilization 0.5
    assert est.fits and "(6 B + 12 B / DP 8 of 16 processes)" in est.describe() and "30.7 GB trainer" in est.describe()
    unsharded = _replaced(cfg, "policy.megatron_cfg.optimizer", use_distributed_optimizer=False)
    alone = estimate_memory(unsharded, KNOWN_MODELS["qwen3-8b"], gpu=H100, processes=16)
    assert alone.trainer_bytes == params * TRAINER_BYTES_PER_PARAM // 2 and alone.data_parallel == 1
    assert not alone.fits and "EXCEEDS" in alone.describe() and "73.7 GB trainer state" in alone.describe()
    apart = _replaced(cfg, "policy.generation.colocated", enabled=False)
    assert estimate_memory(apart, KNOWN_MODELS["qwen3-8b"], gpu=H100).engine_bytes == 0


def test_config_prints_the_layout_and_the_estimate_even_when_it_refuses():
    cmd = [sys.executable, "-m", "megatron_fp8.cli", "config", "--config", "configs/qwen3_8b_fp8.yaml"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (
        "# layout: TP 2 x PP 1 per model replica; DP = processes / 2; CP 1, EP 1; 512 samples per step in 1 optimizer update(s) of 512; packed micro-batches of <= 8192 tokens (scoring <= 16384); Adam state sharded over DP"
        in proc.stdout
    )
    assert (
        "# memory per GPU (estimate): 8.19 B params x (6 B + 12 B / DP 4 of 8 GPUs assumed) / (TP x PP = 2) = "
        "36.9 GB trainer state (weights, gradients, Adam state, all on the GPU at once); the plan by phase below "
        "gives the verdict" in proc.stdout
    )
    assert "does not fit one GPU" not in proc.stderr


def test_expert_parallelism_divides_the_routed_experts():
    """Qwen3-30B-A3B at EP 8 over 16 replicas with the distributed optimizer: the dense part keeps 6 B and shards
    12 B over DP 16; each GPU holds 1/8 of the experts, their 12 B sharded over the 2 ranks holding each expert."""
    dims = KNOWN_MODELS["qwen3-30b-a3b"]
    cfg = load_config(
        None,
        [
            "model.name_or_path=Qwen/Qwen3-30B-A3B",
            "policy.megatron_cfg.expert_model_parallel_size=8",
            "policy.megatron_cfg.optimizer.use_distributed_optimizer=true",
        ],
    )
    est = estimate_memory(cfg, dims, gpu=H100, processes=16)
    experts, dense = dims.num_expert_parameters, dims.num_parameters - dims.num_expert_parameters
    assert experts == 48 * 128 * 3 * 2048 * 768
    assert est.trainer_bytes == dense * 6 + dense * 12 // 16 + (experts * 6 + experts * 12 // 2) // 8
    assert "routed experts / EP 8" in est.describe()
    no_ep_cfg = _replaced(cfg, "policy.megatron_cfg", expert_model_parallel_size=1)
    no_ep = estimate_memory(no_ep_cfg, dims, gpu=H100, processes=16)
    assert no_ep.trainer_bytes > 3 * est.trainer_bytes


def test_the_kl_reference_policy_is_counted_in_host_memory():
    from megatron_fp8.config.memory import layout_report, reference_host_bytes

    dims = KNOWN_MODELS["qwen3-8b"]
    plain = load_config(None, ["model.name_or_path=Qwen/Qwen3-8B", "policy.megatron_cfg.tensor_model_parallel_size=2"])
    kl = load_config(
        None,
        [
            "model.name_or_path=Qwen/Qwen3-8B",
            "policy.megatron_cfg.tensor_model_parallel_size=2",
            "loss_fn.reference_policy_kl_penalty=0.01",
        ],
    )
    assert reference_host_bytes(plain, dims) == 0
    assert reference_host_bytes(kl, dims) == 2 * 2 * dims.num_parameters // 2
    lines, _ = layout_report(kl)
    assert any("host memory per rank for the KL penalty's reference policy" in line for line in lines)


def test_the_rollout_engine_line_shards_its_weights_over_rollout_tp_and_warns_when_they_do_not_fit():
    from megatron_fp8.config.memory import describe_engine_memory, engine_weight_bytes

    dims = KNOWN_MODELS["llama-3.1-8b"]
    bf16 = load_config(REPO / "configs" / "llama31_8b_fp8.yaml", ["policy.generation.vllm_cfg.precision=bf16"])
    fp8 = load_config(REPO / "configs" / "llama31_8b_fp8.yaml", [])
    assert engine_weight_bytes(bf16, dims) == 2 * dims.num_parameters
    # FP8 linear weights + their block scales, BF16 embedding and output layer: ~9 GB for Llama-3.1-8B
    assert 8.5e9 < engine_weight_bytes(fp8, dims) < 9.5e9
    one, fits_one = describe_engine_memory(fp8, dims, gpu=H100)
    two, _ = describe_engine_memory(
        load_config(REPO / "configs" / "llama31_8b_fp8.yaml", ["policy.generation.vllm_cfg.tensor_parallel_size=2"]),
        dims,
        gpu=H100,
    )
    assert fits_one and "/ rollout TP 1 = 9.1 GB" in one and "/ rollout TP 2 = 4.5 GB" in two
    small = load_config(
        REPO / "configs" / "llama31_8b_fp8.yaml", ["policy.generation.vllm_cfg.gpu_memory_utilization=0.1"]
    )
    line, fits = describe_engine_memory(small, dims, gpu=H100)
    assert not fits and "its budget 8.0 GB" in line


def test_the_config_header_gives_one_memory_verdict():
    """Issue 57 trip 9: NeMo-RL's keys file printed "100.2 GB of 80 GB: EXCEEDS it", then "peak 62.2 GB: fits", then
    "approved"; the per-phase plan is the one verdict, the whole-run sum is gone."""
    cmd = [sys.executable, "-m", "megatron_fp8.cli", "config", "--config", "configs/llama31_8b_fp8_nemorl_keys.yaml"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    header = [line for line in proc.stdout.splitlines() if line.startswith("#")]
    verdicts = [line for line in header if re.search(r": (fits|EXCEEDS)", line)]
    assert len(verdicts) == 1 and verdicts[0].startswith("#   peak: training 62.2 GB of 80 GB"), header
    assert "100.2 GB" not in proc.stdout and "60.2 GB trainer state" in proc.stdout and "approved" in proc.stdout
