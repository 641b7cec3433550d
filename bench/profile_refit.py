"""Where one refit's time goes on a GPU: a torch profile of one BF16 and one FP8 inproc refit of the 8B set.

    python bench/profile_refit.py --out bench/results/refit_profile_cuda.json   # on a CUDA machine

Per stream it prints wall seconds, the GPU's busy time (sum of kernel and memcpy times), the number of launches,
the timeline (host work before the first device op and after the last, device idle time in the refit's window),
the device's longest idle gaps with the host ops that ran in them (``device_gaps``),
the kernels and host-side ops that cost most, and (one more refit under cProfile) the Python functions that take
the sender's and the receiver's thread time; the JSON holds the same. The unprofiled wall is the median of
``--repeats`` refits, which also give each side's thread CPU time (``thread_cpu_s``: a side whose CPU time is far
below the wall is waiting, on the GPU, the other thread or the GIL) and, alternated with as many refits at a short
GIL switch interval, ``gil_switch_interval`` (whether the handoff between the two threads waits on the GIL). On
CPU (``--device cpu --smoke``) it runs the same code on the 1-layer /8 shapes so that the script is checked without a
GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import logging
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

import _refit_device as dev  # bench/ is the script's own folder
import torch
from torch.profiler import ProfilerActivity, profile

from megatron_fp8.refit import InProcTransport, RefitReceiver, RefitSender, default_bucket_bytes
from megatron_fp8.refit.synthetic import (
    bf16_stream,
    fp8_stream,
    get_spec,
    linear_shapes,
    synthetic_weights,
)

log = logging.getLogger("bench.profile_refit")


def _top_functions(prof: cProfile.Profile, top: int) -> list[str]:
    """The ``top`` Python functions by own time (pstats lines)."""
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = buf.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return [line.rstrip() for line in lines[start:] if line.strip()]


def _one_refit(
    factory,
    *,
    device: torch.device,
    bucket_bytes: int,
    applier,
    version: int,
    python: dict | None = None,
    cpu: dict | None = None,
) -> float:
    """One inproc refit (sender here, receiver on a thread); its wall seconds. ``python``: filled with each side's
    top functions under cProfile. ``cpu``: filled with each side's thread CPU seconds (``time.thread_time``)."""
    transport = InProcTransport(maxsize=2, timeout=600)
    receiver = RefitReceiver(transport, apply=applier)
    sender = RefitSender(transport, bucket_bytes=bucket_bytes, device=device)
    errors: list[BaseException] = []

    # Python < 3.12: a cProfile.Profile sees the thread that enabled it, so each side gets its own. From 3.12 one
    # profiler at a time is allowed and it sees every thread (sys.monitoring): one profile of the process.
    per_thread = sys.version_info < (3, 12)
    profs: dict[str, cProfile.Profile] = {}
    if python is not None:
        profs = (
            {"sender": cProfile.Profile(), "receiver": cProfile.Profile()}
            if per_thread
            else {"process": cProfile.Profile()}
        )
    mine = profs.get("receiver") if per_thread else None

    def receive() -> None:
        if mine is not None:
            mine.enable()
        t0 = time.thread_time()
        try:
            receiver.receive(first_timeout=600)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            if cpu is not None:
                cpu["receiver"] = time.thread_time() - t0
            if mine is not None:
                mine.disable()

    th = threading.Thread(target=receive)
    dev.sync(device)
    main_prof = profs.get("sender" if per_thread else "process")
    start = time.perf_counter()
    if main_prof is not None and not per_thread:
        main_prof.enable()
    th.start()
    if main_prof is not None and per_thread:
        main_prof.enable()
    t0 = time.thread_time()
    try:
        sender.send(factory(), version=version)
    finally:
        if cpu is not None:
            cpu["sender"] = time.thread_time() - t0
        if main_prof is not None and per_thread:
            main_prof.disable()
        th.join()
        if main_prof is not None and not per_thread:
            main_prof.disable()
    dev.sync(device)
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    for side, prof in profs.items():
        python[side] = _top_functions(prof, 15)
    return wall


