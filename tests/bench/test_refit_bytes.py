"""bench/_refit_bytes.py: the passes a refit must make inside one memory, and the floor they put under FP8/BF16."""

from __future__ import annotations

import math

import pytest

from megatron_fp8.refit.synthetic import bf16_rest_shapes, get_spec, linear_shapes


@pytest.fixture(scope="module")
def rb(bench_module):
    return bench_module("_refit_bytes")


def _llama_8b_bytes() -> tuple[int, int]:
    """(BF16 bytes, FP8 payload bytes) of the whole Llama-3.1-8B set, from its shapes alone (nothing allocated)."""
    spec = get_spec("llama-3.1-8b")
    linear = linear_shapes(spec)
    rest = sum(2 * math.prod(s) for s in bf16_rest_shapes(spec).values())
    bf16 = sum(2 * n * k for n, k in linear.values()) + rest
    fp8 = sum(n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128) for n, k in linear.values()) + rest
    return bf16, fp8


def test_the_passes_of_each_applier(rb):
    s, p = 1000, 560
    noop = rb.refit_traffic(source_bytes=s, payload_bytes=p, applier="noop", on_gpu=True)
    assert noop.passes == (
        ("source read", s),
        ("bucket write", p),
        ("sender checksum read", p),
        ("receiver checksum read", p),
    )
    assert noop.device_bytes == s + 3 * p and noop.link_bytes == 0
    dict_ = rb.refit_traffic(source_bytes=s, payload_bytes=p, applier="dict", on_gpu=True)
    assert dict_.device_bytes == s + 5 * p and dict_.passes[-2:] == (("apply read", p), ("apply write", p))
    gpu_host = rb.refit_traffic(source_bytes=s, payload_bytes=p, applier="host", on_gpu=True)
    assert gpu_host.device_bytes == s + 4 * p and gpu_host.link_bytes == p
    cpu_host = rb.refit_traffic(source_bytes=s, payload_bytes=p, applier="host", on_gpu=False)
    assert cpu_host.device_bytes == s + 3 * p and cpu_host.link_bytes == 0  # the buckets kept: no copy
    gpu_device = rb.refit_traffic(source_bytes=s, payload_bytes=p, applier="device", on_gpu=True)
    assert gpu_device.device_bytes == s + 9 * p and gpu_device.link_bytes == 0  # snapshot, load, compare: no link
    assert rb.refit_traffic(source_bytes=s, payload_bytes=p, applier="device", on_gpu=False) == gpu_device
    with pytest.raises(ValueError, match="unknown applier 'engine'"):
        rb.refit_traffic(source_bytes=s, payload_bytes=p, applier="engine", on_gpu=True)


def test_the_floor_is_the_slower_of_memory_and_link(rb):
    t = rb.refit_traffic(source_bytes=10**9, payload_bytes=10**9, applier="host", on_gpu=True)  # 5 GB, 1 GB
    assert t.seconds(copy_gbps=1000.0, link_gbps=50.0) == pytest.approx(1 / 50)  # the link: 20 ms > 5 ms
    assert t.seconds(copy_gbps=100.0, link_gbps=1000.0) == pytest.approx(5 / 100)  # the memory
    with pytest.raises(ValueError, match="cross a link"):
        t.seconds(copy_gbps=1000.0)
    with pytest.raises(ValueError, match="copy_gbps must be > 0"):
        t.seconds(copy_gbps=0.0, link_gbps=1.0)
    with pytest.raises(ValueError, match=">= 0"):
        rb.Traffic((("source read", -1),))


def test_run_fields_and_ratios(rb):
    runs = [
        {"transport": t, "applier": "noop", "stream": s, "total_bytes": n, "seconds": sec}
        for t in ("inproc", "gloo")
        for s, n, sec in (("bf16", 1000, 0.002), ("fp8", 600, 0.0015))
    ]
    runs = [r | rb.floor_fields(r, source_bytes=1000, copy_gbps=1.0, link_gbps=None, on_gpu=False) for r in runs]
    inproc = {r["stream"]: r for r in runs if r["transport"] == "inproc"}
    assert inproc["bf16"]["floor_s"] == pytest.approx(4000 / 1e9) and inproc["fp8"]["floor_s"] == pytest.approx(
        2800 / 1e9
    )
    assert inproc["bf16"]["pct_of_floor"] == pytest.approx(100 * 4000e-9 / 0.002)
    assert inproc["fp8"]["floor"]["passes"]["source read"] == 1000
    assert all("floor_s" not in r for r in runs if r["transport"] == "gloo")  # a link bounds those instead
    assert rb.floor_ratios(runs, keyed_by_applier=False) == {"inproc": pytest.approx(0.7)}
    assert set(rb.floor_ratios(runs, keyed_by_applier=True)) == {"inproc/noop"}


def test_the_8b_set_cannot_reach_0_65_in_one_gpu_without_an_applier(rb):
    """Issue 37 asked for FP8/BF16 <= 0.65 on every path; its floor arithmetic assumed an FP8 payload of half the
    BF16 one, but embed_tokens and lm_head stay BF16: the payload is 0.5655 of BF16's and the no-op floor is 0.674."""
    bf16, fp8 = _llama_8b_bytes()
    assert bf16 == 16_060_522_496 and fp8 / bf16 == pytest.approx(0.5655, abs=1e-4)

    def ratio(applier: str, **bw) -> float:
        f = rb.refit_traffic(source_bytes=bf16, payload_bytes=fp8, applier=applier, on_gpu=True).seconds(**bw)
        b = rb.refit_traffic(source_bytes=bf16, payload_bytes=bf16, applier=applier, on_gpu=True).seconds(**bw)
        return f / b

    assert ratio("noop", copy_gbps=4000.0) == pytest.approx((1 + 3 * fp8 / bf16) / 4) == pytest.approx(0.6742, abs=1e-4)
    assert ratio("noop", copy_gbps=4000.0) > 0.65
    assert ratio("dict", copy_gbps=4000.0) == pytest.approx(0.6380, abs=1e-4)
    # host staging on an H200 (~51 GB/s device -> host measured): the link bounds it, the floor is the payload ratio
    assert ratio("host", copy_gbps=4000.0, link_gbps=51.0) == pytest.approx(fp8 / bf16)
