"""The bandwidth-bound refit benchmark of bench/refit.py (``--link gloo`` on CPU, ``--link nccl`` on two GPUs).

Where the bytes cost (a network link, or loopback TCP for gloo), FP8's halving of the linear weights is physical:
the refit time should follow the payload. This module runs one 2-process group (this process rank 0, the sender;
a spawned rank 1, the receiver with a no-op applier: every bucket validated, nothing copied) and, over the same
pair and the same backend, first measures the link itself: ``count`` plain tensors of ``message_bytes`` sent with
``dist.send`` / ``dist.recv`` (the refit's bucket size, about the BF16 payload in all), closed by a 1-element
acknowledgement, median of ``repeats``. The refit figures then read as a fraction of that bandwidth.

NCCL: rank 0 on ``cuda:0``, rank 1 on ``cuda:1``; needs two GPUs (:func:`nccl_ready` says why not).
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_fp8.refit import CallableApplier, RefitReceiver, RefitSender

Stream = Iterable[tuple[str, torch.Tensor]]
StreamFactory = Callable[[], Stream]
LINKS = ("gloo", "nccl")


@dataclass(frozen=True)
class LinkPlan:
    """What the link measurement sends (both ranks must agree).

    Attributes:
        backend: ``"gloo"`` or ``"nccl"``.
        message_bytes: bytes of one plain tensor (the refit's bucket size).
        count: messages per timed round.
        repeats: timed rounds (the median is reported), after one untimed warm-up round.
    """

    backend: str
    message_bytes: int
    count: int
    repeats: int = 3


def nccl_ready() -> str | None:
    """``None`` when two CUDA GPUs and NCCL are here, else why the NCCL link cannot run."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return f"needs 2 CUDA GPUs, found {n}"
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    return None


def _device(backend: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_link(plan: LinkPlan, *, rank: int) -> dict:
    """Time ``plan.count`` plain ``dist.send``/``dist.recv`` of ``plan.message_bytes`` from rank 0 to rank 1.

    Both ranks call it. Rank 0 times each round from the first send to the receiver's 1-element acknowledgement.

    Returns:
        On rank 0: ``{"backend", "message_bytes", "count", "bytes", "seconds", "seconds_all", "gbps"}`` (bytes
        per round, median seconds, GB/s = 1e9 bytes/s of the median); on rank 1 an empty dict.
    """
    device = _device(plan.backend, rank)
    msg = torch.zeros(plan.message_bytes, dtype=torch.uint8, device=device)
    ack = torch.zeros(1, dtype=torch.uint8, device=device)
    times = []
    for round_ in range(plan.repeats + 1):
        _sync(device)
        start = time.perf_counter()
        for _ in range(plan.count):
            if rank == 0:
                dist.send(msg, dst=1)
            else:
                dist.recv(msg, src=0)
        if rank == 0:
            dist.recv(ack, src=1)
        else:
            dist.send(ack, dst=0)
        _sync(device)
        if round_:  # the first round warms the connection (and NCCL's communicator)
            times.append(time.perf_counter() - start)
    if rank != 0:
        return {}
    nbytes = plan.message_bytes * plan.count
    med = statistics.median(times)
    return {
        "backend": plan.backend,
        "primitive": "send/recv",
        "message_bytes": plan.message_bytes,
        "count": plan.count,
        "bytes": nbytes,
        "seconds": med,
        "seconds_all": times,
        "gbps": nbytes / med / 1e9,
    }


def _init(backend: str, port: int, rank: int, timeout: float) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=timeout * 2),
    )


def receiver_main(port: int, plan: LinkPlan, timeout: float, threads: int) -> None:
    """Rank 1: the link measurement, then receive and validate every refit version until the sender closes."""
    from megatron_fp8.refit import TorchDistTransport

    torch.set_num_threads(threads)
    _init(plan.backend, port, 1, timeout)
    measure_link(plan, rank=1)
    transport = TorchDistTransport(src=0, timeout=timeout, device=_device(plan.backend, 1))
    receiver = RefitReceiver(transport, apply=CallableApplier(lambda version, pairs: None))
    receive_until_closed(receiver, timeout=timeout)
    os._exit(0)


