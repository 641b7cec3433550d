"""The receiver's NaN/Inf check for an applier that accepts checked values (the vLLM applier, whose workers would
otherwise read every byte of a host-staged version on the CPU): the values are probed where the buckets arrive,
before the host copy, read back with the checksum's one host read; a clean version is announced to the applier
(``values_checked``) between ``begin`` and ``commit``; a NaN/Inf is refused by name before ``begin``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_fp8.errors import NonFiniteError, RefitError
from megatron_fp8.refit import InProcTransport, RefitReceiver
from megatron_fp8.refit.applier import accepts_checked_values
from megatron_fp8.refit.buckets import pack_buckets
from megatron_fp8.refit.opcount import OpCounter
from megatron_fp8.refit.synthetic import SPECS, fp8_stream, linear_shapes, synthetic_weights

BUCKET = 256 * 1024


class CheckedKeeper:
    """Keeps host copies (as the vLLM applier) and takes the receiver's value check; records the protocol calls."""

    keeps_host_copies = True
    accepts_checked_values = True

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.staged: list[tuple[str, torch.Tensor]] = []

    def begin(self, version, metas):
        self.calls.append(("begin", version))
        self.staged = []

    def stage(self, name, tensor, *, owned=False):
        self.staged.append((name, tensor))

    def values_checked(self, version):
        self.calls.append(("values_checked", version))

    def commit(self, version):
        self.calls.append(("commit", version))

    def abort(self, version, reason):
        self.calls.append(("abort", version))


class UncheckedKeeper(CheckedKeeper):
    accepts_checked_values = False


def _items(layers: int = 2) -> list[tuple[str, torch.Tensor]]:
    spec = SPECS["tiny"].shrunk(1, num_layers=layers)
    return list(fp8_stream(synthetic_weights(spec, seed=5), linear_shapes(spec)))


def _receive(applier, items, *, version=1, check_finite_values=True):
    """Pack ``items`` (the sender's own NaN/Inf check on or off) into an in-process transport, then receive them."""
    transport = InProcTransport(maxsize=1000, timeout=10.0)
    for bucket in pack_buckets(
        iter(items), version=version, bucket_bytes=BUCKET, check_finite_values=check_finite_values, stream_id=9
    ):
        transport.send(bucket)
    receiver = RefitReceiver(transport, apply=applier, timeout=10.0)
    with OpCounter() as counter:
        report = receiver.receive()
    return report, counter.counts


def test_the_protocol_flag_needs_the_method_too():
    assert accepts_checked_values(CheckedKeeper()) and not accepts_checked_values(UncheckedKeeper())
    flag_only = type("FlagOnly", (), {"accepts_checked_values": True})()
    assert not accepts_checked_values(flag_only) and not accepts_checked_values(object())


def test_a_clean_version_is_announced_between_begin_and_commit():
    items = _items()
    keeper = CheckedKeeper()
    report, _ = _receive(keeper, items)
    assert report.num_buckets >= 4
    assert keeper.calls == [("begin", 1), ("values_checked", 1), ("commit", 1)]
    sent = dict(items)
    assert all(torch.equal(t.view(torch.uint8), sent[n].view(torch.uint8)) for n, t in keeper.staged)
    plain = UncheckedKeeper()
    _receive(plain, items)
    assert plain.calls == [("begin", 1), ("commit", 1)]


@pytest.mark.parametrize(
    ("which", "value"),
    [("bf16", float("nan")), ("bf16", float("inf")), ("bf16", -float("inf")), ("fp8", None)],
    ids=["bf16-nan", "bf16-inf", "bf16--inf", "fp8-nan-code"],
)
def test_a_nonfinite_value_the_sender_let_through_is_refused_by_name_before_begin(which, value):
    """A sender that does not check (``check_finite_values=False``; ours always does) cannot get a NaN/Inf past a
    receiver that tells the applier the values were checked: the tensor and its first bad element are named."""
    items = dict(_items())
    if which == "bf16":
        name = "model.norm.weight"
        bad = items[name].clone()
        bad[7] = value
        where = r"\(7,\)"
    else:
        name = "model.layers.1.mlp.down_proj.weight"
        bad = items[name].clone()
        bad.view(torch.uint8)[3, 5] = 0x7F  # e4m3fn holds no Inf: its NaN code
        where = r"\(3, 5\)"
    items[name] = bad
    keeper = CheckedKeeper()
    with pytest.raises(
        RefitError, match=rf"NonFiniteError: tensor '{name}' of version 1 .*first at index {where}"
    ) as err:
        _receive(keeper, list(items.items()), check_finite_values=False)
    assert isinstance(err.value.__cause__, NonFiniteError)
    assert ("begin", 1) not in keeper.calls and ("commit", 1) not in keeper.calls
    assert ("abort", 1) in keeper.calls
    # an applier that checks values itself is not spared its check: the receiver leaves them to it
    plain = UncheckedKeeper()
    _receive(plain, list(items.items()), check_finite_values=False)
    assert plain.calls == [("begin", 1), ("commit", 1)]


def test_the_check_costs_a_few_ops_per_bucket_and_no_host_read():
    """Checked against the same receiver without it: the probe's multi-tensor ops per bucket, whatever the tensor
    count, and not one more host read (its verdicts travel with the checksum partials)."""

    def extra(layers):
        items = _items(layers)
        report, checked = _receive(CheckedKeeper(), items)
        _, plain = _receive(UncheckedKeeper(), items)
        assert checked.num_host_reads == plain.num_host_reads
        return sum((checked.compute - plain.compute).values()), report.num_buckets

    (small, nb_small), (big, nb_big) = extra(2), extra(4)
    assert small / nb_small <= 8 and big / nb_big <= 8, (small, nb_small, big, nb_big)


@pytest.mark.gpu
def test_gpu_a_nan_in_a_cuda_bucket_is_refused_by_name_and_a_clean_version_announced():
    """On CUDA the probe is the grouped Triton pass over the bucket's tensors (by data pointer), its verdicts read
    with the checksum partials through the bucket's pinned host read."""
    items = [(n, t.cuda()) for n, t in _items()]
    keeper = CheckedKeeper()
    _receive(keeper, items)
    assert keeper.calls == [("begin", 1), ("values_checked", 1), ("commit", 1)]
    bad = dict(items)
    name = "model.layers.0.self_attn.o_proj.weight"
    bad[name] = bad[name].clone()
    bad[name].view(torch.uint8)[100, 7] = 0xFF
    keeper = CheckedKeeper()
    with pytest.raises(RefitError, match=rf"NonFiniteError: tensor '{name}' of version 1 .*first at index \(100, 7\)"):
        _receive(keeper, list(bad.items()), check_finite_values=False)
    assert ("begin", 1) not in keeper.calls
