"""The transport registry and the in-process transport."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_fp8.errors import ConfigError, RefitAbortedError, TransportClosedError, TransportTimeoutError
from megatron_fp8.refit import FACTORIES, TRANSPORTS, InProcTransport, make_transport, pack_buckets


def _buckets(n_tensors=3, version=1):
    return list(
        pack_buckets(
            [(f"t{i}", torch.full((64,), float(i))) for i in range(n_tensors)], version=version, bucket_bytes=256
        )
    )


def test_registry_lists_valid_names():
    assert set(TRANSPORTS) == {"inproc", "gloo", "nccl", "cuda_ipc"}
    with pytest.raises(ConfigError, match=r"unknown refit transport 'tcp'.*cuda_ipc.*gloo.*inproc.*nccl"):
        make_transport("tcp")
    assert isinstance(make_transport("inproc", maxsize=2, timeout=1.0), InProcTransport)


def test_registry_covers_the_vocabulary():
    assert set(FACTORIES) == set(TRANSPORTS)


def test_inproc_delivers_same_objects_in_order_and_counts():
    t = InProcTransport(maxsize=8, timeout=1.0)
    sent = _buckets()
    for b in sent:
        t.send(b)
    assert t.buckets_sent == 3 and t.bytes_sent == sum(b.nbytes for b in sent)
    got = [t.recv() for _ in sent]
    assert got == sent and t.buckets_received == 3


def test_inproc_timeouts_do_not_hang():
    t = InProcTransport(maxsize=1, timeout=0.05)
    start = time.monotonic()
    with pytest.raises(TransportTimeoutError, match="no bucket arrived"):
        t.recv()
    b0, b1, _ = _buckets()
    t.send(b0)
    with pytest.raises(TransportTimeoutError, match="did not take bucket 1 of version 1"):
        t.send(b1)
    assert time.monotonic() - start < 2.0


def test_inproc_abort_and_close():
    t = InProcTransport(maxsize=4, timeout=0.5)
    t.send_abort(7, 2, "NonFiniteError: tensor 'w'")
    with pytest.raises(RefitAbortedError, match="version 7 at bucket 2.*'w'") as info:
        t.recv()
    assert info.value.version == 7 and t.aborts_sent == 1
    t.close()
    with pytest.raises(TransportClosedError):
        t.recv()
    with pytest.raises(TransportClosedError):
        t.send(_buckets()[0])


def test_bad_options():
    with pytest.raises(ConfigError, match="timeout"):
        InProcTransport(timeout=0)
    with pytest.raises(ConfigError, match="maxsize"):
        InProcTransport(maxsize=0)
    with pytest.raises(ConfigError, match="init_process_group"):
        make_transport("gloo", src=0)
