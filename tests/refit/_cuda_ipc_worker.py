"""Receiver process of the CUDA IPC refit test (imported by test_cuda_ipc.py, run via spawn)."""

from __future__ import annotations

import torch

from megatron_fp8.errors import TransportClosedError
from megatron_fp8.refit import CudaIpcTransport, DictApplier, RefitReceiver


def receiver_main(data_queue, ack_queue, result_queue, shapes: dict) -> None:
    torch.cuda.set_device(0)
    targets = {n: torch.zeros(shape, dtype=getattr(torch, dt), device="cuda") for n, (shape, dt) in shapes.items()}
    applier = DictApplier(targets)
    transport = CudaIpcTransport(data_queue, ack_queue, role="receiver", timeout=60.0)
    receiver = RefitReceiver(transport, apply=applier)
    report = receiver.receive()
    got = {n: t.cpu().reshape(-1).view(torch.uint8).clone() for n, t in targets.items()}
    try:
        receiver.receive(timeout=60.0)
        closed = False
    except TransportClosedError:
        closed = True
    result_queue.put({"version": applier.version, "buckets": report.num_buckets, "closed": closed, "bytes": got})
