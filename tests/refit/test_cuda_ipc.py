"""CUDA IPC refit to a colocated receiver process (GPU only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.refit import CudaIpcTransport, RefitSender, make_transport


def test_cuda_ipc_needs_cuda_or_valid_role():
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match="valid roles"):
            CudaIpcTransport(None, None, role="both")
    else:
        with pytest.raises(ConfigError, match="needs CUDA"):
            make_transport("cuda_ipc", data_queue=None, ack_queue=None, role="sender")


@pytest.mark.gpu
def test_cuda_ipc_refit_is_exact():
    sys.path.insert(0, str(Path(__file__).parent))
    import _cuda_ipc_worker  # lazy: importable only once this folder is on sys.path (spawned receiver)

    gen = torch.Generator(device="cuda").manual_seed(0)
    items = [
        (
            "model.layers.0.mlp.down_proj.weight",
            torch.randn(384, 256, device="cuda", generator=gen).to(torch.float8_e4m3fn),
        ),
        ("model.layers.0.mlp.down_proj.weight_scale_inv", torch.rand(3, 2, device="cuda", generator=gen)),
        ("model.norm.weight", torch.randn(256, device="cuda", generator=gen).to(torch.bfloat16)),
    ]
    shapes = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in items}
    ctx = torch.multiprocessing.get_context("spawn")
    data_q, ack_q = CudaIpcTransport.make_queues()
    result_q = ctx.Queue()
    done = ctx.Event()
    proc = ctx.Process(target=_cuda_ipc_worker.receiver_main, args=(data_q, ack_q, result_q, shapes, done))
    proc.start()
    try:
        transport = CudaIpcTransport(data_q, ack_q, role="sender", timeout=60.0)
        sender = RefitSender(transport, bucket_bytes=64 * 1024, device="cuda")
        report = sender.send(items, version=1)
        sender.close()
        result = result_q.get(timeout=120)
    finally:
        done.set()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert report.num_buckets >= 2 and result["buckets"] == report.num_buckets
    assert result["version"] == 1 and result["closed"]
    for name, t in items:
        assert result["bytes"][name] == t.cpu().reshape(-1).view(torch.uint8).numpy().tobytes(), name
