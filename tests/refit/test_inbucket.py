"""Quantize into the bucket: the same wire bytes as quantize-then-copy, a refused NaN weight, and the op budget.

The op budget is counted on CPU (:class:`OpCounter`; on a GPU every compute op is a kernel launch and every host
read a sync): a bucket whose FP8 weights are quantized in it issues at most 8 compute ops more than the same bucket
sent as BF16, and one host read, whatever the number of weights.
"""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_fp8.errors import NonFiniteError, RefitError
from megatron_fp8.refit import DictApplier, InProcTransport, RefitReceiver, RefitSender
from megatron_fp8.refit.applier import copy_by_dtype
from megatron_fp8.refit.buckets import pack_buckets
from megatron_fp8.refit.inbucket import PendingPart, blockwise_items
from megatron_fp8.refit.opcount import OpCounter
from megatron_fp8.refit.synthetic import SPECS, fp8_stream, linear_shapes, synthetic_weights

MAX_EXTRA_OPS = 8
SHAPES = [(300, 260), (128, 512), (1, 1), (129, 257), (2, 130, 200), (256, 384), (127, 128)]


def _weights(seed: int = 0, nan_at: tuple | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i, shape in enumerate(SHAPES):
        out[f"l{i}.w"] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        out[f"l{i}.norm"] = torch.randn(64, generator=g).to(torch.bfloat16)
    if nan_at is not None:
        name, index = nan_at
        out[name][index] = float("nan")
    return out


def _fp8_names(weights):
    return [n for n in weights if n.endswith(".w")]


def _wire(buckets):
    return [(b.index, b.is_last, b.metas, b.checksum, b.payload.clone(), b.trailer) for b in buckets]


@pytest.mark.parametrize(
    "bucket_bytes", [1 << 20, 64 << 10, 4096, 160, 16], ids=["1MiB", "64KiB", "4KiB", "160B", "16B"]
)
def test_the_wire_is_the_same_as_quantize_then_copy(bucket_bytes):
    """Same metas, payload bytes and checksums, including codes and scales split across buckets."""
    w = _weights()
    eager = _wire(
        pack_buckets(fp8_stream(w, _fp8_names(w), nonfinite="defer"), version=2, bucket_bytes=bucket_bytes, stream_id=7)
    )
    lazy = _wire(
        pack_buckets(fp8_stream(w, _fp8_names(w), in_bucket=True), version=2, bucket_bytes=bucket_bytes, stream_id=7)
    )
    assert len(eager) == len(lazy)
    for a, b in zip(eager, lazy, strict=True):
        assert a[:4] == b[:4] and a[5] == b[5]
        assert torch.equal(a[4], b[4]), f"bucket {a[0]}: payload bytes differ"


def test_ue8m0_and_scales_first_order_give_the_same_wire():
    w = _weights(1)
    eager, lazy = [], []
    for name, t in w.items():
        if name.endswith(".w"):
            parts = list(blockwise_items(name, t, scale_format="ue8m0"))[::-1]  # scales before codes
            lazy += parts
            eager += [(n, p.materialize()) for n, p in parts]
        else:
            lazy.append((name, t))
            eager.append((name, t))
    for bucket_bytes in (1 << 20, 300):
        a = _wire(pack_buckets(eager, version=1, bucket_bytes=bucket_bytes))
        b = _wire(pack_buckets(lazy, version=1, bucket_bytes=bucket_bytes))
        assert [x[:4] for x in a] == [x[:4] for x in b]
        assert all(torch.equal(x[4], y[4]) for x, y in zip(a, b, strict=True))


def test_a_pending_part_looks_like_its_tensor():
    (_, codes), (_, scales) = blockwise_items("w", torch.randn(300, 260, dtype=torch.bfloat16))
    assert isinstance(codes, PendingPart) and codes.shape == (300, 260) and codes.dtype == torch.float8_e4m3fn
    assert scales.shape == (3, 3) and scales.dtype == torch.float32 and scales.numel() * scales.element_size() == 36
    assert codes.materialize().shape == (300, 260) and scales.materialize() is scales.materialize()


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 70000], ids=["one-bucket", "scales-in-next-bucket"])
def test_a_nan_weight_is_refused_naming_weight_and_element(bucket_bytes):
    w = _weights(nan_at=("l0.w", (140, 3)))
    with pytest.raises(NonFiniteError, match=r"'l0.w' of version 3 .*first at index \(140, 3\)"):
        list(pack_buckets(fp8_stream(w, _fp8_names(w), in_bucket=True), version=3, bucket_bytes=bucket_bytes))


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 4096, 160], ids=["1MiB", "4KiB", "160B"])
def test_lookahead_hands_out_the_same_wire_one_bucket_later(bucket_bytes):
    """With ``lookahead`` (CUDA's default) bucket i is handed out only after bucket i+1's work was issued: the
    wire is the same, and a bucket is never handed out before the stream reached the end of the next one."""
    w = _weights()
    plain = _wire(pack_buckets(fp8_stream(w, _fp8_names(w), in_bucket=True), version=2, bucket_bytes=bucket_bytes))
    consumed: list[str] = []

    def stream():
        for name, t in fp8_stream(w, _fp8_names(w), in_bucket=True):
            consumed.append(name)
            yield name, t

    seen_at = []
    ahead = []
    for b in pack_buckets(stream(), version=2, bucket_bytes=bucket_bytes, lookahead=True):
        seen_at.append(len(consumed))
        ahead.append((b.index, b.is_last, b.metas, b.checksum, b.payload.clone(), b.trailer))
    assert len(plain) == len(ahead) > (1 if bucket_bytes < 1 << 20 else 0)
    for a, b in zip(plain, ahead, strict=True):
        assert a[:4] == b[:4] and a[5] == b[5] and torch.equal(a[4], b[4])
    ends = [sum(len(b[2]) for b in plain[: i + 1]) for i in range(len(plain))]
    for i in range(len(plain) - 1):  # bucket i goes out after the tensor that opened bucket i+2 was taken
        assert seen_at[i] >= min(ends[i + 1] + 1, ends[-1]), (i, seen_at, ends)