def receive_until_closed(receiver, *, timeout: float) -> None:
    """A receiving rank's loop: one refit version after another, a barrier after each, until the sender closes."""
    from megatron_fp8.errors import TransportClosedError

    while True:
        try:
            receiver.receive(first_timeout=timeout)
        except TransportClosedError:
            return
        dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_link(
    factories: dict[str, StreamFactory],
    *,
    plan: LinkPlan,
    bucket_bytes: int,
    repeats: int,
    timeout: float,
    threads: int,
) -> tuple[dict, dict[str, tuple[list, list[float]]]]:
    """Measure the link, then time every named stream's refit over it (first stream item -> receiver's commit).

    Args:
        factories: stream name -> zero-argument callable returning a fresh stream (on ``cuda:0`` for NCCL).
        plan: the link measurement (its ``backend`` is the refit's).
        bucket_bytes: bucket capacity, bytes.
        repeats: timed refits per stream (one untimed warm-up refit precedes them).
        timeout: per-wait deadline, seconds.
        threads: torch intra-op threads of the receiver process.

    Returns:
        ``(link, {stream name: (send reports, seconds)})``; ``link`` as :func:`measure_link` returns it.
    """
    if dist.is_initialized():
        raise RuntimeError("the link benchmark starts its own 2-rank process group; run it in a fresh process")
    from megatron_fp8.refit import TorchDistTransport

    port = _free_port()
    ctx = torch.multiprocessing.get_context("spawn")
    proc = ctx.Process(target=receiver_main, args=(port, plan, timeout, threads), daemon=True)
    proc.start()
    out: dict[str, tuple[list, list[float]]] = {}
    device = _device(plan.backend, 0)
    try:
        _init(plan.backend, port, 0, timeout)
        link = measure_link(plan, rank=0)
        sender = RefitSender(TorchDistTransport(src=0, timeout=timeout, device=device), bucket_bytes=bucket_bytes)
        version = 0
        for name, factory in factories.items():
            reports, times = [], []
            for i in range(repeats + 1):
                version += 1
                _sync(device)
                start = time.perf_counter()
                report = sender.send(factory(), version=version)
                dist.barrier()  # the receiver has validated and committed
                if i:  # the first refit warms the allocator, the caches and (NCCL) the communicator
                    reports.append(report)
                    times.append(time.perf_counter() - start)
            out[name] = (reports, times)
        sender.close()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
    return link, out


def _stream_bytes(factory: StreamFactory) -> int:
    return sum(t.numel() * t.element_size() for _, t in factory())


