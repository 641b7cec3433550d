"""Device-side helpers of bench/refit.py: copy bandwidth, op/sync counts, appliers, and the CUDA IPC transport.

Kept apart so that bench/refit.py stays the table + JSON driver. Nothing here needs vLLM, Megatron or TE:
a bare GPU machine (torch + Triton) runs all of it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterable

import torch

from megatron_fp8.refit import (
    CallableApplier,
    DictApplier,
    InProcTransport,
    RefitReceiver,
    RefitSender,
    fused_fill,
    multi,
)
from megatron_fp8.refit.opcount import OpCounter

Stream = Iterable[tuple[str, torch.Tensor]]
StreamFactory = Callable[[], Stream]
TargetSpec = list[tuple[str, tuple[int, ...], str]]
APPLIERS = ("noop", "dict", "host", "device")
TARGETED = ("dict", "device")
"""The appliers that write into targets of the stream's shapes (:func:`target_spec`)."""
"""``noop``: buckets fully validated (checksums, announced set), nothing copied; ``dict``: :class:`DictApplier` into
targets on the device (values checked, backup for rollback, one multi-tensor copy, read back and compared); ``host``:
the receiver's host staging as vLLM's applier gets it (every bucket's values probed for NaN/Inf where it arrived and
the bucket copied into pinned host memory, the version kept there until the commit), without an engine to load it
into (in-process only); ``device``: GRPO's colocated refit kept on the device, as vLLM's applier of an in-process
worker loaded in place gets it (vLLM 0.11, the image's; an engine whose shards take their parts): the buckets kept as
the staged version, values probed there; at the commit a snapshot of the targets (the engine's weights) on the device,
the version loaded into them by one multi-tensor copy, the targets compared with the staged bytes on the device (no
host copy of anything)."""


class HostStagingApplier:
    """Keeps the version the receiver staged in host memory for it, as vLLM's applier does, and drops it at the
    commit: what a GRPO refit into vLLM pays before vLLM's own load (:func:`megatron_fp8.refit.applier.keeps_host_copies`).
    """

    keeps_host_copies = True
    accepts_checked_values = True  # as vLLM's: the receiver probes NaN/Inf on the device (part of what this pays)

    def __init__(self) -> None:
        self.staged: list[tuple[str, torch.Tensor]] = []

    def values_checked(self, version: int) -> None:
        """The receiver found no NaN/Inf in the version (vLLM's workers then skip their host pass)."""

    def begin(self, version: int, metas) -> None:
        self.staged = []

    def stage(self, name: str, tensor: torch.Tensor, *, owned: bool = False) -> None:
        self.staged.append((name, tensor if owned else tensor.to("cpu", copy=True)))

    def commit(self, version: int) -> None:
        self.staged = []

    def abort(self, version: int, reason: str) -> None:
        self.staged = []


