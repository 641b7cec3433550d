"""bench/refit.py in smoke mode: it runs both transports and reports the FP8 payload ratio."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_refit_smoke(tmp_path):
    out = tmp_path / "refit.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "bench/refit.py", "--smoke", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    for key in (
        "what_ran",
        "spec",
        "layers",
        "threads",
        "bucket_bytes",
        "fp8_params",
        "payload_ratio_fp8_params",
        "rest_bf16_bytes",
        "quantize_seconds",
        "runs",
        "time_ratio_fp8_over_bf16",
        "streamed_fp8_param_bytes",
    ):
        assert key in summary, key
    assert {(r["transport"], r["stream"]) for r in summary["runs"]} == {
        (t, s) for t in ("inproc", "gloo") for s in ("bf16", "fp8")
    }
    for r in summary["runs"]:
        assert {"seconds", "gbps", "total_bytes", "payload_bytes", "num_buckets", "num_tensors"} <= set(r)
    # the ratio is fixed by the shapes: N*K FP8 bytes + 4 bytes per 128x128 block, over 2*N*K BF16 bytes
    spec = summary["spec"]
    h, i = spec["hidden_size"], spec["intermediate_size"]
    kv = spec["num_kv_heads"] * h // spec["num_heads"]
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
    fp8 = sum(n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128) for n, k in shapes) * summary["layers"]
    bf16 = sum(2 * n * k for n, k in shapes) * summary["layers"]
    assert summary["fp8_params"]["fp8_plus_scale_bytes"] == fp8 and summary["fp8_params"]["bf16_bytes"] == bf16
    assert summary["payload_ratio_fp8_params"] == fp8 / bf16 <= 0.5002
    # what went through the transports matches the accounting
    assert summary["streamed_fp8_param_bytes"] == {"bf16": bf16, "fp8": fp8}
    by = {(r["transport"], r["stream"]): r for r in summary["runs"]}
    for t in ("inproc", "gloo"):
        assert by[(t, "bf16")]["total_bytes"] - by[(t, "fp8")]["total_bytes"] == bf16 - fp8
    # the traffic floor (bench/_refit_bytes.py) of the in-memory transport: the sender reads the BF16 set whatever it
    # sends; the payload is written once and read once per side for the checksums
    source = by[("inproc", "bf16")]["total_bytes"]
    assert source == bf16 + summary["rest_bf16_bytes"]
    for s in ("bf16", "fp8"):
        r = by[("inproc", s)]
        assert r["floor"]["device_bytes"] == source + 3 * r["total_bytes"] and r["floor"]["link_bytes"] == 0
        assert r["floor_s"] == r["floor"]["device_bytes"] / summary["copy_gbps"] / 1e9
        assert r["pct_of_floor"] == 100 * r["floor_s"] / r["seconds"]
        assert "floor_s" not in by[("gloo", s)]  # over a link its bandwidth bounds the refit (the --link mode)
    assert summary["floor_ratio_fp8_over_bf16"] == {
        "inproc": by[("inproc", "fp8")]["floor_s"] / by[("inproc", "bf16")]["floor_s"]
    }
    assert summary["d2h_gbps"] is None  # measured on a GPU, for the host staging's link


def _run_link(tmp_path, link: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / f"refit_link_{link}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "bench/refit.py", "--link", link, "--smoke", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_bench_refit_link_smoke_over_gloo(tmp_path):
    """The bandwidth-bound mode: the link measured over the same pair, both refits over it (no timing asserts)."""
    proc, summary = _run_link(tmp_path, "gloo")
    link = summary["link"]
    assert link["backend"] == "gloo" and link["primitive"] == "send/recv"
    assert link["message_bytes"] == summary["bucket_bytes"] and link["bytes"] == link["count"] * link["message_bytes"]
    assert link["gbps"] == link["bytes"] / link["seconds"] / 1e9 > 0
    by = {r["stream"]: r for r in summary["runs"]}
    assert set(by) == {"bf16", "fp8"} and {r["transport"] for r in summary["runs"]} == {"gloo"}
    assert link["bytes"] >= by["bf16"]["total_bytes"] > link["bytes"] - link["message_bytes"]  # ~ the BF16 payload
    for r in by.values():
        assert r["pct_of_link"] == 100 * r["gbps"] / link["gbps"]
        assert summary["link_floor_seconds"][r["stream"]] == r["total_bytes"] / link["gbps"] / 1e9
    # the payload ratio is fixed by the shapes: the 7 linears of every layer as FP8 + 4 bytes per 128x128 block
    spec = summary["spec"]
    assert spec["num_layers"] == 4 and spec["hidden_size"] == 4096 // 8
    h, i = spec["hidden_size"], spec["intermediate_size"]
    kv = spec["num_kv_heads"] * h // spec["num_heads"]
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
    fp8 = sum(n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128) for n, k in shapes) * spec["num_layers"]
    bf16 = sum(2 * n * k for n, k in shapes) * spec["num_layers"]
    assert by["bf16"]["total_bytes"] - by["fp8"]["total_bytes"] == bf16 - fp8
    assert summary["payload_ratio"] == by["fp8"]["total_bytes"] / by["bf16"]["total_bytes"]
    assert summary["payload_ratio_fp8_params"] == fp8 / bf16
    assert summary["time_ratio_fp8_over_bf16"] == by["fp8"]["seconds"] / by["bf16"]["seconds"]
    assert summary["target_time_ratio"] == summary["payload_ratio"] + 0.05
    assert "FP8/BF16 time" in proc.stdout and "of the link" in proc.stdout


def test_bench_refit_link_over_nccl_says_why_it_cannot_run(tmp_path):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        _, summary = _run_link(tmp_path, "nccl")
        assert summary["link"]["backend"] == "nccl" and {r["transport"] for r in summary["runs"]} == {"nccl"}
        return
    proc, summary = _run_link(tmp_path, "nccl")
    assert summary["skipped"].startswith("needs 2 CUDA GPUs, found") and "skipped" in proc.stdout
