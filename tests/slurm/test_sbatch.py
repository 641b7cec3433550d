"""The sbatch scripts, submitted for real to a local single-node Slurm (fixture in conftest.py).

Each job runs in the host environment (the checkout's .venv; CONTAINER_IMAGE empty) with
REQUIRE_GPU=0, writes its results under a temporary RESULTS_DIR and its sbatch log under a
temporary logs/ directory.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]


def _submit(
    cluster,
    tmp_path: Path,
    script: str,
    *args: str,
    env: dict[str, str],
    sbatch_opts: tuple[str, ...] = (),
    timeout: float = 150,
) -> tuple[int, str]:
    """``sbatch`` from the repository root, waited for (``SlurmCluster.submit``); return (exit status, the job's log)."""
    return cluster.submit(tmp_path / "logs", script, *args, env=env, sbatch_opts=sbatch_opts, timeout=timeout)


def test_test_sbatch_runs_pytest_and_writes_junit(slurm_cluster, tmp_path):
    results = tmp_path / "results"
    rc, log = _submit(
        slurm_cluster,
        tmp_path,
        "slurm/test.sbatch",
        env={
            "RESULTS_DIR": str(results),
            "REQUIRE_GPU": "0",
            "TEST_SELECTION": "tests/slurm/test_static.py",
            "PYTEST_ARGS": "-q -k 'pins or dockerfile_base or rejects_unknown'",
        },
    )
    assert rc == 0, log
    suite = ET.parse(results / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests, failures, errors = (int(suite.get(k)) for k in ("tests", "failures", "errors"))
    assert tests >= 5 and failures == 0 and errors == 0, log
    names = {case.get("name") for case in suite.iter("testcase")}
    assert "test_container_pins_agree_with_ci_and_dockerfile" in names
    assert "test_make_n_image_shows_the_build_command" not in names  # -k selection honoured
    assert "environment: host" in log and "preflight ok on 1 node(s)" in log and "tests passed" in log
    env = (results / "job.env").read_text()
    assert "REQUIRE_GPU=0" in env and f"RESULTS_DIR={results}" in env
    props = {p.get("name"): p.get("value") for p in ET.parse(results / "junit.xml").getroot().iter("property")}
    assert props["gpu_tests_ran"] == "0" and props["cuda_available"] == "false" and "vllm_version" in props
    assert "0 gpu test(s) ran" in log


def test_test_sbatch_requires_cuda_inside_the_job_by_default(slurm_cluster, tmp_path):
    # REQUIRE_GPU=1 (test.sbatch's default) with a stand-in nvidia-smi, so the host preflight passes: pytest itself
    # must refuse, because torch.cuda.is_available() is false where the tests run
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/bash\necho "GPU 0: NVIDIA Test GPU (UUID: GPU-0)"\n')
    smi.chmod(0o755)
    import os

    rc, log = _submit(
        slurm_cluster,
        tmp_path,
        "slurm/test.sbatch",
        env={
            "RESULTS_DIR": str(tmp_path / "results"),
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "RUN_DOCTOR": "0",
            "TEST_SELECTION": "tests/slurm/test_devices.py",
        },
    )
    assert rc != 0, log
    assert "torch.cuda.is_available() is False" in log, log


RECORDER = """\
import json, os, sys
argv = sys.argv[1:]
out = argv[argv.index("--out") + 1]
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MFP8_ROLE")
record = {"argv": argv, **{k: os.environ.get(k) for k in keys}}
with open(os.path.join(out, f"argv-rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(record, f)
"""


def test_grpo_sbatch_two_tasks_rendezvous_then_the_grpo_command(slurm_cluster, tmp_path):
    results, out = tmp_path / "results", tmp_path / "grpo-out"
    config = tmp_path / "tiny.yaml"
    config.write_text("steps: 2\n")
    recorder = tmp_path / "record_argv.py"
    recorder.write_text(RECORDER)
    rc, log = _submit(
        slurm_cluster,
        tmp_path,
        "slurm/grpo.sbatch",
        str(config),
        env={
            "RESULTS_DIR": str(results),
            "REQUIRE_GPU": "0",
            "STEPS": "2",
            "OUT_DIR": str(out),
            "GRPO_CMD": f"{sys.executable} {recorder}",
            "ROLLOUT_TASKS": "1",
        },
        sbatch_opts=("--ntasks=2",),
    )
    assert rc == 0, log
    # preflight: both tasks met over gloo at the node Slurm allocated
    summary = json.loads((results / "rendezvous.json").read_text())
    assert summary["ok"] and summary["world_size"] == 2 and summary["sum"] == 3
    assert summary["master_addr"] == slurm_cluster.node and summary["hosts"] == [socket.gethostname()] * 2
    assert "rendezvous ok: rank 0/2" in log and "rendezvous ok: rank 1/2" in log
    # then the GRPO command in every task, with exactly the documented arguments
    records = [json.loads((out / f"argv-rank{r}.json").read_text()) for r in (0, 1)]
    for rank, rec in enumerate(records):
        assert rec["argv"] == ["--config", str(config), "--steps", "2", "--out", str(out)]
        assert rec["RANK"] == str(rank) and rec["WORLD_SIZE"] == "2" and rec["LOCAL_RANK"] == str(rank)
        assert rec["MASTER_ADDR"] == summary["master_addr"] and rec["MASTER_PORT"] == str(summary["master_port"])
    assert [r["MFP8_ROLE"] for r in records] == ["trainer", "rollout"]


@pytest.mark.parametrize(("layout", "ok"), [("0,1", True), ("3", False)], ids=["own-gpu-each", "two-ranks-one-gpu"])
def test_grpo_sbatch_gives_each_rank_its_own_device(slurm_cluster, tmp_path, layout, ok):
    # a fake CUDA_VISIBLE_DEVICES layout (no GPU here): "0,1" -> rank 0 on 0, rank 1 on 1; "3" -> both on 3: refused
    results = tmp_path / "results"
    recorder = tmp_path / "record_argv.py"
    recorder.write_text(RECORDER)
    rc, log = _submit(
        slurm_cluster,
        tmp_path,
        "slurm/grpo.sbatch",
        env={
            "RESULTS_DIR": str(results),
            "REQUIRE_GPU": "0",
            "CUDA_VISIBLE_DEVICES": layout,
            "OUT_DIR": str(tmp_path / "out"),
            "GRPO_CMD": f"{sys.executable} {recorder}",
        },
        sbatch_opts=("--ntasks=2",),
    )
    summary = json.loads((results / "rendezvous.json").read_text())
    if ok:
        assert rc == 0, log
        assert [(d["rank"], d["index"], d["device_id"]) for d in summary["devices"]] == [(0, 0, "0"), (1, 1, "1")]
        assert "device cuda:0 (0)" in log and "device cuda:1 (1)" in log
    else:
        assert rc != 0 and not summary["devices_ok"], log
        assert "would use GPU 3 (cuda:0), already used by rank 0" in log, log
        assert "step: srun" in log and "argv-rank" not in log  # stopped before the GRPO step


def test_grpo_sbatch_refuses_a_hub_id_as_model_before_any_step(slurm_cluster, tmp_path):
    config = tmp_path / "qwen.yaml"
    config.write_text("model:\n  name_or_path: Qwen/Qwen3-8B\n")
    rc, log = _submit(
        slurm_cluster, tmp_path, "slurm/grpo.sbatch", str(config), env={"RESULTS_DIR": str(tmp_path / "r")}
    )
    assert rc != 0
    assert "model 'Qwen/Qwen3-8B' (model.name_or_path) is not a folder" in log and "huggingface-cli download" in log
    assert "step: srun" not in log


@pytest.mark.slow
def test_grpo_sbatch_real_two_step_run(slurm_cluster, tmp_path):
    results = tmp_path / "results"
    rc, log = _submit(
        slurm_cluster,
        tmp_path,
        "slurm/grpo.sbatch",
        env={"RESULTS_DIR": str(results), "REQUIRE_GPU": "0", "STEPS": "2"},
        sbatch_opts=("--ntasks=2",),
        timeout=600,
    )
    assert rc == 0, log
    assert json.loads((results / "rendezvous.json").read_text())["ok"]
    metrics = sorted((results / "grpo").rglob("metrics.jsonl"))
    assert metrics, f"no metrics.jsonl under {results / 'grpo'}\n{log}"
    rows = [json.loads(line) for line in metrics[0].read_text().splitlines() if line.strip()]
    assert rows, f"{metrics[0]} is empty"


TINY_8B_LAYOUT = (
    "model.name_or_path=tiny",
    "policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise",  # the tiny model's TP=2 shards are not 128x128 blocks
    "grpo.num_prompts_per_step=2",  # 8 samples: the claim is the layout, not the batch
    "grpo.num_generations_per_prompt=4",
    "policy.generation.max_new_tokens=16",
    "grpo.val_at_start=false",
    "data.train.data_path=data/math_tiny/train.jsonl",
    "data.validation.data_path=data/math_tiny/validation.jsonl",
    "checkpointing.enabled=false",
    "logger.wandb_enabled=false",
    "logger.tensorboard_enabled=false",
    "rollout.engine=reference",
    "refit.bucket_size_mb=16",
)
"""``configs/qwen3_8b_fp8.yaml`` shrunk to the tiny model; its trainer layout (TP=2, PP=1) is kept."""


def _two_task_fp8_tis_run(slurm_cluster, tmp_path, config: str, overrides: tuple[str, ...]) -> str:
    """``config`` with ``overrides`` through slurm/grpo.sbatch on 2 tasks, 2 steps of the fp8_tis arm; returns the log
    after checking that both steps ran and every refit moved FP8 bytes and verified exactly."""
    rc, log = _submit(
        slurm_cluster,
        tmp_path,
        "slurm/grpo.sbatch",
        config,
        *overrides,
        env={
            "RESULTS_DIR": str(tmp_path / "results"),
            "REQUIRE_GPU": "0",
            "STEPS": "2",
            "OUT_DIR": str(tmp_path / "out"),
        },
        sbatch_opts=("--ntasks=2",),
        timeout=600,
    )
    assert rc == 0, log
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["step"]) for r in rows] == [("fp8_tis", 0), ("fp8_tis", 1)]
    assert all(r["refit_fp8_bytes"] > 0 and r["refit_max_rel_error"] == 0.0 for r in rows)
    return log


