"""bench/profile_refit.py's timeline: host work before the first device op and after the last, and device idle time,
computed from event intervals (the figures docs/gpu.md read off a trace by hand)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def module(bench_module):
    return bench_module("profile_refit")


@pytest.fixture(scope="module")
def timeline(module):
    return module.timeline


def test_head_tail_and_idle_of_a_refit(timeline):
    host = [(0.0, 100.0), (1000.0, 1500.0), (9000.0, 12000.0)]  # the window: 0 .. 12000 us
    device = [(2000.0, 5000.0), (4000.0, 6000.0), (7000.0, 9000.0)]  # busy 2000-6000 and 7000-9000: 6000 us
    t = timeline(host, device)
    assert t == {"window_ms": 12.0, "head_ms": 2.0, "tail_ms": 3.0, "device_idle_ms": 6.0}


def test_device_work_outside_the_window_is_cut_to_it(timeline):
    t = timeline([(100.0, 200.0)], [(0.0, 150.0), (180.0, 400.0)])  # a device op that started before the refit's
    assert t["window_ms"] == pytest.approx(0.1) and t["device_idle_ms"] == pytest.approx(0.03)
    assert t["head_ms"] == 0.0 and t["tail_ms"] == 0.0


def test_no_device_events_give_zeros(timeline):
    assert timeline([(0.0, 5.0)], []) == {"window_ms": 0.0, "head_ms": 0.0, "tail_ms": 0.0, "device_idle_ms": 0.0}


def test_the_longest_device_gaps_name_the_host_ops_that_ran_in_them(module):
    # device busy 0-1000, 1010-2000 (a 10 us gap: idle, not listed), 5000-6000 (a 3 ms gap), 6500-7000 (0.5 ms)
    device = [(0.0, 1000.0), (1010.0, 2000.0), (5000.0, 6000.0), (6500.0, 7000.0)]
    host = [
        (0.0, 7000.0, "refit", 11),  # the whole window, on the sender's thread
        (2100.0, 4900.0, "cudaEventSynchronize", 22),  # the receiver waits inside the 3 ms gap
        (2000.0, 2500.0, "aten::cat", 11),
        (6000.0, 6400.0, "aten::view", 11),
    ]
    g = module.device_gaps(host, device, top=8, min_us=20.0)
    assert g["count"] == 2 and g["total_ms"] == pytest.approx(3.5) and g["over_1ms"] == 1
    first, second = g["longest"]
    assert first["at_ms"] == pytest.approx(2.0) and first["ms"] == pytest.approx(3.0)
    assert first["host"] == [
        {"name": "refit", "thread": "t0", "ms": pytest.approx(3.0)},
        {"name": "cudaEventSynchronize", "thread": "t1", "ms": pytest.approx(2.8)},
        {"name": "aten::cat", "thread": "t0", "ms": pytest.approx(0.5)},
    ]
    assert second["ms"] == pytest.approx(0.5) and [h["name"] for h in second["host"]] == ["refit", "aten::view"]
    assert module.device_gaps(host, [], top=8) == {"count": 0, "total_ms": 0.0, "over_1ms": 0, "longest": []}
