"""The receiver's staging for an applier with a staging device (the vLLM applier): the version is handed over in
memory it owns, on that device; a bucket that arrives there on a transport with fresh payloads is kept as it is (no
copy: colocated on a GPU the version stays on the GPU), any other is copied there, one copy per bucket as it arrives.

CPU tests check the contract on every machine (owned views, the bytes sent, no copy op for buckets already on the
staging device, one copy op per bucket, and none a view of the sent bucket, when the transport may reuse its buffers;
the protocol and the report's staged bytes); ``gpu`` tests check the CUDA paths (host staging: pinned, asynchronous
copies, the device payload dropped, so the refit's device memory stays near its buckets in flight; device staging:
the buckets kept on the GPU, no host byte, no device-to-host copy).
"""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.refit import InProcTransport, RefitReceiver, RefitSender
from megatron_fp8.refit.applier import keeps_host_copies, staging_device
from megatron_fp8.refit.integrity.checksum import HostCopy
from megatron_fp8.refit.opcount import OpCounter
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.refit.synthetic import SPECS, fp8_stream, linear_shapes, synthetic_weights

BUCKET = 256 * 1024


class HostKeeper:
    """An applier that keeps what it is handed, as the vLLM applier does (writes to no engine)."""

    keeps_host_copies = True

    def __init__(self):
        self.staged: list[tuple[str, torch.Tensor, bool]] = []
        self.committed: list[tuple[str, torch.Tensor]] = []

    def begin(self, version, metas):
        self.staged = []

    def stage(self, name, tensor, *, owned=False):
        self.staged.append((name, tensor, owned))

    def commit(self, version):
        self.committed = [(n, t) for n, t, _ in self.staged]

    def abort(self, version, reason):
        self.staged = []


class PlainKeeper(HostKeeper):
    """The same applier without host copies (the receiver hands it views of its buckets)."""

    keeps_host_copies = False

    def stage(self, name, tensor):
        self.staged.append((name, tensor, False))


class DeviceKeeper(HostKeeper):
    """An applier that keeps the version on a device, as the vLLM applier of an in-process engine worker does."""

    keeps_host_copies = False

    def __init__(self, device):
        super().__init__()
        self.staging_device = device