class DeviceStagingApplier:
    """GRPO's colocated refit kept on the device, without vLLM: the receiver stages the version on the buckets' GPU
    for it (its ``staging_device``); the commit does what the vLLM worker of an in-place engine does with it (snapshot
    the weights for a rollback, load, exact verification), into plain device targets (in-process only).

    Args:
        targets: name -> the tensor a load writes (the engine's weights), on ``device``.
        device: the staging device.
    """

    accepts_checked_values = True

    def __init__(self, targets: dict[str, torch.Tensor], device: torch.device) -> None:
        self.targets = targets
        self.staging_device = device
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.snapshot_bytes = 0

    def values_checked(self, version: int) -> None:
        """The receiver found no NaN/Inf in the version."""

    def begin(self, version: int, metas) -> None:
        self.staged = []

    def stage(self, name: str, tensor: torch.Tensor, *, owned: bool = False) -> None:
        self.staged.append((name, tensor if owned else tensor.to(self.staging_device, copy=True)))

    def commit(self, version: int) -> None:
        held = [self.targets[n] for n, _ in self.staged]
        sent = [t for _, t in self.staged]
        fused = fused_fill.runs_on(held + sent)  # the grouped Triton passes on CUDA, torch's multi-tensor ops else
        snapshot = multi.snapshot(held)  # the rollback source of an in-place engine (rollback.EngineSnapshot's copy)
        fused_fill.copy_many(held, sent) if fused else multi.copy_into(held, sent)
        bad = bool(fused_fill.compare_many(held, sent).any()) if fused else multi.first_mismatch(held, sent) is not None
        if bad:
            raise RuntimeError(f"refit v{version}: a target differs from what was staged after the load")
        self.snapshot_bytes = sum(t.numel() * t.element_size() for t in snapshot)
        self.staged = []

    def abort(self, version: int, reason: str) -> None:
        self.staged = []


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_gbps(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """The device's copy bandwidth: bytes read + written per second by ``dst.copy_(src)``, GB/s (median).

    The same convention as bench/quant.py (an H100 80GB reads ~3.0 TB/s here): a refit's payload GB/s over this
    figure is its share of what the memory system can move.
    """
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return 2 * nbytes / _median_copy_s(torch.empty_like(src), src, device, repeats) / 1e9


def _median_copy_s(dst: torch.Tensor, src: torch.Tensor, device: torch.device, repeats: int) -> float:
    """Median seconds of ``dst.copy_(src)`` (non-blocking, waited for), after one untimed copy."""
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def d2h_gbps(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> float | None:
    """The device -> host link's bandwidth: bytes per second into pinned host memory, GB/s (median); ``None`` off a
    GPU. The link the receiver's host staging (``host`` applier) crosses with every bucket."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _median_copy_s(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), src, device, repeats) / 1e9


def target_spec(factory: StreamFactory) -> TargetSpec:
    """``[(name, shape, dtype name)]`` of one pass of the stream (what a :class:`DictApplier` must hold)."""
    return [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in factory()]


def make_applier(kind: str, spec: TargetSpec | None, device: torch.device):
    """The receiver-side applier of a run: ``noop``, a ``dict`` over zero targets of ``spec`` on ``device``, or ``host``."""
    if kind == "noop":
        return CallableApplier(lambda version, pairs: None)
    if kind == "host":
        return HostStagingApplier()
    if kind == "device":
        assert spec is not None
        targets = {n: torch.zeros(shape, dtype=getattr(torch, dt), device=device) for n, shape, dt in spec}
        return DeviceStagingApplier(targets, device)
    if kind == "dict":
        assert spec is not None
        targets = {n: torch.zeros(shape, dtype=getattr(torch, dt), device=device) for n, shape, dt in spec}
        return DictApplier(targets)
    raise SystemExit(f"unknown applier {kind!r}; valid: {list(APPLIERS)}")


def count_ops(factory: StreamFactory, *, bucket_bytes: int, applier, device: torch.device) -> dict:
    """One inproc refit of the stream with an :class:`OpCounter` on each side: compute ops and host reads per bucket."""
    transport = InProcTransport(maxsize=2, timeout=600)
    sender = RefitSender(transport, bucket_bytes=bucket_bytes, device=device)
    receiver = RefitReceiver(transport, apply=applier)
    box: dict = {}

    def receive() -> None:
        with OpCounter() as c:
            try:
                receiver.receive(first_timeout=600)
            except BaseException as exc:  # surfaced below
                box["error"] = exc
        box["receiver"] = c.counts

    version = getattr(applier, "version", 0) + 1
    th = threading.Thread(target=receive)
    th.start()
    with OpCounter() as c:
        report = sender.send(factory(), version=version)
    th.join()
    if "error" in box:
        raise box["error"]
    buckets = report.num_buckets
    out = {"buckets": buckets, "tensors": report.num_tensors}
    for side, counts in (("sender", c.counts), ("receiver", box["receiver"])):
        out[side] = {
            "compute_ops_per_bucket": counts.num_compute / buckets,
            "host_reads_per_bucket": counts.num_host_reads / buckets,
            "dispatches_per_tensor": counts.dispatches / max(report.num_tensors, 1),
            **counts.to_dict(),
        }
    return out


def ipc_receiver_main(data_q, ack_q, spec, applier_kind: str, timeout: float, result_q) -> None:
    """Receiver process of the CUDA IPC benchmark: apply every version until the sender closes."""
    from megatron_fp8.errors import TransportClosedError
    from megatron_fp8.refit import CudaIpcTransport

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    receiver = RefitReceiver(
        CudaIpcTransport(data_q, ack_q, role="receiver", timeout=timeout),
        apply=make_applier(applier_kind, spec, device),
    )
    n = 0
    try:
        while True:
            try:
                receiver.receive(first_timeout=timeout)
                n += 1
            except TransportClosedError:
                break
        result_q.put({"versions": n})
    except BaseException as exc:  # reported to the parent, which raises
        result_q.put({"error": f"{type(exc).__name__}: {exc}"})


def bench_cuda_ipc(
    factories: dict[str, StreamFactory],
    *,
    applier_kind: str,
    bucket_bytes: int,
    repeats: int,
    timeout: float,
    result: Callable,
) -> list:
    """Each stream over CUDA IPC to a receiver process on the same GPU, timed to the receiver's commit."""
    from megatron_fp8.refit import CudaIpcTransport

    ctx = torch.multiprocessing.get_context("spawn")
    device = torch.device("cuda", 0)
    out = []
    for name, factory in factories.items():
        spec = target_spec(factory) if applier_kind == "dict" else None
        data_q, ack_q = CudaIpcTransport.make_queues()
        result_q = ctx.Queue()
        proc = ctx.Process(
            target=ipc_receiver_main, args=(data_q, ack_q, spec, applier_kind, timeout, result_q), daemon=True
        )
        proc.start()
        try:
            sender = RefitSender(
                CudaIpcTransport(data_q, ack_q, role="sender", timeout=timeout),
                bucket_bytes=bucket_bytes,
                device=device,
            )
            reports, times = [], []
            for version in range(1, repeats + 2):  # version 1 warms up (CUDA context, IPC handles, Triton compile)
                sync(device)
                start = time.perf_counter()
                report = sender.send(factory(), version=version)
                sync(device)
                if version > 1:
                    reports.append(report)
                    times.append(time.perf_counter() - start)
            sender.close()
            got = result_q.get(timeout=timeout)
            if "error" in got:
                raise RuntimeError(f"CUDA IPC receiver: {got['error']}")
        finally:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        out.append(result(name, "cuda_ipc", reports, times, applier_kind))
    return out