def test_lookahead_refuses_a_nan_weight_before_its_bucket_is_handed_out():
    w = _weights(nan_at=("l3.w", (100, 200)))
    got = []
    with pytest.raises(NonFiniteError, match="'l3.w'"):
        for b in pack_buckets(
            fp8_stream(w, _fp8_names(w), in_bucket=True), version=5, bucket_bytes=4096, lookahead=True
        ):
            got.append(b)
    assert not any(m.name.startswith("l3.w") for b in got for m in b.metas)


def test_a_part_placed_twice_is_refused():
    (name, codes), _ = blockwise_items("w", torch.randn(128, 128, dtype=torch.bfloat16))
    with pytest.raises(RefitError, match="appear twice"):
        list(pack_buckets([(name, codes), ("w2", codes)], version=1, bucket_bytes=1 << 20))


def _ops_of_one_bucket(stream) -> tuple[int, int, dict]:
    with OpCounter() as c:
        buckets = list(pack_buckets(stream, version=1, bucket_bytes=64 << 20))
    assert len(buckets) == 1
    return c.counts.num_compute, c.counts.num_host_reads, dict(c.counts.compute)


@pytest.mark.parametrize("with_bf16", [True, False], ids=["fp8+bf16-bucket", "fp8-only-bucket"])
def test_an_fp8_bucket_costs_at_most_8_ops_more_than_bf16_and_one_host_read(with_bf16):
    w = _weights()
    if not with_bf16:
        w = {n: t for n, t in w.items() if n.endswith(".w")}
    names = _fp8_names(w)
    _ops_of_one_bucket(fp8_stream(w, names, in_bucket=True))  # warm the per-process caches (arange, zeros)
    _ops_of_one_bucket(w.items())
    bf16_ops, bf16_reads, _ = _ops_of_one_bucket(w.items())
    fp8_ops, fp8_reads, by_op = _ops_of_one_bucket(fp8_stream(w, names, in_bucket=True))
    assert fp8_reads == bf16_reads == 1
    assert fp8_ops <= bf16_ops + MAX_EXTRA_OPS, f"{len(names)} FP8 weights: {fp8_ops} vs BF16 {bf16_ops}: {by_op}"
    eager_ops, _, _ = _ops_of_one_bucket(fp8_stream(w, names, nonfinite="defer"))
    assert eager_ops > fp8_ops + len(names), "the per-weight path should cost ops per weight (the test's premise)"


def _count_refit(stream, targets, bucket_bytes):
    transport = InProcTransport(timeout=60)
    sender = RefitSender(transport, bucket_bytes=bucket_bytes, timeout=60)
    receiver = RefitReceiver(transport, apply=DictApplier(targets), timeout=60)
    box = {}

    def receive():
        with OpCounter() as c:
            receiver.receive(timeout=60)
        box["receiver"] = c.counts

    thread = threading.Thread(target=receive)
    thread.start()
    with OpCounter() as c:
        report = sender.send(stream, version=1)
    thread.join(60)
    return report.num_buckets, c.counts, box["receiver"]


