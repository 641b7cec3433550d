"""bench/profile_refit.py's timeline: host work before the first device op and after the last, and device idle time,
computed from event intervals (the figures docs/gpu.md read off a trace by hand)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def timeline():
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("profile_refit").timeline
    finally:
        sys.path.remove(str(BENCH))


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
