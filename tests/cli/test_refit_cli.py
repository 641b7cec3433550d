"""``megatron-fp8 refit`` end to end: Megatron (CPU) -> vLLM manifest -> FP8 refit -> verified engine."""

from __future__ import annotations

import json

import _warm_cli
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.megatron, pytest.mark.vllm]


@pytest.mark.parametrize("transport", ["inproc", "gloo"])
def test_refit_cli_json(transport, tmp_path):
    proc = _warm_cli.run(  # a process of its own, forked by the suite's warm launcher
        [
            "refit",
            "--model",
            "tiny",
            "--compare-bf16",
            "--repeats",
            "2",
            "--transport",
            transport,
            "--json",
        ],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["verified"] is True
    assert out["manifest_source"].startswith("vllm-quant-method ")
    assert out["fp8_params"] == 28
    # 28 FP8 weights = 2,359,296 elements: 2 bytes -> 1 byte each, plus one float32 per 128x128 block (144)
    assert out["bf16_payload_bytes_same_params"] == 2 * 2_359_296
    assert out["fp8_payload_bytes"] == 2_359_296 + 4 * 144
    assert out["payload_ratio_fp8_over_bf16"] <= 0.5002
    assert 0 < out["max_rel_weight_error"] < 0.05  # FP8 e4m3 rounding, not a stale or broken weight
    assert out["time_ratio_fp8_over_bf16"] > 0
    assert len(out["runs"]["fp8"]["generated"]) == 8
