"""A version is applied whole or not at all, and the sender is told (in-process transport).

Faults are made by a hostile wire: :class:`TamperingTransport` is the real in-process transport whose
``send`` alters or loses buckets of one version in transit. Each test asserts the refusal, its named
reason, that the applier holds the last good version byte for byte, that the sender saw the refusal,
and that the next clean version commits. The ``wire`` tests run with CPU buckets and (``gpu``) with CUDA
buckets, where the receiver reads each bucket's checksum partials back on its own and settles buckets
while later ones are still in flight: the refusals must name the same bucket and reason on both. Each also
runs with an applier that keeps host copies (the receiver's host staging, as for the vLLM applier).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from megatron_fp8.errors import RefitError, RefitRefusedError, RefitRolledBackError
from megatron_fp8.refit import DictApplier, InProcTransport, RefitReceiver, RefitSender
from megatron_fp8.refit.buckets import checksum_of
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.refit.synthetic import SPECS, fp8_stream, linear_shapes, synthetic_weights

SPEC = SPECS["tiny"].shrunk(1, num_layers=1)
BUCKET = 320 * 1024  # 5 buckets; bucket 1 holds gate_proj and up_proj (same shape)
GATE = "model.layers.0.mlp.gate_proj.weight"
UP = "model.layers.0.mlp.up_proj.weight"


def _model(seed: int) -> list[tuple[str, torch.Tensor]]:
    return list(fp8_stream(synthetic_weights(SPEC, seed=seed), linear_shapes(SPEC)))


def _holds(applier: DictApplier, items) -> bool:
    return all(torch.equal(applier.tensors[n].cpu().view(torch.uint8), t.view(torch.uint8)) for n, t in items)


class HostStagedApplier(DictApplier):
    """The reference applier, told to keep host copies: the receiver stages the version on the host for it
    (what it does for the vLLM applier); every staged tensor must arrive as an owned host copy."""

    keeps_host_copies = True

    def stage(self, name, tensor, *, owned=False):
        assert owned and tensor.device.type == "cpu", (name, owned, tensor.device)
        super().stage(name, tensor)


class TamperingTransport(InProcTransport):
    """The in-process transport with a hostile wire: ``fault(bucket)`` alters a bucket or loses it (``None``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fault = None

    def send(self, bucket, *, timeout=None):
        altered = self.fault(bucket) if self.fault is not None else bucket
        if altered is not None:
            super().send(altered, timeout=timeout)


def _send_in_thread(sender, items, version):
    box: dict = {}

    def run():
        try:
            box["report"] = sender.send(items, version=version)
        except BaseException as exc:  # reported to the test
            box["error"] = exc

    th = threading.Thread(target=run)
    th.start()
    return th, box


@pytest.fixture(
    params=[
        ("cpu", DictApplier),
        ("cpu", HostStagedApplier),
        pytest.param(("cuda", DictApplier), marks=pytest.mark.gpu),
        pytest.param(("cuda", HostStagedApplier), marks=pytest.mark.gpu),
    ],
    ids=["cpu", "cpu-host-staged", "cuda", "cuda-host-staged"],
)
def wire(request):
    """A tampering wire, a sender packing buckets on the device, and a receiver whose applier holds version 1."""
    device, kind = torch.device(request.param[0]), request.param[1]
    transport = TamperingTransport(maxsize=64, timeout=5.0)
    v1 = _model(1)
    applier = kind({n: torch.zeros_like(t, device=device) for n, t in v1})
    receiver = RefitReceiver(transport, apply=applier, timeout=0.5)  # 0.5 s: how long a lost tail is waited for
    sender = RefitSender(transport, bucket_bytes=BUCKET, device=device)
    th, box = _send_in_thread(sender, v1, 1)
    receiver.receive()
    th.join()
    assert "error" not in box and _holds(applier, v1)
    return transport, sender, receiver, applier, v1


def _refused(wire, fault, match):
    """Send version 2 through ``fault``: the receiver refuses it naming ``match``, the sender is told."""
    transport, sender, receiver, applier, v1 = wire
    transport.fault = fault
    th, box = _send_in_thread(sender, _model(2), 2)
    with pytest.raises(RefitError, match=match) as info:
        receiver.receive()
    th.join()
    transport.fault = None
    assert _holds(applier, v1) and applier.version == 1 and receiver.version == 1  # nothing of version 2 applied
    told = box["error"]
    assert isinstance(told, RefitRefusedError), told
    assert told.version == 2 and told.outcome == "refused" and str(info.value) in told.reason
    v3 = _model(3)  # the next clean version commits
    th, box = _send_in_thread(sender, v3, 3)
    report = receiver.receive()
    th.join()
    assert "error" not in box and _holds(applier, v3) and report.version == 3
    assert [o.status for o in box["report"].outcomes] == ["committed"]
    return info.value


def test_early_is_last_with_the_tail_lost_is_refused(wire):
    def cut(bucket):  # bucket 1 claims to be the last one; the tail never arrives
        if bucket.index == 1:
            return dataclasses.replace(bucket, is_last=True)
        return None if bucket.index > 1 else bucket

    _refused(wire, cut, r"bucket 1 of version 2: checksum mismatch over the header")


def test_early_is_last_from_a_buggy_packer_is_refused(wire):
    def forged(bucket):  # is_last set and the checksum recomputed (a buggy packer), but no trailer
        if bucket.index != 1:
            return None if bucket.index > 1 else bucket
        bucket = dataclasses.replace(bucket, is_last=True)
        return dataclasses.replace(bucket, checksum=checksum_of(bucket))

    _refused(wire, forged, r"bucket 1 of version 2: is_last=True but the bucket lacks the version trailer")


def test_swapped_gate_up_names_are_refused_by_the_checksum(wire):
    def swap(bucket):
        names = {m.name for m in bucket.metas}
        if not {GATE, UP} <= names:
            return bucket
        other = {GATE: UP, UP: GATE}
        return dataclasses.replace(
            bucket, metas=tuple(dataclasses.replace(m, name=other.get(m.name, m.name)) for m in bucket.metas)
        )

    _refused(wire, swap, r"bucket 1 of version 2: checksum mismatch")


def test_of_two_corrupted_buckets_the_first_is_named(wire):
    def flip(bucket):  # one payload bit of buckets 1 and 3
        if bucket.index not in (1, 3):
            return bucket
        payload = bucket.payload.clone()
        payload[7] ^= 4
        return dataclasses.replace(bucket, payload=payload)

    err = _refused(wire, flip, r"^bucket 1 of version 2: checksum mismatch")
    assert "bucket 3" not in str(err)


def test_dropped_middle_bucket_is_refused_naming_the_missing_tensors(wire):
    err = _refused(wire, lambda b: None if b.index == 2 else b, r"bucket 3 of version 2 arrived, expected bucket 2")
    assert "the sender announced 19 tensor(s), 17 arrived" in str(err)
    assert "2 missing ['model.layers.0.mlp.down_proj.weight', 'model.layers.0.mlp.down_proj.weight_scale_inv']" in (
        str(err)
    )


def test_trailer_that_disagrees_with_the_stream_is_refused(wire):
    def extra_tensor(bucket):  # the last bucket announces one tensor that never came (checksum recomputed)
        if bucket.trailer is None:
            return bucket
        ghost = dataclasses.replace(bucket.trailer.tensors[0], name="model.layers.9.ghost.weight")
        trailer = dataclasses.replace(
            bucket.trailer, num_tensors=bucket.trailer.num_tensors + 1, tensors=bucket.trailer.tensors + (ghost,)
        )
        bucket = dataclasses.replace(bucket, trailer=trailer)
        return dataclasses.replace(bucket, checksum=checksum_of(bucket))

    _refused(wire, extra_tensor, r"announced 20 tensor\(s\), 19 arrived.*1 missing \['model.layers.9.ghost.weight'\]")


def test_rollback_in_commit_is_reported_as_rolled_back():
    transport = InProcTransport(maxsize=64, timeout=5.0)
    items = _model(1)

    class FailingCommit(DictApplier):
        def commit(self, version):
            raise RefitRolledBackError(f"device error after the first write; the engine holds version {self.version}")

    applier = FailingCommit({n: torch.zeros_like(t) for n, t in items})
    receiver = RefitReceiver(transport, apply=applier)
    th, box = _send_in_thread(RefitSender(transport, bucket_bytes=BUCKET), items, 1)
    with pytest.raises(RefitRolledBackError):
        receiver.receive()
    th.join()
    told = box["error"]
    assert isinstance(told, RefitRefusedError) and told.outcome == "rolled_back" and "device error" in told.reason


def test_no_receiver_means_the_sender_times_out_naming_the_version():
    transport = InProcTransport(maxsize=64, timeout=5.0)
    with pytest.raises(RefitError, match="no outcome for refit version 4"):
        RefitSender(transport, bucket_bytes=BUCKET).send(_model(1), version=4, outcome_timeout=0.2)


def test_two_interleaved_senders_cannot_both_report_success():
    transport = InProcTransport(maxsize=64, timeout=5.0)
    v1, v2 = _model(1), _model(2)
    applier = DictApplier({n: torch.zeros_like(t) for n, t in v1})
    receiver = RefitReceiver(transport, apply=applier)
    a_sent0, b_sent0 = threading.Event(), threading.Event()

    def stream_a():  # version 1: its bucket 0 goes out, then it waits for B's bucket 0
        yield from v1[:9]  # 9th item: bucket 0 is full, so bucket 0 is sent before it is packed
        a_sent0.set()
        b_sent0.wait(5)
        yield from v1[9:]

    def stream_b():  # version 2 from a second sender, interleaved after A's bucket 0
        a_sent0.wait(5)
        yield from v2[:9]
        b_sent0.set()
        yield from v2[9:]

    th_a, box_a = _send_in_thread(RefitSender(transport, bucket_bytes=BUCKET), stream_a(), 1)
    th_b, box_b = _send_in_thread(RefitSender(transport, bucket_bytes=BUCKET), stream_b(), 2)
    with pytest.raises(RefitError, match="the stream mixes versions"):
        receiver.receive()  # A's version 1 is interrupted by B's bucket 0
    report = receiver.receive()  # B's version 2, with A's leftovers dropped
    th_a.join()
    th_b.join()
    assert isinstance(box_a["error"], RefitRefusedError) and box_a["error"].version == 1
    assert "error" not in box_b and report.version == 2 and _holds(applier, v2)


def test_concurrent_receive_calls_are_serialized():
    transport = InProcTransport(maxsize=64, timeout=5.0)
    items = {v: _model(v) for v in (1, 2)}
    applier = DictApplier({n: torch.zeros_like(t) for n, t in items[1]})
    receiver = RefitReceiver(transport, apply=applier)
    got, errors = [], []

    def receive():
        try:
            got.append(receiver.receive(first_timeout=10.0).version)
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    threads = [threading.Thread(target=receive) for _ in range(2)]
    for th in threads:
        th.start()
    sender = RefitSender(transport, bucket_bytes=BUCKET)
    for v in (1, 2):
        sender.send(items[v], version=v)  # returns once one of the receive() calls committed it
    for th in threads:
        th.join()
    assert not errors and sorted(got) == [1, 2] and _holds(applier, items[2])


def test_a_second_receive_that_cannot_wait_is_refused_clearly():
    transport = InProcTransport(maxsize=64, timeout=5.0)
    items = _model(1)
    receiver = RefitReceiver(transport, apply=DictApplier({n: torch.zeros_like(t) for n, t in items}))
    first = threading.Thread(target=receiver.receive, kwargs={"first_timeout": 10.0})
    first.start()
    while not receiver._lock.locked():
        threading.Event().wait(0.01)
    with pytest.raises(RefitError, match=r"another receive\(\) is in progress"):
        receiver.receive(first_timeout=0.05)
    RefitSender(transport, bucket_bytes=BUCKET).send(items, version=1)
    first.join()
    assert receiver.version == 1


def test_colocated_refit_surfaces_the_refusal_then_commits():
    v1 = _model(1)
    applier = DictApplier({n: torch.zeros_like(t) for n, t in v1})
    refit = ColocatedRefit(applier, bucket_bytes=BUCKET, timeout=10.0)
    refit.refit(v1)
    bad = _model(2) + [("model.layers.0.mlp.gate_up_proj.weight", torch.ones(4, dtype=torch.bfloat16))]
    with pytest.raises(RefitError, match="gate_up_proj.weight' is not a parameter"):
        refit.refit(bad)
    assert isinstance(refit.last_refusal, RefitRefusedError) and refit.last_refusal.version == 2
    assert _holds(applier, v1)
    result = refit.refit(_model(3))
    assert result.version == 3 and refit.last_refusal is None and _holds(applier, _model(3))
    assert [o.status for o in result.send.outcomes] == ["committed"]
