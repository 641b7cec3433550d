"""The one validation: `megatron-fp8 config` and `grpo` run the same pre-flight checks (megatron_fp8.rl.driver.preflight)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import _warm_cli
import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_fp8.config import load_config
from megatron_fp8.errors import ConfigError
from megatron_fp8.models import tiny_model_path
from megatron_fp8.rl.driver.preflight import (
    _rollout_placement_problems,
    check_weights_finite,
    preflight,
    refuse_empty_config,
)
from megatron_fp8.rl.driver.runtime import rollout_dtype_stream, trainer_dtype, training_math_label

REPO = Path(__file__).resolve().parents[3]
CLI = [sys.executable, "-m", "megatron_fp8.cli"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``megatron-fp8 *args`` in a process of its own (the suite's warm launcher, tests/_warm_cli.py; a fresh
    interpreter where ``env`` changes what a library reads at import, e.g. ``HF_HUB_OFFLINE``)."""
    return _warm_cli.run(list(args), env=env, timeout=300)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_default_config_passes_and_resolves_the_model():
    report = preflight(load_config(None), download=False)
    assert report.model_path is not None and (report.model_path / "config.json").is_file()
    assert report.arms == ("bf16", "fp8", "fp8_tis") and report.steps == load_config(None).grpo.max_num_steps
    assert report.config.model.num_attention_heads == 4  # read from the resolved model


def test_a_minimal_config_runs_its_bf16_arm_and_fp8_arms_need_an_fp8_rollout(tmp_path):
    """Issue 21: without grpo.arms the arms follow the rollout precision (BF16 rollout: the bf16 arm)."""
    cfg = load_config(_write(tmp_path / "min.yaml", "grpo:\n  max_num_steps: 3\n"))
    assert cfg.grpo.arms == ("bf16",) and preflight(cfg, download=False).arms == ("bf16",)
    proc = _cli("config", "--config", str(tmp_path / "min.yaml"))
    assert proc.returncode == 0 and "approved" in proc.stdout and "arms: bf16;" in proc.stdout, proc.stderr
    fp8 = load_config(tmp_path / "min.yaml", ["policy.generation.vllm_cfg.precision=fp8"])
    assert fp8.grpo.arms == ("bf16", "fp8", "fp8_tis")
    asked = load_config(tmp_path / "min.yaml", ["grpo.arms=[fp8]"])  # an explicit FP8 arm on a BF16 rollout
    with pytest.raises(ConfigError, match=r"vllm_cfg.precision is 'bf16'; set policy.generation.vllm_cfg.precision"):
        preflight(asked, download=False)


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"])
def test_empty_config_file_is_refused(tmp_path, text):
    path = _write(tmp_path / "empty.yaml", text)
    with pytest.raises(ConfigError, match="sets no key"):
        refuse_empty_config(path)
    proc = _cli("config", "--config", str(path))
    assert proc.returncode == 1 and f"{path} sets no key" in proc.stderr


def test_trainer_tp_that_does_not_split_the_heads_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3 does not split the model's 4 attention heads"):
        load_config(None, ["policy.megatron_cfg.tensor_model_parallel_size=3"])


def test_trainer_tp_needs_the_processes(monkeypatch):
    cfg = load_config(
        None, ["policy.megatron_cfg.tensor_model_parallel_size=2", "policy.megatron_cfg.fp8_cfg.enabled=false"]
    )
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"needs a multiple of 2 processes; this run has 1 \(WORLD_SIZE\)"):
        preflight(cfg, download=False)
    report = preflight(cfg, download=False, launch_checks=False)  # `config` before the launch: a note
    assert any("launch a multiple of 2 processes" in n for n in report.notes)
    preflight(cfg, download=False, world_size=2)


def test_fp8_tis_without_is_variant_and_unknown_arm(tmp_path):
    cfg = load_config(None, ["loss_fn.is_variant=none"])
    with pytest.raises(ConfigError) as info:
        preflight(cfg, arms=["fp8_tis", "nope"], steps=0, download=False)
    text = str(info.value)
    assert "steps must be >= 1" in text and "unknown or no arm(s) ['nope']" in text and "is_variant" in text