def run_link_benchmark(
    *,
    link: str,
    spec_name: str,
    layers: int | None,
    shrink: int,
    bucket_bytes: int,
    repeats: int,
    timeout: float,
    threads: int,
    result: Callable[..., object],
) -> dict:
    """The bandwidth-bound benchmark: BF16 and FP8 (quantized in the bucket) refits of the synthetic Llama set.

    Args:
        link: ``"gloo"`` (CPU, loopback TCP) or ``"nccl"`` (``cuda:0`` -> ``cuda:1``).
        spec_name: a :data:`~megatron_fp8.refit.synthetic.SPECS` name.
        layers: decoder layers (``None``: all of the spec's).
        shrink: widths, heads and vocabulary divided by this.
        bucket_bytes: bucket capacity (and the link measurement's message size), bytes.
        repeats: timed refits per stream and link rounds (medians).
        timeout: per-wait deadline, seconds.
        threads: torch intra-op threads of each process.
        result: bench/refit.py's ``_result(name, transport, reports, times)`` -> ``RunResult``.

    Returns:
        The JSON summary: ``link`` (the measured link), ``runs`` (each with ``pct_of_link``), payload ratios (all
        bytes; the FP8 parameters alone), ``time_ratio_fp8_over_bf16``, the target (payload ratio + 0.05) and
        whether it was met; or ``{"skipped": why}`` when the link cannot run here.
    """
    from dataclasses import asdict

    from megatron_fp8.refit.synthetic import bf16_stream, fp8_stream, get_spec, linear_shapes, synthetic_weights

    if link == "nccl" and (why := nccl_ready()) is not None:
        return {"link": link, "skipped": why}
    base = get_spec(spec_name)
    spec = base.shrunk(shrink, num_layers=base.num_layers if layers is None else min(layers, base.num_layers))
    device = _device(link, 0)
    weights = synthetic_weights(spec, seed=0, include_rest=True, device=device)
    fp8_names = set(linear_shapes(spec))
    factories: dict[str, StreamFactory] = {
        "bf16": lambda: bf16_stream(weights),
        "fp8": lambda: fp8_stream(weights, fp8_names, in_bucket=True),
    }
    bf16_bytes = _stream_bytes(factories["bf16"])
    plan = LinkPlan(link, bucket_bytes, max(1, -(-bf16_bytes // bucket_bytes)), repeats)
    measured, timed = bench_link(
        factories, plan=plan, bucket_bytes=bucket_bytes, repeats=repeats, timeout=timeout, threads=threads
    )
    runs = {name: result(name, link, reports, times) for name, (reports, times) in timed.items()}
    bf16, fp8 = runs["bf16"], runs["fp8"]
    payload_ratio = fp8.total_bytes / bf16.total_bytes
    fp8_param = {k: sum(v for c, v in r.payload_bytes.items() if c in ("fp8", "scales")) for k, r in runs.items()}
    bf16_param = sum(weights[n].numel() * weights[n].element_size() for n in fp8_names)
    time_ratio = fp8.seconds / bf16.seconds
    return {
        "what_ran": (
            f"{spec_name}, {spec.num_layers} of {base.num_layers} layers, widths / {shrink}, with embeddings/norms/"
            f"lm_head, over {link} ({'loopback TCP, CPU' if link == 'gloo' else 'cuda:0 -> cuda:1'}), "
            f"{threads} thread(s)"
        ),
        "spec": asdict(spec),
        "bucket_bytes": bucket_bytes,
        "repeats": repeats,
        "threads": threads,
        "link": measured,
        "runs": [asdict(r) | {"pct_of_link": 100 * r.gbps / measured["gbps"]} for r in runs.values()],
        "payload_ratio": payload_ratio,
        "payload_ratio_fp8_params": fp8_param["fp8"] / bf16_param,
        "time_ratio_fp8_over_bf16": time_ratio,
        "link_floor_seconds": {k: r.total_bytes / measured["gbps"] / 1e9 for k, r in runs.items()},
        "target_time_ratio": payload_ratio + 0.05,
        "meets_target": time_ratio <= payload_ratio + 0.05,
    }


def print_link_summary(summary: dict) -> None:
    """The link benchmark as a few lines (bench scripts print their tables)."""
    if "skipped" in summary:
        print(f"refit over {summary['link']}: skipped ({summary['skipped']})")
        return
    lk = summary["link"]
    print(f"refit, bandwidth-bound: {summary['what_ran']}")
    print(
        f"  link ({lk['backend']} {lk['primitive']}, {lk['count']} x {lk['message_bytes'] / 2**20:.1f} MiB): "
        f"{lk['gbps']:.3f} GB/s ({lk['seconds']:.3f} s per {lk['bytes'] / 1e6:.1f} MB)"
    )
    for r in summary["runs"]:
        print(
            f"  {r['stream']:>4}: {r['total_bytes'] / 1e6:9.1f} MB in {r['num_buckets']:3d} buckets, {r['seconds']:.3f} s, "
            f"{r['gbps']:.3f} GB/s = {r['pct_of_link']:.0f}% of the link (floor {summary['link_floor_seconds'][r['stream']]:.3f} s)"
        )
    print(
        f"  FP8/BF16 time {summary['time_ratio_fp8_over_bf16']:.3f}  payload {summary['payload_ratio']:.3f} "
        f"(FP8 params alone {summary['payload_ratio_fp8_params']:.3f}); target <= payload + 0.05 = "
        f"{summary['target_time_ratio']:.3f}: {'met' if summary['meets_target'] else 'NOT met'}"
    )
