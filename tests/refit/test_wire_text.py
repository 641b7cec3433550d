"""The wire's metadata text made once per record is the JSON it stands for, and the views of a bucket are its bytes.

A record's :attr:`TensorMeta.json_text` (and the trailer's) replaces ``json.dumps`` in the header digest, the
version digest and the metadata encoding of every transport, and :meth:`TensorMeta.of` shares records across
versions. These tests hold that text to ``json.dumps(..., separators=(",", ":"))`` itself on awkward names, and
the digests to the formulas they had when they encoded with ``json.dumps`` (so a digest means what it meant).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.refit import wire
from megatron_fp8.refit.buckets import pack_buckets, unpack_bucket
from megatron_fp8.refit.integrity.checksum import header_digest
from megatron_fp8.refit.wire import (
    DTYPES,
    AnnouncedTensor,
    Bucket,
    TensorMeta,
    VersionDigest,
    VersionTrailer,
    decode_bucket_meta,
    decode_metas,
    encode_bucket_meta,
    encode_metas,
)

NAMES = [
    "model.layers.0.self_attn.q_proj.weight",
    'a "quoted" name',
    "back\\slash and /slash",
    "tab\tnewline\nbell\x07",
    "unicode é ß 漢字 🙂",
    "",
]


def _metas() -> list[TensorMeta]:
    shapes = [(4096, 4096), (), (0,), (3, 0, 5), (1,), (2, 3, 4, 5)]
    return [
        TensorMeta(name=n, shape=s, dtype=dt, offset=16 * i, nbytes=7 * i)
        for i, (n, s, dt) in enumerate(zip(NAMES, shapes, ["bfloat16", "float8_e4m3fn", "float32"] * 2, strict=True))
    ]


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def test_record_and_trailer_text_is_their_json() -> None:
    metas = _metas()
    for m in metas:
        assert m.json_text == _dumps(m.to_json())
    trailer = VersionTrailer(
        num_tensors=len(metas),
        tensors=tuple(AnnouncedTensor(name=m.name, shape=m.shape, dtype=m.dtype, nbytes=m.nbytes) for m in metas),
        digest="0123abcd" * 4,
    )
    assert trailer.json_text == _dumps(trailer.to_json())
    assert encode_metas(metas) == _dumps([m.to_json() for m in metas]).encode("utf-8")
    for tr in (trailer, None):
        want = _dumps({"m": [m.to_json() for m in metas], "t": tr.to_json() if tr else None}).encode("utf-8")
        assert encode_bucket_meta(metas, tr) == want
        assert decode_bucket_meta(want) == (tuple(metas), tr)
    assert decode_metas(encode_metas(metas)) == tuple(metas)


def test_digests_are_the_json_dumps_formulas() -> None:
    metas = _metas()
    trailer = VersionTrailer(num_tensors=0, tensors=(), digest="ff" * 16)
    for version, index, is_last, stream_id, tr in [(1, 0, False, 0, None), (7, 3, True, 2**62 - 1, trailer)]:
        rec = [version, index, is_last, stream_id, [m.to_json() for m in metas], tr.to_json() if tr else None]
        want = int.from_bytes(hashlib.blake2b(_dumps(rec).encode(), digest_size=8).digest(), "little") & (2**61 - 1)
        got = header_digest(version=version, index=index, is_last=is_last, stream_id=stream_id, metas=metas, trailer=tr)
        assert got == want
    d, h = VersionDigest(), hashlib.blake2b(digest_size=16)
    for i, m in enumerate(metas):
        d.add(i, m)
        h.update((_dumps([i, m.name, list(m.shape), m.dtype, m.offset, m.nbytes]) + "\n").encode("ascii"))
    assert d.hexdigest() == h.hexdigest()


def test_shared_records_are_one_object_per_layout_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    a = TensorMeta.of("w", (2, 3), "bfloat16", 32, 12)
    assert TensorMeta.of("w", (2, 3), "bfloat16", 32, 12) is a
    assert a == TensorMeta(name="w", shape=(2, 3), dtype="bfloat16", offset=32, nbytes=12)
    assert TensorMeta.of("w", (2, 3), "bfloat16", 48, 12) is not a
    assert TensorMeta.from_json(["w", [2, 3], "bfloat16", 32, 12]) is a  # what a transport decodes, shared too
    monkeypatch.setattr(wire, "_MAX_SHARED", len(wire._SHARED_METAS))
    b = TensorMeta.of("another", (1,), "float32", 0, 4)  # the table is full: it starts again
    assert len(wire._SHARED_METAS) == 1 and TensorMeta.of("another", (1,), "float32", 0, 4) is b


def test_a_records_own_problem_names_it() -> None:
    assert TensorMeta.of("ok", (4,), "float32", 16, 16).problem is None
    assert "unknown dtype 'int7'" in TensorMeta(name="x", shape=(4,), dtype="int7", offset=0, nbytes=4).problem
    assert "does not match" in TensorMeta(name="x", shape=(4,), dtype="float32", offset=0, nbytes=15).problem
    assert "multiple of 16" in TensorMeta(name="x", shape=(4,), dtype="float32", offset=8, nbytes=16).problem


def _every_dtype_stream() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    items = []
    for i, (key, dt) in enumerate(sorted(DTYPES.items())):
        raw = torch.randint(0, 256, (3 * 5 * 7 * dt.itemsize,), dtype=torch.uint8, generator=g)
        items.append((f"t{i}.{key}", raw.view(dt).view(3, 5, 7)))
        items.append((f"s{i}.{key}", raw[: dt.itemsize].view(dt).view(())))  # a scalar
        items.append((f"z{i}.{key}", torch.empty(0, 4, dtype=dt)))  # zero-size
    return items


@pytest.mark.parametrize("bucket_bytes", [64, 4096, 1 << 20], ids=["64B", "4KiB", "1MiB"])
def test_unpacked_views_are_the_sent_bytes_in_every_dtype(bucket_bytes: int) -> None:
    stream = _every_dtype_stream()
    sent = dict(stream)
    got = {}
    for bucket in pack_buckets(stream, version=1, bucket_bytes=bucket_bytes, check_finite_values=False):
        for name, view in unpack_bucket(bucket, expected_version=1):
            want = sent[name]
            assert view.dtype == want.dtype and view.shape == want.shape and view.is_contiguous()
            assert view.untyped_storage().data_ptr() == bucket.payload.untyped_storage().data_ptr()  # a view
            got[name] = view
    assert got.keys() == sent.keys()
    for name, want in sent.items():
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


def test_a_payload_of_odd_length_still_unpacks_and_overlaps_are_refused() -> None:
    x = torch.arange(8, dtype=torch.float32)
    (bucket,) = pack_buckets([("x", x), ("y", x + 1)], version=1, bucket_bytes=1 << 10)
    # one byte more than the packer writes: no float32 view of the whole payload exists, each tensor is sliced
    longer = Bucket(**{**bucket.__dict__, "payload": torch.cat([bucket.payload, torch.zeros(1, dtype=torch.uint8)])})
    pairs = dict(unpack_bucket(longer, verify_checksum=False))
    assert torch.equal(pairs["x"], x) and torch.equal(pairs["y"], x + 1)
    m0, m1 = bucket.metas
    swapped = Bucket(**{**bucket.__dict__, "metas": (m1, TensorMeta.of("x", (4,), m0.dtype, m1.offset + 16, 16))})
    with pytest.raises(RefitError, match="overlap"):
        unpack_bucket(swapped, verify_checksum=False)
