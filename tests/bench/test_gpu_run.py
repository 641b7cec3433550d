"""bench/gpu_run.sh, the one command a GPU session runs, works end to end (smoke sizes, on this CPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_run_smoke_writes_every_result(tmp_path):
    env = dict(os.environ, GPU_RUN_SMOKE="1", RESULTS=str(tmp_path), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", "bench/gpu_run.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {k: v["rc"] for k, v in summary.items() if k != "smoke"} == {
        "gpu_tests": 0,
        "quant_cuda": 0,
        "refit_cuda": 0,
        "refit_profile_cuda": 0,
        "refit_host_cuda": 0,
        "refit_link_gloo": 0,
        "refit_link_nccl": 0,
        "sass_sm90": 0,
    }
    refit = json.loads((tmp_path / "refit_cuda.json").read_text())
    assert refit["copy_gbps"] > 0 and set(refit["ops_per_bucket"]) == {"bf16", "fp8"}
    for r in refit["runs"]:
        assert r["pct_of_copy"] > 0 and r["ops"]["sender"]["host_reads_per_bucket"] <= 1.0
        assert (r["receiver_tail_s"] is not None) == (r["transport"] == "inproc")
        assert r["receiver_tail_s"] is None or 0 <= r["receiver_tail_s"] < max(r["seconds_all"])
    assert (tmp_path / "quant_cuda.json").exists() and (tmp_path / "gpu_tests.xml").exists()
    sass = json.loads((tmp_path / "sass_sm90.json").read_text())
    assert sass["arch"] == "sm_90" and all(r["registers"] > 0 for r in sass["kernels"])
    profile = json.loads((tmp_path / "refit_profile_cuda.json").read_text())
    assert set(profile) >= {"bf16", "fp8"} and profile["fp8"]["wall_s"] > 0 and profile["fp8"]["top_host"]
    assert set(profile["fp8"]["timeline"]) == {"window_ms", "head_ms", "tail_ms", "device_idle_ms"}
    assert set(profile["fp8"]["device_gaps"]) == {"count", "total_ms", "over_1ms", "longest"}
    for stream in ("bf16", "fp8"):
        cpu, gil = profile[stream]["thread_cpu_s"], profile[stream]["gil_switch_interval"]
        assert 0 < cpu["sender"] and 0 < cpu["receiver"], cpu
        assert gil["short_s"] < gil["default_s"] and len(gil["wall_s_short"]) == len(gil["wall_s_default"]) == 5
        assert sorted(gil["wall_s_default"])[2] == profile[stream]["unprofiled_wall_s"]
    host = json.loads((tmp_path / "refit_host_cuda.json").read_text())
    assert {(r["applier"], r["stream"]) for r in host["runs"]} == {
        (a, s) for a in ("noop", "host", "device") for s in ("bf16", "fp8")
    }
    assert {r["transport"] for r in host["runs"]} == {"inproc"} and set(host["time_ratio_fp8_over_bf16"]) == {
        "inproc/noop",
        "inproc/host",
        "inproc/device",
    }
    assert set(host["floor_ratio_fp8_over_bf16"]) == set(host["time_ratio_fp8_over_bf16"])
    for r in host["runs"]:  # on a CPU the buckets are the staged version and the rollback source: no host copy
        assert "host copy write" not in r["floor"]["passes"] and "host copy read" not in r["floor"]["passes"]
        assert ("verify read" in r["floor"]["passes"]) == (r["applier"] == "device")
    link = json.loads((tmp_path / "refit_link_gloo.json").read_text())
    assert link["link"]["gbps"] > 0 and {r["stream"] for r in link["runs"]} == {"bf16", "fp8"}
    nccl = json.loads((tmp_path / "refit_link_nccl.json").read_text())
    import torch

    assert "skipped" in nccl if torch.cuda.device_count() < 2 else nccl["link"]["backend"] == "nccl"


def test_gpu_run_step_timeout_stops_a_step_and_runs_the_next(tmp_path):
    """GPU_RUN_STEP_TIMEOUT bounds a step (exit 124 in summary.json) and the later steps still run."""
    env = dict(
        os.environ,
        GPU_RUN_SMOKE="1",
        RESULTS=str(tmp_path),
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
        # per-step overrides: every step but quant_cuda stopped after 1 s (the whole smoke run is the test above's);
        # quant_cuda, after a stopped step and before six more, runs under the 300 s default
        GPU_RUN_STEP_TIMEOUT=(
            "300 gpu_tests:1 refit_cuda:1 refit_profile_cuda:1 refit_host_cuda:1 refit_link_gloo:1 refit_link_nccl:1 "
            "sass_sm90:1"
        ),
    )
    proc = subprocess.run(["bash", "bench/gpu_run.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gpu_tests"]["rc"] == 124 and proc.returncode == 124, proc.stdout[-2000:]
    assert summary["quant_cuda"]["rc"] == 0
    stopped = ("refit_cuda", "refit_profile_cuda", "refit_host_cuda", "refit_link_gloo", "refit_link_nccl", "sass_sm90")
    assert {summary[k]["rc"] for k in stopped} == {124}


def test_gpu_run_refuses_without_cuda_unless_smoke(tmp_path):
    import torch

    if torch.cuda.is_available():
        return  # on a GPU machine the real run is what bench/gpu_run.sh does
    env = dict(os.environ, RESULTS=str(tmp_path), PYTHON=sys.executable)
    env.pop("GPU_RUN_SMOKE", None)
    proc = subprocess.run(["bash", "bench/gpu_run.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no CUDA device here" in proc.stderr


def test_every_json_result_and_machine_txt_can_be_committed():
    """The run's JSON results and machine.txt are what a GPU session commits: none may be git-ignored (a
    directory rule above the re-includes once hid every new `bench/results/*` file)."""
    script = (REPO / "bench" / "gpu_run.sh").read_text()
    names = sorted(set(re.findall(r'--out "\$results/([\w.]+\.json)"', script))) + ["machine.txt"]
    assert len(names) >= 7, names
    paths = [f"bench/results/{n}" for n in names]
    proc = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and not proc.stdout, f"git-ignored results: {proc.stdout.split()}"
