"""Receiver process of the CUDA IPC refit test (imported by test_cuda_ipc.py, run via spawn)."""

from __future__ import annotations

import torch

from megatron_fp8.errors import TransportClosedError
from megatron_fp8.refit import CudaIpcTransport, DictApplier, RefitReceiver


def receiver_main(data_queue, ack_queue, result_queue, shapes: dict, done=None) -> None:
    """Receive one version over CUDA IPC into CUDA targets; report plain ``bytes`` (never shared tensors).

    A CPU tensor put in a ``torch.multiprocessing`` queue travels as a shared-memory file descriptor that the
    parent can only open while this process is alive: the report carries Python ``bytes`` instead, and the
    process waits for ``done`` (set by the parent after it read the report) before it exits.
    """
    torch.cuda.set_device(0)
    targets = {n: torch.zeros(shape, dtype=getattr(torch, dt), device="cuda") for n, (shape, dt) in shapes.items()}
    applier = DictApplier(targets)
    transport = CudaIpcTransport(data_queue, ack_queue, role="receiver", timeout=60.0)
    receiver = RefitReceiver(transport, apply=applier)
    report = receiver.receive()
    got = {n: t.cpu().reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in targets.items()}
    try:
        receiver.receive(timeout=60.0)
        closed = False
    except TransportClosedError:
        closed = True
    result_queue.put({"version": applier.version, "buckets": report.num_buckets, "closed": closed, "bytes": got})
    if done is not None:
        done.wait(120)
