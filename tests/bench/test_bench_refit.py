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
