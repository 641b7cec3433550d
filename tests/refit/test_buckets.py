"""Packing, unpacking and validation of refit buckets."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8.errors import NonFiniteError, RefitError
from megatron_fp8.refit import (
    ALIGN,
    DTYPES,
    RefitVersion,
    TensorMeta,
    default_bucket_bytes,
    pack_buckets,
    payload_checksum,
    unpack_bucket,
)
from megatron_fp8.refit.wire import (
    RefitOutcome,
    VersionDigest,
    decode_bucket_meta,
    decode_metas,
    encode_bucket_meta,
    encode_metas,
)


def _random_bytes_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random, with NaN/Inf patterns avoided for float dtypes."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _roundtrip(items, bucket_bytes, version=3):
    buckets = list(pack_buckets(items, version=version, bucket_bytes=bucket_bytes))
    got = [pair for b in buckets for pair in unpack_bucket(b, expected_version=version)]
    return buckets, got


SHAPES = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(st.tuples(st.sampled_from(sorted(DTYPES)), SHAPES), min_size=1, max_size=8),
    bucket_bytes=st.sampled_from([16, 48, 64, 256, 4096]),
    seed=st.integers(0, 10_000),
)
def test_roundtrip_is_byte_exact_for_every_dtype(specs, bucket_bytes, seed):
    items = [(f"t{i}", _random_bytes_tensor(DTYPES[d], s, seed + i)) for i, (d, s) in enumerate(specs)]
    buckets, got = _roundtrip(items, bucket_bytes)
    assert [n for n, _ in got] == [n for n, _ in items]
    for (_, a), (_, b) in zip(items, got, strict=True):
        assert _same(a, b)
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert [b.is_last for b in buckets] == [False] * (len(buckets) - 1) + [True]
    for b in buckets:
        assert b.nbytes % ALIGN == 0
        assert all(m.offset % ALIGN == 0 for m in b.metas)
        # a bucket exceeds the target only when it holds a single oversized tensor
        assert b.nbytes <= bucket_bytes or len([m for m in b.metas if m.nbytes]) == 1


def test_noncontiguous_and_scalar_tensors():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    items = [("t", base.t()), ("s", torch.tensor(1.5)), ("e", torch.zeros(0, 3, dtype=torch.bfloat16))]
    _, got = _roundtrip(items, 1024)
    assert torch.equal(got[0][1], base.t()) and got[1][1].shape == () and got[1][1].item() == 1.5
    assert got[2][1].shape == (0, 3) and got[2][1].dtype == torch.bfloat16


def test_bucket_boundaries():
    exact = torch.ones(64, dtype=torch.float32)  # 256 bytes
    big = torch.ones(100, dtype=torch.float32)  # 400 bytes > bucket
    small = torch.ones(2, dtype=torch.float32)
    buckets, got = _roundtrip([("a", small), ("exact", exact), ("big", big), ("b", small)], bucket_bytes=256)
    names = [[m.name for m in b.metas] for b in buckets]
    assert names == [["a"], ["exact"], ["big"], ["b"]]
    assert buckets[1].nbytes == 256 and buckets[2].nbytes == 400
    assert all(_same(t, dict([("a", small), ("exact", exact), ("big", big), ("b", small)])[n]) for n, t in got)


def test_zero_size_only_stream_is_carried():
    buckets, got = _roundtrip([("empty", torch.zeros(0))], bucket_bytes=64)
    assert len(buckets) == 1 and buckets[0].is_last and got[0][1].numel() == 0


def test_empty_stream_is_an_error():
    with pytest.raises(RefitError, match="no tensors"):
        list(pack_buckets([], version=1, bucket_bytes=64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_float_refused_naming_tensor(bad, dtype):
    t = torch.zeros(3, 4, dtype=dtype)
    t[2, 1] = bad
    with pytest.raises(NonFiniteError, match=r"'layer.w'.*index \(2, 1\)") as info:
        list(pack_buckets([("ok", torch.zeros(2)), ("layer.w", t)], version=1, bucket_bytes=1 << 20))
    assert info.value.name == "layer.w"


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_fp8_e4m3_nan_encodings_detected(byte):
    q = torch.zeros(8, dtype=torch.float8_e4m3fn)
    q.view(torch.uint8)[5] = byte
    with pytest.raises(NonFiniteError, match="'w.q'"):
        list(pack_buckets([("w.q", q)], version=1, bucket_bytes=64))


def test_fp8_e4m3_max_is_finite_and_e5m2_inf_detected():
    q = torch.tensor([448.0, -448.0, 0.0], dtype=torch.float32).to(torch.float8_e4m3fn)  # 0x7e, 0xfe: finite
    list(pack_buckets([("w", q)], version=1, bucket_bytes=64))
    e5 = torch.zeros(4, dtype=torch.float8_e5m2)
    e5.view(torch.uint8)[1] = 0x7C  # +inf
    with pytest.raises(NonFiniteError, match="'e5'"):
        list(pack_buckets([("e5", e5)], version=1, bucket_bytes=64))


def test_nan_refused_before_its_bucket_is_yielded():
    gen = pack_buckets(
        [("a", torch.ones(64)), ("c", torch.ones(64)), ("b", torch.full((4,), float("nan"))), ("d", torch.ones(2))],
        version=1,
        bucket_bytes=256,
    )
    first = next(gen)  # "c" does not fit next to "a": bucket 0 = ["a"]
    assert [m.name for m in first.metas] == ["a"]
    assert [m.name for m in next(gen).metas] == ["c"]  # "c" fills bucket 1
    with pytest.raises(NonFiniteError, match=r"'b' of version 1 .* first at index \(0,\)"):
        next(gen)  # bucket 2 = ["b", "d"] is probed (one host read) before it is handed out
    with pytest.raises(StopIteration):
        next(gen)  # the version never gets its last bucket: receivers apply nothing of it


def test_duplicate_names_and_bad_items():
    with pytest.raises(RefitError, match="'w' appears twice"):
        list(pack_buckets([("w", torch.ones(2)), ("w", torch.ones(2))], version=1, bucket_bytes=64))
    with pytest.raises(RefitError, match="valid dtypes"):
        list(pack_buckets([("c", torch.ones(2, dtype=torch.complex64))], version=1, bucket_bytes=64))
    with pytest.raises(RefitError, match="not a torch.Tensor"):
        list(pack_buckets([("x", [1, 2])], version=1, bucket_bytes=64))
    with pytest.raises(RefitError, match="bucket_bytes"):
        list(pack_buckets([("x", torch.ones(1))], version=1, bucket_bytes=8))


def _one_bucket():
    items = [("a", torch.arange(10, dtype=torch.float32)), ("b", torch.ones(3, 5, dtype=torch.bfloat16))]
    (bucket,) = pack_buckets(items, version=4, bucket_bytes=1024)
    return bucket


def test_checksum_detects_flip_and_truncation():
    bucket = _one_bucket()
    flipped = bucket.payload.clone()
    flipped[17] ^= 0x10
    with pytest.raises(RefitError, match="bucket 0 of version 4: checksum mismatch"):
        unpack_bucket(dataclasses.replace(bucket, payload=flipped))
    with pytest.raises(RefitError, match="checksum mismatch"):
        unpack_bucket(dataclasses.replace(bucket, payload=bucket.payload[:-16].clone()))


def test_checksum_is_position_sensitive():
    x = torch.randint(0, 256, (4096 + 3,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[0:4], y[4:8] = x[4:8].clone(), x[0:4].clone()
    assert not torch.equal(x, y)
    assert payload_checksum(x) != payload_checksum(y)
    assert payload_checksum(x) == payload_checksum(x.clone())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda m: dataclasses.replace(m, offset=4096), "run past the payload end"),
        (lambda m: dataclasses.replace(m, offset=8), "not a non-negative multiple"),
        (lambda m: dataclasses.replace(m, offset=0), "overlap"),
        (lambda m: dataclasses.replace(m, nbytes=m.nbytes - 2), "does not match shape"),
        (lambda m: dataclasses.replace(m, dtype="float128"), "unknown dtype"),
        (lambda m: dataclasses.replace(m, name="a"), "appears twice"),
    ],
)
def test_corrupt_metadata_names_bucket_and_tensor(change, match):
    bucket = _one_bucket()
    a, b = bucket.metas
    bad = dataclasses.replace(bucket, metas=(a, change(b)))
    with pytest.raises(RefitError, match=match) as info:
        unpack_bucket(bad, verify_checksum=False)
    assert "bucket 0 of version 4" in str(info.value) or "'b'" in str(info.value) or "'a'" in str(info.value)


def test_version_mismatch():
    with pytest.raises(RefitError, match="bucket 0 of version 4: expected version 5"):
        unpack_bucket(_one_bucket(), expected_version=5)


def test_meta_json_roundtrip_and_malformed():
    metas = _one_bucket().metas
    assert decode_metas(encode_metas(metas)) == metas
    with pytest.raises(RefitError, match="not valid JSON"):
        decode_metas(b"{not json")
    with pytest.raises(RefitError, match="malformed"):
        decode_metas(b'[["a", [2], "float32"]]')
    assert TensorMeta("x", (2, 3), "float32", 0, 24).numel == 6


def test_refit_version_strictly_increases():
    v = RefitVersion()
    assert v.next() == 1 and v.next() == 2
    v.observe(5)
    for bad in (5, 4):
        with pytest.raises(RefitError, match="not newer"):
            v.observe(bad)
    assert v.next() == 6


def test_default_bucket_bytes():
    assert default_bucket_bytes("cpu") == 64 << 20
    assert default_bucket_bytes(None, cpu_bytes=1000) == 1 << 20  # clamped up to min_bytes
    assert default_bucket_bytes("cpu", cpu_bytes=3 << 20, min_bytes=16) == 3 << 20
    with pytest.raises(RefitError, match="cuda_free_fraction"):
        default_bucket_bytes("cpu", cuda_free_fraction=0)


@pytest.mark.gpu
def test_cuda_pack_unpack_and_bucket_size():
    dev = torch.device("cuda")
    size = default_bucket_bytes(dev)
    assert 1 << 20 <= size <= 1 << 30
    items = [("w", torch.randn(300, 200, device=dev).to(torch.float8_e4m3fn)), ("s", torch.rand(3, 2, device=dev))]
    buckets, got = _roundtrip(items, 4096)
    assert all(b.payload.is_cuda for b in buckets)
    for (_, a), (_, b) in zip(items, got, strict=True):
        assert _same(a, b)
    # the checksum does not depend on the device
    assert all(payload_checksum(b.payload) == payload_checksum(b.payload.cpu()) for b in buckets)


def test_last_bucket_carries_the_announced_set():
    items = [(f"t{i}", torch.full((40,), float(i))) for i in range(5)]
    buckets = list(pack_buckets(items, version=2, bucket_bytes=256, stream_id=77))
    assert len(buckets) > 2 and all(b.trailer is None for b in buckets[:-1]) and all(b.stream_id == 77 for b in buckets)
    trailer = buckets[-1].trailer
    assert trailer.num_tensors == 5 and [t.name for t in trailer.tensors] == [n for n, _ in items]
    assert all(t.shape == (40,) and t.dtype == "float32" and t.nbytes == 160 for t in trailer.tensors)
    digest = VersionDigest()
    for b in buckets:
        for m in b.metas:
            digest.add(b.index, m)
    assert trailer.digest == digest.hexdigest()
    for b in buckets:  # metadata and trailer survive the wire encoding
        assert decode_bucket_meta(encode_bucket_meta(b.metas, b.trailer)) == (b.metas, b.trailer)


@pytest.mark.parametrize(
    "change",
    [
        lambda b: dataclasses.replace(b, is_last=not b.is_last),
        lambda b: dataclasses.replace(b, index=b.index + 1),
        lambda b: dataclasses.replace(b, version=b.version + 1),
        lambda b: dataclasses.replace(b, stream_id=b.stream_id + 1),
        lambda b: dataclasses.replace(b, metas=(dataclasses.replace(b.metas[0], name="b"), b.metas[1])),
        lambda b: dataclasses.replace(b, metas=(b.metas[0], dataclasses.replace(b.metas[1], shape=(5, 3)))),
        lambda b: dataclasses.replace(b, trailer=dataclasses.replace(b.trailer, digest="0" * 32)),
    ],
    ids=["is_last", "index", "version", "stream_id", "name", "shape", "trailer"],
)
def test_checksum_covers_header_metadata_and_trailer(change):
    bucket = _one_bucket()
    unpack_bucket(bucket)
    with pytest.raises(RefitError, match="checksum mismatch over the header"):
        unpack_bucket(change(bucket))


def test_refit_outcome_status_is_from_the_vocabulary():
    assert RefitOutcome(3, "committed").committed and not RefitOutcome(3, "rolled_back", "x").committed
    with pytest.raises(RefitError, match="valid outcomes"):
        RefitOutcome(3, "applied")


def test_a_deferred_nan_block_is_refused_by_the_packer_naming_weight_and_block():
    from megatron_fp8.refit.synthetic import fp8_stream

    w = torch.randn(300, 260, dtype=torch.bfloat16)
    w[140, 3] = float("nan")  # row block 1, column block 0
    stream = fp8_stream({"layer.w": w, "norm": torch.ones(4, dtype=torch.bfloat16)}, ["layer.w"], nonfinite="defer")
    # the block's codes are NaN (x / inf) and its scale +inf: the packer names the weight and the element
    with pytest.raises(NonFiniteError, match=r"'layer.w' of version 3 .*first at index \(140, 3\)"):
        list(pack_buckets(stream, version=3, bucket_bytes=1 << 20))
    scales = torch.ones(3, 3)
    scales[1, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"'layer.w_scale_inv'.*block \(1, 0\) of 'layer.w' held NaN/Inf"):
        list(pack_buckets([("layer.w_scale_inv", scales)], version=3, bucket_bytes=1 << 20))


def test_one_tensor_under_two_names_and_disjoint_views_of_one_buffer_travel_as_they_are():
    whole = torch.arange(64, dtype=torch.float32)
    items = [("embed", whole), ("lm_head", whole), ("a", whole[:32]), ("b", whole[32:])]  # tied weights, views
    for bucket_bytes in (1 << 20, 256):
        got = {n: t for b in pack_buckets(items, version=1, bucket_bytes=bucket_bytes) for n, t in unpack_bucket(b)}
        assert torch.equal(got["embed"], whole) and torch.equal(got["lm_head"], whole)
        assert torch.equal(torch.cat([got["a"], got["b"]]), whole)


@pytest.mark.parametrize(
    "name", ["model.layers.0.mlp.down_proj.weight", 'q"uote\\back', "ünïcode\u2028", "tab\tnl\n\x01", ""]
)
@pytest.mark.parametrize("shape", [(), (0,), (4096, 14336), (8, 1, 3)])
def test_the_version_digest_hashes_the_compact_json_of_each_record(name, shape):
    """The digest's bytes are those of ``json.dumps(record, separators=(",", ":"))`` plus a newline, whatever the
    name holds (quotes, backslashes, non-ASCII, control characters): a receiver computing it the plain way agrees."""
    import hashlib
    import json

    from megatron_fp8.refit.wire import TensorMeta

    meta = TensorMeta(name=name, shape=shape, dtype="float8_e4m3fn", offset=4096, nbytes=123)
    digest = VersionDigest()
    digest.add(7, meta)
    rec = [7, name, list(shape), "float8_e4m3fn", 4096, 123]
    want = hashlib.blake2b(json.dumps(rec, separators=(",", ":")).encode("utf-8") + b"\n", digest_size=16)
    assert digest.hexdigest() == want.hexdigest()
