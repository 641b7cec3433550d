"""bench/engine_checks.py: the engine's value check of a host-staged version, timed against the rule it replaced."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def ec(bench_module):
    return bench_module("engine_checks")


@pytest.mark.parametrize("arm", ["fp8", "bf16"])
def test_the_version_is_the_engines_and_finite(ec, arm):
    from megatron_fp8.refit.synthetic import get_spec

    spec = get_spec("tiny")
    items, expected = ec.engine_version(spec, arm=arm)
    assert sum(t.numel() * t.element_size() for _, t in items) == ec.set_bytes(spec, arm=arm)
    dtypes = {str(t.dtype) for _, t in items}
    assert ("torch.float8_e4m3fn" in dtypes) == (arm == "fp8")
    from megatron_fp8.rollout.vllm.expected import validate_version

    validate_version(items, expected, partial=False)  # finite values: the check passes, as in a healthy run
    assert ec.previous_rule(items, expected)


def test_the_baseline_refuses_what_the_engine_refuses(ec):
    """The baseline must be a real check: a NaN code in one weight fails it too."""
    from megatron_fp8.refit.synthetic import get_spec

    items, expected = ec.engine_version(get_spec("tiny"), arm="fp8")
    weight = next(t for _, t in items if t.dtype == torch.float8_e4m3fn)
    weight.view(torch.uint8).view(-1)[-1] = 0xFF
    assert not ec.previous_rule(items, expected)


def test_smoke_run_writes_every_arm_and_thread_count(ec, tmp_path):
    out = tmp_path / "ec.json"
    assert ec.main(["--smoke", "--threads", "1,2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["arm"], r["threads"]) for r in result["runs"]] == [("fp8", 1), ("fp8", 2), ("bf16", 1), ("bf16", 2)]
    for r in result["runs"]:
        assert r["now_s"] > 0 and r["previous_s"] > 0 and r["read_floor_s"] > 0
        assert r["speedup_over_previous"] == pytest.approx(r["previous_s"] / r["now_s"])
        assert r["full_set_bytes"] == r["bytes"]  # the tiny spec is measured whole
    assert any("| arm |" in line for line in ec.table(result))