def test_a_refit_of_many_fp8_weights_stays_within_the_budget_on_each_side():
    spec = SPECS["tiny"]
    weights = synthetic_weights(spec, seed=3)
    names = linear_shapes(spec)
    want = {
        n: t.materialize() if isinstance(t, PendingPart) else t for n, t in fp8_stream(weights, names, in_bucket=True)
    }
    runs = {}
    for kind, factory in (
        ("bf16", lambda: weights.items()),
        ("fp8", lambda: fp8_stream(weights, names, in_bucket=True)),
    ):
        targets = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in factory()}
        runs[kind] = _count_refit(factory(), targets, 64 << 10)
        if kind == "fp8":
            for n, t in want.items():
                assert torch.equal(targets[n].view(torch.uint8), t.view(torch.uint8)), n
    (nb_bf16, snd_bf16, _), (nb_fp8, snd_fp8, rcv_fp8) = runs["bf16"], runs["fp8"]
    assert nb_fp8 >= 4
    assert snd_fp8.num_compute / nb_fp8 <= snd_bf16.num_compute / nb_bf16 + MAX_EXTRA_OPS, dict(snd_fp8.compute)
    for side in (snd_fp8, rcv_fp8):
        assert side.num_host_reads <= nb_fp8, dict(side.host_reads)


def test_the_dict_applier_copies_once_per_dtype():
    dtypes = (torch.bfloat16, torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8)
    sources = [torch.randn(4 + i).to(dt) for i, dt in enumerate(dtypes)] + [torch.zeros(0)]
    targets = [torch.zeros_like(s) for s in sources]
    with OpCounter() as c:
        assert copy_by_dtype(targets, sources) == 3  # bfloat16, float32, and the 1-byte dtypes as uint8
    assert c.counts.compute == {"_foreach_copy_": 3}
    for t, s in zip(targets, sources, strict=True):
        assert torch.equal(t.view(torch.uint8), s.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 4096], ids=["1MiB", "4KiB"])
def test_cuda_in_bucket_quantization_gives_the_cpu_wire(bucket_bytes):
    """On CUDA the bucket's weights are quantized by one grouped Triton launch (its in-kernel e4m3 cast, its
    ALIGNED vector variant for the 16-byte aligned rows, the plain one for ragged K) and its other tensors copied
    by the fused fill (copy + NaN/Inf flags): the payload bytes and checksums are those of the CPU torch path's
    quantize-then-copy wire, and a NaN in a quantized weight or in a copied tensor is refused by name."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    w = _weights()
    cpu = _wire(pack_buckets(fp8_stream(w, _fp8_names(w), nonfinite="defer"), version=3, bucket_bytes=bucket_bytes))
    wc = {n: t.cuda() for n, t in w.items()}
    cuda = _wire(pack_buckets(fp8_stream(wc, _fp8_names(wc), in_bucket=True), version=3, bucket_bytes=bucket_bytes))
    assert len(cpu) == len(cuda)
    for a, b in zip(cpu, cuda, strict=True):
        assert a[2] == b[2] and a[3] == b[3], f"bucket {a[0]}: metadata or checksum differ"
        assert torch.equal(a[4], b[4].cpu()), f"bucket {a[0]}: payload bytes differ"
    for where in (("l3.w", (100, 200)), ("l2.norm", (5,))):  # a quantized weight (its scales); a copied tensor
        bad = {n: t.cuda() for n, t in _weights(nan_at=where).items()}
        with pytest.raises(NonFiniteError, match=rf"'{where[0]}' of version 4"):
            list(pack_buckets(fp8_stream(bad, _fp8_names(bad), in_bucket=True), version=4, bucket_bytes=bucket_bytes))


@pytest.mark.gpu
def test_host_tensors_packed_into_a_cuda_bucket_give_the_cpu_wire():
    """A stream of host tensors into CUDA buckets (``device="cuda"``): the fused fill copies them in first and
    flags NaN/Inf from their place in the bucket (its kernel reads device memory only)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    w = _weights(2)
    cpu = _wire(pack_buckets(list(w.items()), version=1, bucket_bytes=4096))
    cuda = _wire(pack_buckets(list(w.items()), version=1, bucket_bytes=4096, device="cuda"))
    assert [b[:4] for b in cpu] == [b[:4] for b in cuda]
    assert all(torch.equal(a[4], b[4].cpu()) for a, b in zip(cpu, cuda, strict=True))
    bad = _weights(2, nan_at=("l4.w", (1, 2, 3)))
    with pytest.raises(NonFiniteError, match=r"'l4.w' of version 2 .*first at index \(1, 2, 3\)"):
        list(pack_buckets(list(bad.items()), version=2, bucket_bytes=4096, device="cuda"))