def _runner(factory, *, device: torch.device, bucket_bytes: int, applier):
    """``run(**kw)``: one :func:`_one_refit` of ``factory``'s stream, each call with the next version (1, 2, ...)."""
    versions = itertools.count(1)

    def run(**kw) -> float:
        return _one_refit(factory, device=device, bucket_bytes=bucket_bytes, applier=applier,
                          version=next(versions), **kw)  # fmt: skip

    return run


SHORT_SWITCH_INTERVAL_S = 0.0002
"""The GIL switch interval compared with Python's default (5 ms): how long a thread that wants the GIL waits before
asking the holder to drop it. The inproc refit hands buckets between two threads, so a long interval can leave the
GPU waiting on a thread that waits for the GIL."""


def _unprofiled(run, repeats: int) -> tuple[dict, dict]:
    """``repeats`` unprofiled refits at Python's switch interval, then ``repeats`` at a short one, alternating.

    Returns:
        ``({"wall_s", "thread_cpu_s": {"sender", "receiver"}}`` medians at the default interval,
        ``{"default_s", "short_s", "wall_s_default", "wall_s_short"}`` (every wall, seconds)).
    """
    default = sys.getswitchinterval()
    walls: dict[float, list[float]] = {default: [], SHORT_SWITCH_INTERVAL_S: []}
    cpus: list[dict] = []
    try:
        for _ in range(repeats):
            for interval, ws in walls.items():
                sys.setswitchinterval(interval)
                cpu: dict = {}
                ws.append(run(cpu=cpu))
                if interval == default:
                    cpus.append(cpu)
    finally:
        sys.setswitchinterval(default)
    plain = {
        "wall_s": statistics.median(walls[default]),
        "thread_cpu_s": {side: statistics.median(c[side] for c in cpus) for side in ("sender", "receiver")},
    }
    gil = {
        "default_s": default,
        "short_s": SHORT_SWITCH_INTERVAL_S,
        "wall_s_default": walls[default],
        "wall_s_short": walls[SHORT_SWITCH_INTERVAL_S],
    }
    return plain, gil