class RecordingTransport(InProcTransport):
    """The in-process transport, remembering the payload storage of every bucket sent."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sent_ptrs: list[int] = []
        self._alive: list[torch.Tensor] = []
        self.buckets = 0

    def send(self, bucket, *, timeout=None):
        # kept alive: a freed bucket's address can be handed to a later allocation (a host copy), and the storage
        # comparisons below must see only what a sender's live buffers are
        self._alive.append(bucket.payload)
        self.sent_ptrs.append(bucket.payload.untyped_storage().data_ptr())
        self.buckets += 1
        super().send(bucket, timeout=timeout)


def _items(device="cpu", *, layers=2):
    """An FP8 refit stream of the tiny spec (2 layers: 7 buckets; 8 layers: 28)."""
    spec = SPECS["tiny"].shrunk(1, num_layers=layers)
    return [(n, t.to(device)) for n, t in fp8_stream(synthetic_weights(spec, seed=3), linear_shapes(spec))]


class ReusingTransport(RecordingTransport):
    """The same, saying that its payload buffers may be reused (as a transport with a ring of buffers would)."""

    fresh_payloads = False


def _receive(applier, items, device, *, maxsize=64, transport_cls=RecordingTransport, reports=None):
    """Send ``items`` as version 1 from a thread; receive it here under an op counter; (transport, counts)."""
    transport = transport_cls(maxsize=maxsize, timeout=10.0)
    sender = RefitSender(transport, bucket_bytes=BUCKET, device=device)
    receiver = RefitReceiver(transport, apply=applier, timeout=10.0)
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("report", sender.send(items, version=1)))
    th.start()
    with OpCounter() as counter:
        report = receiver.receive()
    th.join()
    if reports is not None:
        reports.append(report)
    assert "report" in box
    return transport, counter.counts


def test_host_copy_off_cuda_is_an_owned_copy():
    src = torch.arange(1000, dtype=torch.int32)
    copy = HostCopy(src)
    assert copy.ready() and not copy.asynchronous
    got = copy.tensor()
    src.fill_(-1)
    assert got.data_ptr() != src.data_ptr() and torch.equal(got, torch.arange(1000, dtype=torch.int32))


def test_the_protocol_flag_is_read_from_the_applier():
    assert keeps_host_copies(HostKeeper()) and not keeps_host_copies(PlainKeeper()) and not keeps_host_copies(object())
    assert staging_device(HostKeeper()) == torch.device("cpu")
    assert staging_device(PlainKeeper()) is None and staging_device(object()) is None
    assert staging_device(DeviceKeeper("cuda:1")) == torch.device("cuda:1")  # a name or a device
    assert not keeps_host_copies(DeviceKeeper("cuda:1")) and keeps_host_copies(DeviceKeeper(torch.device("cpu")))
    with pytest.raises(RefitError, match=r"DeviceKeeper.staging_device is 'gpu please', not a device"):
        staging_device(DeviceKeeper("gpu please"))


def test_every_shipped_transport_hands_out_fresh_payloads():
    """The receiver keeps their buckets as the staged version: each must be a buffer no one writes afterwards."""
    from megatron_fp8.refit.transport import cuda_ipc, inproc, torch_dist
    from megatron_fp8.refit.transport.base import Transport
    from megatron_fp8.refit.transport.registry import FACTORIES

    classes = (inproc.InProcTransport, torch_dist.TorchDistTransport, cuda_ipc.CudaIpcTransport)
    assert all(cls.fresh_payloads for cls in classes) and not Transport.fresh_payloads
    assert set(FACTORIES) == {"inproc", "gloo", "nccl", "cuda_ipc"}  # gloo/nccl: TorchDistTransport


def test_buckets_already_on_the_staging_device_are_the_staged_version_without_a_copy():
    """The in-process transport hands the sender's own (fresh) buckets: kept as they are, owned, no copy op, and
    the report says the version was staged on the host (this machine's device) with no staging copy."""
    items = _items()
    keeper, reports = HostKeeper(), []
    transport, counts = _receive(keeper, items, "cpu", reports=reports)
    assert transport.buckets >= 4, "the test needs several buckets"
    sent = dict(items)
    assert [n for n, _, _ in keeper.staged] == [n for n, _ in items]
    for name, tensor, owned in keeper.staged:
        assert owned and tensor.device.type == "cpu", name
        assert torch.equal(tensor.view(torch.uint8), sent[name].view(torch.uint8)), name
    assert {t.untyped_storage().data_ptr() for _, t, _ in keeper.staged} <= set(transport.sent_ptrs)  # the buckets
    plain = PlainKeeper()
    _, plain_counts = _receive(plain, items, "cpu")
    assert counts.compute == plain_counts.compute  # not one op more than an applier handed views
    (report,) = reports
    assert report.staging_copies == 0 and report.device_staged_bytes == 0
    assert report.host_staged_bytes == report.payload_bytes == sum(t.numel() * t.element_size() for _, t in items)


def test_an_applier_keeping_host_copies_gets_owned_copies_one_per_bucket_with_the_bytes_sent():
    """A transport that may reuse its buffers: one copy per bucket, none a view of a bucket it sent."""
    items = _items()
    keeper, reports = HostKeeper(), []
    transport, counts = _receive(keeper, items, "cpu", transport_cls=ReusingTransport, reports=reports)
    assert transport.buckets >= 4, "the test needs several buckets"
    sent = dict(items)
    assert [n for n, _, _ in keeper.staged] == [n for n, _ in items]
    storages = set()
    for name, tensor, owned in keeper.staged:
        assert owned and tensor.device.type == "cpu", name
        assert torch.equal(tensor.view(torch.uint8), sent[name].view(torch.uint8)), name
        storages.add(tensor.untyped_storage().data_ptr())
    assert len(storages) == transport.buckets  # one host copy per bucket, every tensor a view of its bucket's copy
    assert not storages & set(transport.sent_ptrs)  # never a view of a bucket the sender may reuse

    plain = PlainKeeper()
    plain_transport, plain_counts = _receive(plain, items, "cpu", transport_cls=ReusingTransport)
    assert {t.untyped_storage().data_ptr() for _, t, _ in plain.staged} <= set(plain_transport.sent_ptrs)  # views
    extra = counts.compute - plain_counts.compute
    assert sum(extra.values()) == transport.buckets, extra  # exactly one copy op per bucket, nothing per tensor
    assert counts.num_host_reads == plain_counts.num_host_reads
    assert reports[0].staging_copies == transport.buckets


def test_a_corrupted_bucket_stages_nothing_with_host_copies():
    items = _items()
    keeper = HostKeeper()
    refit = ColocatedRefit(keeper, bucket_bytes=BUCKET, timeout=10.0)
    original = refit.transport.send

    def flip(bucket, *, timeout=None):
        if bucket.index == 1:
            bucket.payload[-1] ^= 1
        original(bucket, timeout=timeout)

    refit.transport.send = flip
    try:
        with pytest.raises(Exception, match="bucket 1 of version 1: checksum mismatch"):
            refit.refit(items)
        assert keeper.committed == [] and keeper.staged == []
        refit.transport.send = original
        result = refit.refit(items)
        assert result.version == 2 and len(keeper.committed) == len(items)
    finally:
        refit.close()


@pytest.mark.gpu
def test_gpu_host_copy_is_pinned_asynchronous_and_survives_the_source_being_reused():
    src = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda")
    want = src.cpu()
    copy = HostCopy(src)
    assert copy.asynchronous and copy.destination.is_pinned()
    del src  # freed: the allocator may hand its memory to the next allocation, ordered after the copy
    again = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    again.fill_(7)
    assert torch.equal(copy.tensor(), want)


class CheckedHostKeeper(HostKeeper):
    """As the vLLM applier: host copies, and the receiver's NaN/Inf check of each bucket on the GPU."""

    accepts_checked_values = True

    def __init__(self):
        super().__init__()
        self.checked: list[int] = []

    def values_checked(self, version):
        self.checked.append(version)


@pytest.mark.gpu
@pytest.mark.parametrize("keeper_cls", [HostKeeper, CheckedHostKeeper], ids=["host-copies", "and-checked-values"])
def test_gpu_host_staging_keeps_only_the_buckets_in_flight_on_the_device(keeper_cls):
    """With the values probed on the GPU too (their probe holds a bucket's views until its verdicts are read)."""
    items = _items("cuda", layers=8)
    version_bytes = sum(t.numel() * t.element_size() for _, t in items)
    keeper = keeper_cls()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    transport, _ = _receive(keeper, items, "cuda", maxsize=1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert transport.buckets >= 20
    assert all(owned and t.device.type == "cpu" and t.is_pinned() for _, t, owned in keeper.staged)
    sent = dict(items)
    assert all(torch.equal(t.view(torch.uint8), sent[n].cpu().view(torch.uint8)) for n, t, _ in keeper.staged)
    assert torch.cuda.memory_allocated() - base < 2 * BUCKET  # nothing of the version is left on the device
    assert peak < version_bytes / 2, (peak, version_bytes)  # the version never sat on the device whole
    assert getattr(keeper, "checked", [1]) == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("checked", [False, True], ids=["device", "and-checked-values"])
def test_gpu_device_staging_keeps_the_buckets_on_the_gpu_with_no_host_byte(checked):
    """The colocated refit kept on the device: the applier's staging device is the buckets' GPU, so the buckets are
    the staged version (no copy op, no device-to-host copy), the report counts device bytes only."""
    items = _items("cuda", layers=4)
    keeper = DeviceKeeper(torch.device("cuda", torch.cuda.current_device()))
    if checked:
        keeper.accepts_checked_values = True
        keeper.checked = []
        keeper.values_checked = keeper.checked.append
    reports: list = []
    transport, counts = _receive(keeper, items, "cuda", reports=reports)
    plain_transport, plain_counts = _receive(PlainKeeper(), items, "cuda")
    assert all(owned and t.is_cuda for _, t, owned in keeper.staged)
    sent = dict(items)
    assert all(torch.equal(t.view(torch.uint8), sent[n].view(torch.uint8)) for n, t, _ in keeper.staged)
    assert {t.untyped_storage().data_ptr() for _, t, _ in keeper.staged} <= set(transport.sent_ptrs)
    (report,) = reports
    assert report.host_staged_bytes == 0 and report.staging_copies == 0
    assert report.device_staged_bytes == report.payload_bytes
    if not checked:
        assert counts.compute == plain_counts.compute  # nothing beyond what a no-copy applier costs
    assert getattr(keeper, "checked", [1]) == [1]


@pytest.mark.gpu
def test_gpu_device_staging_copies_buckets_that_arrive_elsewhere_onto_the_device():
    """Host buckets (a CPU trainer's stream) for an applier staging on the GPU: one copy per bucket onto it."""
    items = _items("cpu")
    keeper, reports = DeviceKeeper("cuda"), []
    transport, _ = _receive(keeper, items, "cpu", reports=reports)
    assert all(owned and t.is_cuda for _, t, owned in keeper.staged)
    sent = dict(items)
    assert all(torch.equal(t.cpu().view(torch.uint8), sent[n].view(torch.uint8)) for n, t, _ in keeper.staged)
    assert reports[0].staging_copies == transport.buckets and reports[0].device_staged_bytes > 0
