"""bench/quant.py --smoke runs and writes the documented JSON (keys, not timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "quant.py"

ROW_KEYS = {
    "shape", "elements", "bytes_moved", "torch_ms", "torch_gbs", "naive_ms", "speedup_vs_naive", "bytes_equal_naive", "reference_ms", "speedup_vs_reference",
    "bytes_equal_reference", "triton_ms", "triton_gbs", "pct_of_copy", "triton_api_ms", "copy_same_size_gbs",
    "bytes_equal_torch", "best_config", "triton_api_defer_ms", "api_over_kernel", "api_defer_over_kernel",
    "torchao_ms", "torchao_gbs",
}  # fmt: skip
TOP_KEYS = {
    "schema", "mode", "device", "cpu_threads", "torch_version", "triton_version", "cuda_version", "python_version",
    "dtype", "block_size", "scale_format", "smoke", "target_pct_of_copy", "copy_bandwidth_gbs", "shapes",
    "layer_set", "notes",
}  # fmt: skip
LAYER_KEYS = {
    "model", "per_layer", "layers", "layers_full_model", "matrices", "elements", "bytes_moved", "torch_ms",
    "torch_gbs", "triton_ms", "triton_gbs", "pct_of_copy", "triton_api_ms",
}  # fmt: skip


@pytest.fixture(scope="module")
def smoke_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "sub" / "quant.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"wrote {out}" in proc.stdout
    return json.loads(out.read_text())


def test_top_level_keys(smoke_result):
    assert set(smoke_result) == TOP_KEYS
    assert smoke_result["smoke"] is True and smoke_result["schema"] == 1
    assert smoke_result["mode"] in ("cpu", "cuda")
    assert smoke_result["torch_version"] and smoke_result["dtype"] == "bfloat16"
    assert smoke_result["block_size"] == [128, 128] and smoke_result["target_pct_of_copy"] == 92.0


def test_rows(smoke_result):
    rows = smoke_result["shapes"]
    assert [r["shape"] for r in rows] == [[256, 384], [130, 200]]
    for r in rows:
        assert set(r) == ROW_KEYS
        n, k = r["shape"]
        # bf16 read + fp8 write + float32 scales
        assert r["bytes_moved"] == 2 * n * k + n * k + 4 * (-(-n // 128)) * (-(-k // 128))
        assert r["torch_ms"] > 0
        if smoke_result["mode"] == "cpu":
            assert r["bytes_equal_reference"] is True and r["speedup_vs_reference"] > 0
            assert r["bytes_equal_naive"] is True and r["speedup_vs_naive"] > 0
            assert r["triton_ms"] is None
        else:
            assert r["bytes_equal_torch"] is True and r["pct_of_copy"] > 0


def test_layer_set(smoke_result):
    ls = smoke_result["layer_set"]
    assert set(ls) == LAYER_KEYS
    assert ls["layers"] == 2 and ls["layers_full_model"] == 32 and ls["matrices"] == 14
    assert set(ls["per_layer"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert ls["torch_ms"] > 0


def test_bad_layers_argument_is_rejected(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--layers", "0", "--out", str(tmp_path / "x.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "--layers must be >= 1" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_the_fastest_same_bytes_setting_is_named_next_to_the_refits(bench_module):
    """What a GPU run's ``layer_set.grouped_best`` says: the fastest timed variant whose bytes were the default
    kernel's (a faster one with other bytes, or one that failed to compile, is passed over), and the refit's own
    setting (``INTO_BUCKET_*``) at its warps, found by its options."""
    quant = bench_module("quant")
    ls = {"grouped_ms": 7.0, "grouped_pct_of_copy": 70.0}
    for name in quant.LEAN_VARIANTS:
        ls[f"grouped_ms_{name}_by_num_warps"] = {"4": 9.0, "8": 6.5, "16": 7.0}
        ls[f"grouped_{name}_same_bytes"] = True
    ls["grouped_ms_lean_by_num_warps"]["8"] = 6.44
    ls["grouped_ms_lean_recip_only_chunks4_by_num_warps"]["8"] = 4.9
    ls["grouped_ms_lean_recip_only_amax_bits_unmasked_chunks8_by_num_warps"] = {"4": "failed: X", "8": 4.0, "16": 5.0}
    ls["grouped_lean_recip_only_amax_bits_unmasked_chunks8_same_bytes"] = False  # faster, but other bytes
    best = quant.best_grouped_setting(ls)
    assert (best["variant"], best["num_warps"], best["ms"]) == ("lean_recip_only_chunks4", 8, 4.9)
    assert best["pct_of_copy"] == pytest.approx(100.0)  # 7.0 ms was 70%
    assert best["refit"] == {"variant": "lean", "num_warps": 8, "ms": 6.44}
    assert best["speedup_over_refit"] == pytest.approx(6.44 / 4.9)
    for name in quant.LEAN_VARIANTS:
        ls[f"grouped_{name}_same_bytes"] = False
    assert quant.best_grouped_setting(ls) is None