@pytest.mark.slow
def test_grpo_sbatch_runs_the_qwen3_8b_config_layout_at_tp2(slurm_cluster, tmp_path):
    """The shipped 8B config's layout (tensor_model_parallel_size 2) through the real Slurm: 2 tasks, one replica."""
    log = _two_task_fp8_tis_run(slurm_cluster, tmp_path, "configs/qwen3_8b_fp8.yaml", TINY_8B_LAYOUT)
    assert "rank 0 of 2" in log and "rank 1 of 2" in log


NEMO_RL_PP2 = "tests/config/data/nemo_rl/examples/configs/recipes/llm/grpo-llama3.1-8b-instruct-1n8g-megatron-fp8-rollouts.v3.yaml"
"""NeMo-RL's own recipe (unchanged test data): pipeline_model_parallel_size 2, train_micro_batch_size 1,
logprob_batch_size 2, activation_checkpointing, use_distributed_optimizer (from its grpo_math_1B.yaml parent)."""
TINY_NEMO_RL = (
    "policy.model_name=tiny",
    "policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise",
    "grpo.num_prompts_per_step=2",  # 8 samples: 8 micro-batches of one sequence through the 2 stages per update
    "grpo.num_generations_per_prompt=4",
    "policy.generation.max_new_tokens=16",
    "grpo.val_at_start=false",
    "policy.train_global_batch_size=8",
    "data.default.prompt_file=null",
    *(f"data.{s}.data_path=data/math_tiny/{s}.jsonl" for s in ("train", "validation")),
    *(f"data.{s}.input_key=problem" for s in ("train", "validation")),
    *(f"data.{s}.output_key=expected_answer" for s in ("train", "validation")),
    "checkpointing.enabled=false",
    "logger.wandb_enabled=false",
    "logger.tensorboard_enabled=false",
    "rollout.engine=reference",
    "grpo.arms=[fp8_tis]",
    "grpo.allow_no_effect=true",  # the recipe's KL penalty, leave-one-out baseline and warm-up (a warning)
)


