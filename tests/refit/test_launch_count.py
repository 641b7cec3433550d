"""The refit's launch and sync budget, counted on CPU: a few ops per bucket on each side, whatever the tensor count.

One refit of a many-tensor stream (already quantized FP8 weights + float32 block scales + BF16 tensors,
4 MiB buckets) goes through the public path ``RefitSender -> InProcTransport -> RefitReceiver ->
DictApplier`` (verify and rollback on), with an :class:`OpCounter` in the sender's thread and one in the
receiver's. On a GPU every counted compute op is a kernel launch and every host read a device sync.
"""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_fp8.refit import DictApplier, InProcTransport, RefitReceiver, RefitSender
from megatron_fp8.refit.opcount import OpCounter, _self_check

MiB = 1 << 20
MAX_OPS_PER_BUCKET = 16
MAX_READS_PER_BUCKET = 1


def _stream(layers: int, split: int) -> list[tuple[str, torch.Tensor]]:
    """``layers`` x (FP8 [1024, 512] + its scales + BF16 norm + BF16 [64, 64]), the FP8 weight cut into ``split``."""
    g = torch.Generator().manual_seed(layers * split)
    out = []
    for i in range(layers):
        rows = 1024 // split
        for s in range(split):
            w = (torch.randn(rows, 512, generator=g) * 8).to(torch.float8_e4m3fn)
            out.append((f"l{i}.w{s}.weight", w))
            out.append((f"l{i}.w{s}.weight_scale_inv", torch.rand(max(1, rows // 128), 4, generator=g) + 0.5))
        out.append((f"l{i}.norm.weight", torch.randn(1024, generator=g).to(torch.bfloat16)))
        out.append((f"l{i}.bias", torch.randn(64, 64, generator=g).to(torch.bfloat16)))
    return out


def _count_one_refit(stream):
    targets = {n: torch.zeros_like(t) for n, t in stream}
    applier = DictApplier(targets)
    transport = InProcTransport(timeout=60)
    sender = RefitSender(transport, bucket_bytes=4 * MiB, timeout=60)
    receiver = RefitReceiver(transport, apply=applier, timeout=60)
    box = {}

    def send():
        with OpCounter() as c:
            box["report"] = sender.send(stream, version=1)
        box["sender"] = c.counts

    thread = threading.Thread(target=send)
    thread.start()
    with OpCounter() as c:
        report = receiver.receive(timeout=60)
    thread.join(60)
    assert "report" in box, "the sender did not finish"
    for name, t in stream:  # the refit itself is exact
        assert torch.equal(targets[name].view(torch.uint8), t.view(torch.uint8)), name
    return report.num_buckets, box["sender"], c.counts


def test_the_counter_counts_compute_and_host_reads():
    counts = _self_check()
    assert counts.compute == {"arange": 1, "mul": 1, "sum": 1}, counts.compute  # views are free
    # ... but dispatched, as the host reads and the compute ops are
    assert counts.dispatched == {"arange": 1, "mul": 1, "sum": 1, "_local_scalar_dense": 1, "view": 1, "detach": 1}
    assert counts.dispatches == 6
    assert counts.host_reads == {"_local_scalar_dense": 1, "tolist": 1}, counts.host_reads


@pytest.mark.parametrize(("layers", "split"), [(40, 1), (40, 4)], ids=["160-tensors", "400-tensors"])
def test_a_handful_of_ops_and_one_host_read_per_bucket_on_each_side(layers, split):
    stream = _stream(layers, split)
    buckets, sender, receiver = _count_one_refit(stream)
    assert buckets >= 5
    for side, counts in (("sender", sender), ("receiver", receiver)):
        per_bucket = counts.num_compute / buckets
        assert per_bucket <= MAX_OPS_PER_BUCKET, (
            f"{side}: {counts.num_compute} compute ops for {len(stream)} tensors in {buckets} buckets "
            f"({per_bucket:.1f} per bucket): {dict(counts.compute.most_common(8))}"
        )
        assert counts.num_host_reads <= MAX_READS_PER_BUCKET * buckets, (
            f"{side}: {counts.num_host_reads} host reads in {buckets} buckets: {dict(counts.host_reads)}"
        )