def _union(intervals) -> list[list[float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint ``[start, end]`` spans."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def timeline(host: list[tuple[float, float]], device: list[tuple[float, float]]) -> dict:
    """Where the device waited on the host in one profiled refit, from event intervals (microseconds).

    Args:
        host: ``(start, end)`` of every host-side op of the refit (its span is the refit's window).
        device: ``(start, end)`` of every kernel and memcpy on the device.

    Returns:
        ``window_ms`` (first host op to last), ``head_ms`` (window start to the first device activity: the host
        work before the GPU has anything to do), ``tail_ms`` (last device activity to window end: what the host
        does after the GPU is done, e.g. the receiver settling and committing), ``device_idle_ms`` (the window
        minus the union of device intervals, head and tail included); all 0 without device events.
    """
    if not host or not device:
        return {"window_ms": 0.0, "head_ms": 0.0, "tail_ms": 0.0, "device_idle_ms": 0.0}
    w0, w1 = min(a for a, _ in host), max(b for _, b in host)
    busy = sum(b - a for a, b in _union((max(a, w0), min(b, w1)) for a, b in device if b > w0 and a < w1))
    first = min(a for a, _ in device)
    last = max(b for _, b in device)
    return {
        "window_ms": (w1 - w0) / 1e3,
        "head_ms": max(0.0, first - w0) / 1e3,
        "tail_ms": max(0.0, w1 - last) / 1e3,
        "device_idle_ms": (w1 - w0 - busy) / 1e3,
    }


def device_gaps(
    host: list[tuple[float, float, str, int]], device: list[tuple[float, float]], *, top: int = 8, min_us: float = 20.0
) -> dict:
    """The device's idle gaps inside the refit's window (microsecond intervals) and what the host ran in the longest.

    Args:
        host: ``(start, end, op name, thread id)`` of every host op (nested ops included).
        device: ``(start, end)`` of every kernel and copy.
        top: how many of the longest gaps to describe.
        min_us: gaps shorter than this are only counted as idle time by :func:`timeline`, not listed.

    Returns:
        ``count`` and ``total_ms`` of the gaps of at least ``min_us`` between two device intervals, ``over_1ms``,
        and ``longest``: per gap ``at_ms`` (from the window's start), ``ms``, and ``host``: the host ops overlapping
        it, by overlap (``name``, ``thread``: ``t0``, ``t1``... in order of first appearance, ``ms``), at most 5.
        Head and tail (before the first and after the last device activity) are :func:`timeline`'s.
    """
    if not host or not device:
        return {"count": 0, "total_ms": 0.0, "over_1ms": 0, "longest": []}
    w0 = min(a for a, *_ in host)
    gaps = [(b0, a1) for (_, b0), (a1, _) in itertools.pairwise(_union(device)) if a1 - b0 >= min_us]
    threads: dict[int, str] = {}
    for *_, tid in sorted(host):
        threads.setdefault(tid, f"t{len(threads)}")
    longest = []
    for g0, g1 in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        overlap: dict[tuple[str, str], float] = {}
        for a, b, name, tid in host:
            o = min(b, g1) - max(a, g0)
            if o > 0:
                overlap[name, threads[tid]] = overlap.get((name, threads[tid]), 0.0) + o
        ops = sorted(overlap.items(), key=lambda kv: -kv[1])[:5]
        longest.append({
            "at_ms": (g0 - w0) / 1e3,
            "ms": (g1 - g0) / 1e3,
            "host": [{"name": n[:60], "thread": t, "ms": o / 1e3} for (n, t), o in ops],
        })  # fmt: skip
    return {
        "count": len(gaps),
        "total_ms": sum(b - a for a, b in gaps) / 1e3,
        "over_1ms": sum(1 for a, b in gaps if b - a >= 1000.0),
        "longest": longest,
    }


def _timeline_of(prof) -> tuple[dict, dict]:
    host, device = [], []
    for e in prof.events():
        span = (e.time_range.start, e.time_range.end)
        if e.device_type == torch.autograd.DeviceType.CUDA:
            device.append(span)
        elif e.device_type == torch.autograd.DeviceType.CPU and not e.name.startswith("Activity Buffer"):
            host.append((*span, e.name, e.thread))
    return timeline([(a, b) for a, b, *_ in host], device), device_gaps(host, device)


def _summarize(prof, wall: float, use_cuda: bool, top: int) -> dict:
    events = prof.key_averages()
    device_rows, host_rows = [], []
    busy_us, launches = 0.0, 0
    for e in events:
        dev_us = getattr(e, "self_device_time_total", 0.0) or 0.0
        if use_cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            busy_us += dev_us
            launches += e.count
            device_rows.append({"name": e.key[:90], "count": e.count, "ms": dev_us / 1e3})
        elif e.device_type == torch.autograd.DeviceType.CPU:
            host_rows.append({"name": e.key[:90], "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3})
    device_rows.sort(key=lambda r: -r["ms"])
    host_rows.sort(key=lambda r: -r["self_cpu_ms"])
    line, gaps = _timeline_of(prof)
    return {
        "wall_s": wall,
        "timeline": line,
        "device_gaps": gaps,
        "gpu_busy_ms": busy_us / 1e3,
        "device_launches": launches,
        "top_device": device_rows[:top],
        "top_host": host_rows[:top],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="1 layer, widths / 8 (CPU check of the script)")
    ap.add_argument("--applier", default="noop", choices=("noop", "dict"))
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument(
        "--repeats", type=int, default=5, help="unprofiled refits per GIL switch interval (medians; default 5)"
    )
    ap.add_argument("--trace", default=None, help="also write a Chrome trace of the FP8 refit here")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    use_cuda = device.type == "cuda"
    spec = get_spec("llama-3.1-8b")
    spec = spec.shrunk(8, num_layers=1) if args.smoke else spec.shrunk(1, num_layers=args.layers)
    bucket_bytes = (1 << 20) if args.smoke else default_bucket_bytes(device)
    weights = synthetic_weights(spec, seed=0, include_rest=True, device=device)
    fp8_names = set(linear_shapes(spec))
    factories = {
        "bf16": lambda: bf16_stream(weights),
        "fp8": lambda: fp8_stream(weights, fp8_names, in_bucket=True),  # as GRPO and bench/refit.py send it
    }
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    out: dict = {"device": torch.cuda.get_device_name(0) if use_cuda else "cpu", "layers": spec.num_layers}
    for name, factory in factories.items():
        applier = dev.make_applier(args.applier, dev.target_spec(factory) if args.applier == "dict" else None, device)
        run = _runner(factory, device=device, bucket_bytes=bucket_bytes, applier=applier)
        run()  # warm-up
        plain, gil = _unprofiled(run, args.repeats)
        with profile(activities=activities) as prof:
            wall = run()
        if args.trace and name == "fp8":
            prof.export_chrome_trace(args.trace)
        python: dict = {}
        py_wall = run(python=python)
        out[name] = {"unprofiled_wall_s": plain["wall_s"], "thread_cpu_s": plain["thread_cpu_s"]}
        out[name].update(_summarize(prof, wall, use_cuda, args.top), gil_switch_interval=gil)
        out[name]["python"] = {"wall_s": py_wall, **python}
        s = out[name]
        tl = s["timeline"]
        log.info(
            "== %s: %.4f s unprofiled, %.4f s profiled, GPU busy %.2f ms, %d launches; host before the first "
            "device op %.2f ms, after the last %.2f ms, device idle %.2f ms of %.2f",
            name,
            s["unprofiled_wall_s"],
            wall,
            s["gpu_busy_ms"],
            s["device_launches"],
            tl["head_ms"],
            tl["tail_ms"],
            tl["device_idle_ms"],
            tl["window_ms"],
        )
        cpu, gil = s["thread_cpu_s"], s["gil_switch_interval"]
        log.info(
            "   thread CPU: sender %.2f ms, receiver %.2f ms of %.2f ms wall; wall at GIL switch interval %g s: "
            "%.2f ms, at %g s: %.2f ms (medians of %d)",
            cpu["sender"] * 1e3,
            cpu["receiver"] * 1e3,
            s["unprofiled_wall_s"] * 1e3,
            gil["default_s"],
            statistics.median(gil["wall_s_default"]) * 1e3,
            gil["short_s"],
            statistics.median(gil["wall_s_short"]) * 1e3,
            len(gil["wall_s_short"]),
        )
        gaps = s["device_gaps"]
        log.info("   device gaps >= 20 us: %d, %.2f ms in all, %d over 1 ms", gaps["count"], gaps["total_ms"],
                 gaps["over_1ms"])  # fmt: skip
        for g in gaps["longest"][:4]:
            log.info("     at %.2f ms, %.3f ms: %s", g["at_ms"], g["ms"],
                     ", ".join(f"{h['name']} ({h['thread']}, {h['ms']:.3f})" for h in g["host"]))  # fmt: skip
        for r in s["top_device"]:
            log.info("   dev %8.3f ms x%-5d %s", r["ms"], r["count"], r["name"])
        for r in s["top_host"]:
            log.info("   cpu %8.3f ms x%-5d %s", r["self_cpu_ms"], r["count"], r["name"])
        for side in [k for k in ("sender", "receiver", "process") if k in s["python"]]:
            log.info("   python, %s (cProfile, %.4f s refit):", side, s["python"]["wall_s"])
            for line in s["python"][side][:16]:
                log.info("     %s", line[:150])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