@pytest.mark.slow
def test_grpo_sbatch_runs_a_nemo_rl_pipeline_parallel_recipe(slurm_cluster, tmp_path):
    """NeMo-RL's Llama-3.1-8B FP8-rollout recipe's trainer layout (PP=2, one sequence per micro-batch, the
    distributed optimizer, full activation recompute) on the tiny model through the real Slurm: 2 tasks, one replica
    of 2 stages."""
    log = _two_task_fp8_tis_run(slurm_cluster, tmp_path, NEMO_RL_PP2, TINY_NEMO_RL)
    assert "trainer layout TP 1 x PP 2 x DP 1, EP 1; rank 1 is pipeline stage 1 of data-parallel replica 0" in log
    assert "activation recompute: full" in log  # the recipe's activation_checkpointing: true
    assert "distributed optimizer: data-parallel rank 0 of 1" in log


@pytest.mark.parametrize(
    ("script", "env", "message"),
    [
        ("slurm/refit_bench.sbatch", {"REQUIRE_GPU": "1"}, "no GPUs on node"),
        ("slurm/test.sbatch", {"CONTAINER_IMAGE": "/nonexistent/megatron-fp8.sqsh"}, "container image file"),
        ("slurm/test.sbatch", {"REQUIRE_GPU": "0", "CONTAINER_MOUNTS": "/nonexistent/ds:/data"}, "mount source"),
    ],
    ids=["no-gpu", "missing-image", "missing-mount"],
)
def test_jobs_fail_fast_with_the_reason(slurm_cluster, tmp_path, script, env, message):
    if env.get("REQUIRE_GPU") == "1" and shutil.which("nvidia-smi"):
        pytest.skip("this node has nvidia-smi: the no-GPU error path cannot be exercised")
    rc, log = _submit(slurm_cluster, tmp_path, script, env={"RESULTS_DIR": str(tmp_path / "results"), **env})
    assert rc != 0, log
    assert message in log and "ERROR" in log, log
    assert "step: srun" not in log  # failed before any work was launched