def test_hub_model_not_staged_is_a_note_for_config_and_an_error_for_grpo(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config(None, ["model.name_or_path=Qwen/Qwen3-8B"])
    report = preflight(cfg, download=False)
    assert report.model_path is None and "checked against its known dimensions" in report.notes[0]
    with pytest.raises(ConfigError, match="huggingface-cli download Qwen/Qwen3-8B --local-dir DIR"):
        preflight(cfg, download=True)


def _nan_checkpoint(folder: Path) -> Path:
    src = tiny_model_path("tiny")
    shutil.copytree(src, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_nan_weight_is_named_before_the_warm_start(tmp_path):
    folder = _nan_checkpoint(tmp_path / "nan-model")
    with pytest.raises(ConfigError, match=r"tensor model.layers.1.mlp.down_proj.weight has 1 non-finite value"):
        check_weights_finite(folder)
    cfg = load_config(None, [f"model.name_or_path={folder}"])
    with pytest.raises(ConfigError, match="model.layers.1.mlp.down_proj.weight"):
        preflight(cfg, scan_weights=True)
    check_weights_finite(tiny_model_path("tiny"))  # the clean checkpoint passes


def test_cpu_trainer_is_float32_and_the_rollout_gets_bf16():
    if not torch.cuda.is_available():
        assert trainer_dtype() == torch.float32
    stream = [("a.weight", torch.ones(2, dtype=torch.float32)), ("a.weight_scale_inv", torch.ones(1, dtype=torch.int8))]
    out = dict(rollout_dtype_stream(stream))
    assert out["a.weight"].dtype == torch.bfloat16 and out["a.weight_scale_inv"].dtype == torch.int8
    assert training_math_label("bf16-emulated", torch.float32) == "fp32-emulated"
    assert training_math_label("bf16", torch.float32) == "fp32"
    assert training_math_label("bf16", torch.bfloat16) == "bf16"


def test_grpo_cli_names_the_nan_tensor_before_touching_out(tmp_path):
    folder = _nan_checkpoint(tmp_path / "nan-model")
    out = tmp_path / "out"
    proc = _cli("grpo", "--steps", "1", "--out", str(out), f"model.name_or_path={folder}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "tensor model.layers.1.mlp.down_proj.weight has 1 non-finite value" in proc.stderr
    assert "loss_fn returned a non-finite loss" not in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()  # refused before --out was claimed


def test_data_is_checked_before_the_model_is_staged(tmp_path, monkeypatch):
    """`config` on a cluster config whose model is not here still reads the data files, keys, prompt file, reward."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)  # the config's prompt file is relative to the checkout
    with pytest.raises(ConfigError, match=r"data\.train\.data_path: no such file .*openmathinstruct2/train\.jsonl"):
        preflight(load_config(root / "configs" / "qwen3_8b_fp8.yaml"), download=False, launch_checks=False)
    (tmp_path / "openmathinstruct2").mkdir()
    for split in ("train", "validation"):
        shutil.copy(root / "data" / "math_tiny" / f"{split}.jsonl", tmp_path / "openmathinstruct2" / f"{split}.jsonl")
    report = preflight(load_config(root / "configs" / "qwen3_8b_fp8.yaml"), download=False, launch_checks=False)
    assert report.model_path is None and any("data: 250 rows read and checked" in n for n in report.notes)
    with pytest.raises(ConfigError, match="data.default.prompt_file"):
        preflight(
            load_config(root / "configs" / "qwen3_8b_fp8.yaml", [f"data.default.prompt_file={tmp_path / 'none.txt'}"]),
            download=False,
            launch_checks=False,
        )


_TP2 = ["policy.generation.vllm_cfg.tensor_parallel_size=2", "policy.generation.vllm_cfg.precision=bf16"]
_TP2 += ["grpo.arms=[bf16]", "policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise"]


@pytest.mark.parametrize(
    ("world", "trainer_tp", "colocated", "refusal"),
    [
        (1, 1, True, "in one process that sees 0 GPU(s)"),  # CPU: no one-process engine of 2 GPUs
        (2, 1, True, None),  # one engine holding both replicas (trainer TP 1 x DP 2): it rolls out for both
        (2, 2, False, "each separate rollout rank owns one GPU"),
        (2, 2, True, None),  # one engine sharded over the replica's 2 ranks (external_launcher)
        (4, 2, True, None),  # two engines, one per replica
    ],
)
def test_a_rollout_engine_that_cannot_be_placed_is_refused_naming_the_fix(
    monkeypatch, world, trainer_tp, colocated, refusal
):
    """Issue 36: an engine of rollout TP 2 is placed over 2 consecutive trainer ranks of one replica, or (issue 53)
    over the ranks of whole replicas; where it cannot be (one CPU process, a separate one-GPU rollout rank) it is
    refused before anything starts, naming the key and the value that works; never approved, then dead on the ranks."""
    if world > 1:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    overrides = [*_TP2, f"policy.megatron_cfg.tensor_model_parallel_size={trainer_tp}"]
    if not colocated:
        overrides += [
            "policy.generation.colocated.enabled=false",
            "policy.generation.colocated.resources.gpus_per_node=1",
        ]
    cfg = load_config(None, overrides)
    if refusal is None:
        preflight(cfg, download=False, launch_checks=False)
        return
    with pytest.raises(ConfigError) as info:
        preflight(cfg, download=False, launch_checks=False)
    msg = str(info.value)
    assert "policy.generation.vllm_cfg.tensor_parallel_size=2" in msg and refusal in msg
    assert "set policy.generation.vllm_cfg.tensor_parallel_size=1" in msg
    preflight(load_config(None, [*overrides[1:]]), download=False, launch_checks=False)  # rollout TP 1: approved


def test_an_engine_over_replicas_must_hold_their_tp_groups(monkeypatch):
    """An engine larger than the trainer's TP holds the TP groups of consecutive replicas (at PP 2, one stage of
    each): 4 ranks (TP 1 x PP 2 x DP 2) take engines of 2; 6 ranks (DP 3) do not split into pairs of replicas."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.setenv("RANK", "0")
    cfg = load_config(None, [*_TP2, "policy.megatron_cfg.pipeline_model_parallel_size=2"])
    monkeypatch.setenv("WORLD_SIZE", "4")
    preflight(cfg, download=False, launch_checks=False)
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ConfigError, match="the 3 replicas do not split into groups of 2") as info:
        preflight(cfg, download=False, launch_checks=False)
    assert "or a multiple of it" in str(info.value)


def test_a_placement_refusal_never_names_rollout_tp_1_where_the_engine_cannot_fit_one_gpu(monkeypatch):
    """NeMo-RL's 70B FP8 file at PP 2 on 3 nodes of 8 (DP 3): its engines of rollout TP 8 would hold one stage of 2 of
    3 replicas; the refusal must not suggest rollout TP 1, whose 72.7 GB of FP8 weights exceed one H100's 48 GB engine
    budget."""
    monkeypatch.setenv("WORLD_SIZE", "24")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    cfg = load_config(
        REPO / "tests" / "config" / "data" / "nemo_rl" / "examples" / "configs" / "grpo_math_70B_megatron_fp8.yaml",
        ["policy.megatron_cfg.pipeline_model_parallel_size=2"],
    )
    problems = _rollout_placement_problems(cfg)
    assert problems and "rollout TP 1 does not fit (weights 72.7 GB (fp8) / rollout TP 1" in problems[0]
    assert "set policy.generation.vllm_cfg.tensor_parallel_size=1" not in problems[0]


def test_engines_of_a_node_must_not_straddle_two_nodes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    cfg = load_config(None, [*_TP2, "policy.megatron_cfg.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="3 ranks per node do not split into engines of 2 ranks"):
        preflight(cfg, download=False, launch_checks=False)


def test_config_shows_each_replicas_samples_over_its_ranks_engines():
    from megatron_fp8.config.memory import describe_rollout

    cfg = load_config(REPO / "configs" / "llama31_8b_fp8.yaml", [])
    line = describe_rollout(cfg, processes=8)
    assert line == (
        "8 ranks: 8 engine(s) of TP 1, colocated (one per GPU); each replica's 256 samples over its 2 engine(s), "
        "128 each"
    )
    tp2 = load_config(REPO / "configs" / "llama31_8b_fp8.yaml", ["policy.generation.vllm_cfg.tensor_parallel_size=2"])
    assert describe_rollout(tp2, processes=8) == (
        "8 ranks: 4 engine(s) of TP 2, each sharded over 2 consecutive trainer ranks (vLLM external_launcher); each "
        "replica's 256 samples over its 1 engine(s), 256 each"
    )
    tp4 = load_config(REPO / "configs" / "llama31_8b_fp8.yaml", ["policy.generation.vllm_cfg.tensor_parallel_size=4"])
    assert describe_rollout(tp4, processes=8) == (
        "8 ranks: 2 engine(s) of TP 4, each sharded over 4 consecutive trainer ranks (vLLM external_launcher) holding "
        "2 replicas; each engine's 512 samples in one request, 256 per replica"
    )
    tp8 = load_config(REPO / "configs" / "llama31_8b_fp8.yaml", ["policy.generation.vllm_cfg.tensor_parallel_size=8"])
    assert describe_rollout(tp8, processes=8).startswith("8 ranks: 1 engine(s) of TP 8, each sharded over 8")
    pp2 = load_config(
        REPO / "configs" / "llama31_8b_fp8.yaml",
        ["policy.generation.vllm_cfg.tensor_parallel_size=4", "policy.megatron_cfg.pipeline_model_parallel_size=2"],
    )
    assert describe_rollout(pp2, processes=8) == (
        "8 ranks: 2 engine(s) of TP 4, each sharded over 4 consecutive trainer ranks (vLLM external_launcher) holding "
        "one pipeline stage of 2 replicas; each replica's 512 samples over its 2 engine(s) (one per stage), 256 each, "
        "an engine generating that part of each of its 2 replicas"
    )


def test_config_refuses_the_deadline_format_grpo_refuses():
    """Issue 38 (2): ``config`` approved ``checkpoint_must_save_by=4h``, which ``grpo`` refuses as the loop starts."""
    with pytest.raises(ConfigError, match=r"checkpoint_must_save_by='4h': expected DD:HH:MM:SS"):
        preflight(load_config(None, ["checkpointing.checkpoint_must_save_by=4h"]), download=False, launch_checks=False)
    preflight(
        load_config(None, ["checkpointing.checkpoint_must_save_by=00:04:00:00"]), download=False, launch_checks=False
    )
