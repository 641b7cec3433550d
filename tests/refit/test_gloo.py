"""Multi-process refit over gloo: 1 sender + 2 receivers, a killed sender, a stalled sender."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fp8.errors import ConfigError
from megatron_fp8.refit import make_transport

WORKER = Path(__file__).with_name("_gloo_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, scenario: str, world: int, timeout: float = 5.0) -> list[dict]:
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs, outs = [], []
    for rank in range(world):
        out = tmp_path / f"{scenario}_{rank}.json"
        outs.append(out)
        cmd = [
            sys.executable,
            str(WORKER),
            "--rank",
            str(rank),
            "--world",
            str(world),
            "--port",
            str(port),
            "--scenario",
            scenario,
            "--timeout",
            str(timeout),
            "--out",
            str(out),
        ]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        for rank in range(1, world):
            _, err = procs[rank].communicate(timeout=90)
            assert procs[rank].returncode == 0, err.decode()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
                p.wait(timeout=30)
    return [json.loads(o.read_text()) for o in outs]


def test_broadcast_to_two_receivers_exact(tmp_path):
    sender, *receivers = _run(tmp_path, "broadcast", world=3)
    assert sender["v1_buckets"] > 2  # several buckets, so the double buffer and prefetch are used
    for r in receivers:
        assert r["v1_exact"] and r["v2_exact"] and r["closed"], r
        assert r["v1_buckets"] == sender["v1_buckets"]


def test_killed_sender_times_out_and_keeps_last_version(tmp_path):
    timeout = 4.0
    _sender, receiver = _run(tmp_path, "kill", world=2, timeout=timeout)
    assert receiver["error"] == "TransportTimeoutError", receiver
    assert "sender rank 0" in receiver["message"] and "bucket" in receiver["message"]
    assert receiver["elapsed"] < timeout + 3.0
    assert receiver["still_v1"] and receiver["applier_version"] == 1 and receiver["aborted"]


def test_stalled_sender_times_out_within_deadline(tmp_path):
    timeout = 2.0
    _sender, receiver = _run(tmp_path, "stall", world=2, timeout=timeout)
    assert receiver["error"] == "TransportTimeoutError", receiver
    assert "sender rank 0" in receiver["message"]
    assert timeout - 0.5 <= receiver["elapsed"] < timeout + 3.0
    assert receiver["still_v1"] and receiver["applier_version"] == 1


@pytest.mark.parametrize("name", ["nccl"])
def test_registry_refuses_backend_mismatch_without_group(name):
    with pytest.raises(ConfigError, match="init_process_group"):
        make_transport(name, src=0)
