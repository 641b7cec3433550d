"""End-to-end refits over the in-process transport: atomicity, faults, versions, memory, the sender told."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from megatron_fp8.errors import NonFiniteError, RefitAbortedError, RefitError, RefitRefusedError
from megatron_fp8.refit import (
    DictApplier,
    InProcTransport,
    RefitReceiver,
    RefitSender,
    pack_buckets,
)
from megatron_fp8.refit.synthetic import SPECS, fp8_stream, linear_shapes, synthetic_weights

SPEC = SPECS["tiny"]  # ~1.3 M parameters: ~2.6 MB BF16, ~1.7 MB on the wire with FP8 linears
BUCKET = 128 * 1024


def _model(seed: int) -> list[tuple[str, torch.Tensor]]:
    weights = synthetic_weights(SPEC, seed=seed)
    items = list(fp8_stream(weights, linear_shapes(SPEC)))
    items += [
        (f"model.layers.{i}.self_attn.attn.k_scale", torch.tensor(0.5 + seed, dtype=torch.float32))
        for i in range(SPEC.num_layers)
    ]
    return items


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _holds(applier: DictApplier, items) -> bool:
    return all(_bytes_equal(applier.tensors[n], t) for n, t in items)


def _send_in_thread(sender, items, version, reports=None):
    errors: list[BaseException] = []

    def run():
        try:
            report = sender.send(items, version=version)
            if reports is not None:
                reports.append(report)
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    th = threading.Thread(target=run)
    th.start()
    return th, errors


def _refit(sender, receiver, items, version):
    """Send on a thread (send() waits for the receiver's outcome), receive here; both reports."""
    reports: list = []
    th, errors = _send_in_thread(sender, items, version, reports)
    try:
        received = receiver.receive()
    finally:
        th.join()
    if errors:
        raise errors[0]
    return reports[0], received


@pytest.fixture
def engine():
    """A transport, a receiver over a DictApplier holding version 1, and version 1's tensors."""
    transport = InProcTransport(maxsize=64, timeout=2.0)
    v1 = _model(1)
    targets = {n: torch.zeros_like(t) for n, t in v1}
    applier = DictApplier(targets)
    receiver = RefitReceiver(transport, apply=applier)
    sender = RefitSender(transport, bucket_bytes=BUCKET)
    sent, _ = _refit(sender, receiver, v1, 1)
    assert _holds(applier, v1) and applier.version == 1
    assert [o.status for o in sent.outcomes] == ["committed"]
    return transport, sender, receiver, applier, v1


def test_refit_applies_in_place_and_reports(engine):
    transport, sender, receiver, applier, _ = engine
    storages = {n: t.untyped_storage().data_ptr() for n, t in applier.tensors.items()}
    v2 = _model(2)
    th, errors = _send_in_thread(sender, v2, 2)
    report = receiver.receive()
    th.join()
    assert not errors and _holds(applier, v2) and receiver.version == 2
    assert {n: t.untyped_storage().data_ptr() for n, t in applier.tensors.items()} == storages  # copy_, no rebinding
    assert report.num_tensors == len(v2) and report.num_buckets > 1


def test_send_report_classes():
    transport = InProcTransport(maxsize=64, timeout=1.0)
    items = _model(3)
    receiver = RefitReceiver(transport, apply=DictApplier({n: torch.zeros_like(t) for n, t in items}))
    report, _ = _refit(RefitSender(transport, bucket_bytes=BUCKET), receiver, items, 1)
    fp8 = sum(t.nbytes for n, t in items if t.dtype == torch.float8_e4m3fn)
    scales = sum(t.nbytes for n, t in items if n.endswith(("_scale_inv", "_scale")))
    bf16 = sum(t.nbytes for n, t in items if t.dtype == torch.bfloat16)
    assert dict(report.payload_bytes) == {"fp8": fp8, "scales": scales, "bf16": bf16, "other": 0}
    assert report.num_tensors == len(items) and report.num_buckets == transport.buckets_sent
    assert report.wire_bytes >= report.total_bytes and report.to_dict()["gbps"] >= 0


def test_nan_in_first_bucket_never_reaches_the_wire(engine):
    transport, sender, receiver, applier, v1 = engine
    sent_before = transport.buckets_sent
    bad = _model(2)
    name, w = bad[0]
    w = w.clone()
    w.view(torch.uint8)[3, 7] = 0x7F  # the e4m3 NaN encoding
    bad[0] = (name, w)
    with pytest.raises(NonFiniteError, match=name):
        sender.send(bad, version=2)
    assert transport.buckets_sent == sent_before  # nothing of version 2 went on the wire
    with pytest.raises(RefitAbortedError, match="NonFiniteError"):
        receiver.receive()
    assert _holds(applier, v1) and applier.version == 1 and applier.last_abort[0] == 2


def test_nan_in_a_later_bucket_aborts_the_version_on_the_receiver(engine):
    transport, sender, receiver, applier, v1 = engine
    bad = _model(2)
    bad.append(("model.norm.extra", torch.tensor([1.0, float("inf")])))
    applier_tensors = dict(applier.tensors)
    applier.tensors = {**applier_tensors, "model.norm.extra": torch.zeros(2)}
    with pytest.raises(NonFiniteError, match="model.norm.extra"):
        sender.send(bad, version=2)
    assert transport.buckets_sent > 1  # earlier buckets were sent ...
    with pytest.raises(RefitAbortedError):
        receiver.receive()
    assert _holds(applier, v1) and applier.version == 1  # ... and nothing was applied
    v3 = _model(3) + [("model.norm.extra", torch.ones(2))]
    th, errors = _send_in_thread(sender, v3, 3)
    receiver.receive()
    th.join()
    assert not errors and _holds(applier, v3)


@pytest.mark.parametrize("corruption", ["checksum", "truncated", "offset", "overlap"])
def test_corrupted_bucket_applies_nothing_then_next_version_works(engine, corruption):
    transport, sender, receiver, applier, v1 = engine
    buckets = list(pack_buckets(_model(2), version=2, bucket_bytes=BUCKET))
    b = buckets[1]
    if corruption == "checksum":
        p = b.payload.clone()
        p[100] ^= 1
        b = dataclasses.replace(b, payload=p)
    elif corruption == "truncated":
        b = dataclasses.replace(b, payload=b.payload[: b.nbytes // 2].clone())
    elif corruption == "offset":
        m = b.metas[-1]
        b = dataclasses.replace(b, metas=b.metas[:-1] + (dataclasses.replace(m, offset=b.nbytes),))
    else:
        m = b.metas[-1]
        b = dataclasses.replace(b, metas=b.metas[:-1] + (dataclasses.replace(m, offset=b.metas[0].offset),))
    buckets[1] = b
    for bucket in buckets:
        transport.send(bucket)
    with pytest.raises(RefitError, match=r"bucket 1 of version 2") as info:
        receiver.receive()
    assert not isinstance(info.value, RefitAbortedError)
    assert _holds(applier, v1) and applier.version == 1 and applier.last_abort[0] == 2
    # the rest of version 2 was read (not applied) by the failing receive, which then told the sender
    assert transport.buckets_received == transport.buckets_sent
    (outcome,) = transport.recv_outcomes(2, buckets[0].stream_id, timeout=1.0)
    assert outcome.status == "refused" and "bucket 1 of version 2" in outcome.reason
    v3 = _model(3)
    _, report = _refit(sender, receiver, v3, 3)
    assert _holds(applier, v3) and report.discarded_buckets == 0


def test_unknown_name_refused_before_commit(engine):
    transport, sender, receiver, applier, v1 = engine
    bad = _model(2) + [("model.layers.0.mlp.gate_up_proj.weight", torch.ones(4, dtype=torch.bfloat16))]
    th, errors = _send_in_thread(sender, bad, 2)
    with pytest.raises(RefitError, match="'model.layers.0.mlp.gate_up_proj.weight' is not a parameter"):
        receiver.receive()
    th.join()
    assert _holds(applier, v1) and applier.version == 1
    (told,) = errors  # the sender was told, with the receiver's reason
    assert isinstance(told, RefitRefusedError) and told.version == 2 and told.outcome == "refused"
    assert "gate_up_proj.weight' is not a parameter" in told.reason


def test_dtype_mismatch_refused(engine):
    transport, sender, receiver, applier, v1 = engine
    bf16 = [(n, t.float().to(torch.bfloat16)) if t.dtype == torch.float8_e4m3fn else (n, t) for n, t in _model(2)]
    th, errors = _send_in_thread(sender, bf16, 2)
    with pytest.raises(RefitError, match="disagree on this parameter's layout or precision"):
        receiver.receive()
    th.join()
    assert _holds(applier, v1)
    assert [type(e) for e in errors] == [RefitRefusedError]


def test_versions_must_increase(engine):
    transport, sender, receiver, applier, v1 = engine
    with pytest.raises(RefitError, match="not newer"):
        sender.send(_model(2), version=1)
    assert transport.buckets_sent == transport.buckets_received  # nothing sent
    # a second sender (e.g. restarted without its counter) replays version 1: the receiver refuses it
    replay = RefitSender(transport, bucket_bytes=BUCKET)
    th, errors = _send_in_thread(replay, _model(2), 1)
    with pytest.raises(RefitError, match="not newer than the applied version 1"):
        receiver.receive()
    th.join()
    assert _holds(applier, v1)
    (told,) = errors  # the replaying sender does not report success
    assert isinstance(told, RefitRefusedError) and "not newer than the applied version 1" in told.reason


def test_killed_sender_inproc_timeout_keeps_version(engine):
    transport, sender, receiver, applier, v1 = engine
    first = next(pack_buckets(_model(2), version=2, bucket_bytes=BUCKET))
    transport.send(first)  # the sender "dies" here
    with pytest.raises(RefitError, match="no bucket arrived"):
        receiver.receive(timeout=0.2)
    assert _holds(applier, v1) and applier.version == 1


def test_callable_applier():
    transport = InProcTransport(maxsize=64, timeout=1.0)
    seen = []
    receiver = RefitReceiver(transport, apply=lambda v, pairs: seen.append((v, [n for n, _ in pairs])))
    items = _model(1)
    _refit(RefitSender(transport, bucket_bytes=BUCKET), receiver, items, 5)
    assert seen == [(5, [n for n, _ in items])]


def test_200_refits_flat_rss():
    """200 refits in a process of their own (``_rss_worker.py``): the RSS floor stays flat (no leak per refit)."""
    # one malloc arena: every refit's sender is a new thread, and glibc gives new threads new arenas (up to 8 per
    # core), each keeping freed memory of its own; a late one raised the floor by 7-11 MiB in a run with no leak (seen
    # on the 2-core CI machine, once in ~10 runs). With one arena the floor moved <= 1.4 MiB over 6 runs.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | {
        "OMP_NUM_THREADS": "1",
        "MALLOC_ARENA_MAX": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_rss_worker.py"))],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["version"] == 200 and out["holds"]
    # the floor, not one sample: the allocator keeps or returns a freed bucket-sized block from one refit to the
    # next (+-13 MiB seen), while a leak raises the floor refit after refit
    grew = min(out["late"]) - min(out["early"])
    assert grew < 8 << 20, f"RSS floor grew by {grew / 2**20:.1f} MiB over 160 refits"
