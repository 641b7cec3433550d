"""Refit over NCCL between two GPUs (gpu-marked: skips where there is no CUDA)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import datetime, sys, torch, torch.distributed as dist
    from megatron_fp8.refit import DictApplier, RefitReceiver, RefitSender, TorchDistTransport
    from megatron_fp8.refit.synthetic import SPECS, fp8_stream, linear_shapes, synthetic_weights

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    spec = SPECS["tiny"].shrunk(1, num_layers=1)
    items = [(n, t.cuda()) for n, t in fp8_stream(synthetic_weights(spec, seed=3), linear_shapes(spec))]
    transport = TorchDistTransport(src=0, timeout=30)
    if rank == 0:
        RefitSender(transport, bucket_bytes=1 << 20, timeout=30).send(iter(items), version=1)
    else:
        target = {n: torch.zeros_like(t) for n, t in items}
        RefitReceiver(transport, apply=DictApplier(target), timeout=30).receive(first_timeout=60)
        for n, t in items:
            assert target[n].device.type == "cuda", n
            assert torch.equal(target[n].view(torch.uint8), t.view(torch.uint8)), n
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL refuses two ranks on one GPU)")
def test_nccl_refit_two_gpus_byte_exact(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen([sys.executable, "-c", SCRIPT, str(r), str(port)], cwd=REPO, env=env, stderr=subprocess.PIPE)
        for r in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-3000:]
