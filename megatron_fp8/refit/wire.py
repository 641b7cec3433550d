"""The refit wire format: what one bucket of one version carries, and how its metadata is encoded.

A refit moves one *version* of the weights as a sequence of :class:`Bucket`
objects. Each bucket is a 1-D ``uint8`` payload plus the :class:`TensorMeta`
records (name, shape, dtype, byte offset, byte count) of the tensors inside it.
A version is self-describing: its last bucket carries a :class:`VersionTrailer`
(the tensor count, every tensor's name, shape, dtype and byte count, and a
:class:`VersionDigest` over every ``(bucket index, name, shape, dtype, offset,
nbytes)``), so a receiver commits only the exact announced set. Every bucket is
stamped with a random ``stream_id`` of its sending, so two senders on one wire
are never confused. Metadata travels as compact UTF-8 JSON
(:func:`encode_bucket_meta` / :func:`decode_bucket_meta`); dtypes travel by name
(:data:`DTYPES`, from :data:`megatron_fp8.quant.formats.WIRE_DTYPES`). Versions
strictly increase (:class:`RefitVersion`). After each version the receiver
answers with a :class:`RefitOutcome`.

Packing and unpacking live in :mod:`megatron_fp8.refit.buckets`, the payload
checksum in :mod:`megatron_fp8.refit.integrity.checksum`, the NaN/Inf refusal in
:mod:`megatron_fp8.refit.integrity.finite`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from json.encoder import encode_basestring_ascii as _json_str

import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.layout import contiguous_strides
from megatron_fp8.quant.formats import WIRE_DTYPES
from megatron_fp8.vocab import REFIT_OUTCOMES

logger = logging.getLogger(__name__)

ALIGN = 16
"""Byte alignment of every tensor offset inside a bucket payload (and of the payload length)."""

DTYPES: dict[str, torch.dtype] = WIRE_DTYPES
"""Dtypes a bucket can carry, by the string stored in :attr:`TensorMeta.dtype`."""

_DTYPE_TO_NAME: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype, *, tensor_name: str | None = None) -> str:
    """The :data:`DTYPES` key of ``dtype``.

    Raises:
        RefitError: ``dtype`` cannot travel in a bucket; the message lists the valid dtypes.
    """
    try:
        return _DTYPE_TO_NAME[dtype]
    except KeyError:
        who = f"tensor {tensor_name!r}: " if tensor_name else ""
        raise RefitError(
            f"{who}dtype {dtype} cannot be sent in a refit bucket; valid dtypes: {sorted(DTYPES)}. "
            "Cast it (or view it as bytes) before handing it to the refit stream."
        ) from None


def torch_dtype(name: str, *, tensor_name: str | None = None) -> torch.dtype:
    """The torch dtype stored under ``name`` in :data:`DTYPES`.

    Raises:
        RefitError: unknown name; the message lists the valid names.
    """
    try:
        return DTYPES[name]
    except KeyError:
        who = f"tensor {tensor_name!r}: " if tensor_name else ""
        raise RefitError(f"{who}{_unknown_dtype(name)}") from None


def _unknown_dtype(name: str) -> str:
    return f"unknown dtype {name!r} in refit metadata; valid dtypes: {sorted(DTYPES)}"


def _shape_text(shape: tuple[int, ...]) -> str:
    """``shape`` as the inside of its compact JSON list (``"4096,4096"``)."""
    return ",".join([str(int(d)) for d in shape])


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives inside a bucket payload.

    Attributes:
        name: HF parameter name, e.g. ``model.layers.0.self_attn.q_proj.weight_scale_inv``.
        shape: tensor shape (``()`` for a scalar).
        dtype: a :data:`DTYPES` key, e.g. ``"float8_e4m3fn"``.
        offset: byte offset inside the payload, a multiple of :data:`ALIGN`.
        nbytes: byte count, ``prod(shape) * itemsize``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        """Number of elements (``prod(shape)``; 1 for a scalar)."""
        return math.prod(self.shape)

    def to_json(self) -> list:
        """A compact JSON-able form ``[name, shape, dtype, offset, nbytes]``."""
        return [self.name, list(self.shape), self.dtype, self.offset, self.nbytes]

    @cached_property
    def json_text(self) -> str:
        """:meth:`to_json` as compact JSON text (``json.dumps(..., separators=(",", ":"))``'s characters), made once
        per record: the header digest, the version digest and the metadata encoding of both ends reuse it."""
        shape = _shape_text(self.shape)
        return f"[{_json_str(self.name)},[{shape}],{_json_str(self.dtype)},{int(self.offset)},{int(self.nbytes)}]"

    @cached_property
    def problem(self) -> str | None:
        """What is wrong with this record on its own (an unknown dtype, a byte count that disagrees with shape and
        dtype, an offset not a non-negative multiple of :data:`ALIGN`), or ``None``; checked once per record."""
        dt = DTYPES.get(self.dtype)
        if dt is None:
            return _unknown_dtype(self.dtype)
        if self.nbytes != self.numel * dt.itemsize:
            return (
                f"nbytes {self.nbytes} does not match shape {self.shape} x {self.dtype} "
                f"({self.numel * dt.itemsize} bytes)"
            )
        if self.offset < 0 or self.offset % ALIGN:
            return f"offset {self.offset} is not a non-negative multiple of {ALIGN}"
        return None

    @cached_property
    def strides(self) -> tuple[int, ...]:
        """The contiguous strides of :attr:`shape`, in elements."""
        return contiguous_strides(self.shape)

    @classmethod
    def of(cls, name: str, shape: tuple[int, ...], dtype: str, offset: int, nbytes: int) -> TensorMeta:
        """The record with these fields, shared: a refit lays out the same records every step, so each end keeps
        one object per record (and its :attr:`json_text`) across versions instead of building them again.

        At most :data:`_MAX_SHARED` records are kept (all are dropped when that is reached; a record is immutable,
        so a dropped one stays valid wherever it is still used).
        """
        key = (name, shape, dtype, offset, nbytes)
        meta = _SHARED_METAS.get(key)
        if meta is None:
            if len(_SHARED_METAS) >= _MAX_SHARED:
                _SHARED_METAS.clear()
            meta = _SHARED_METAS[key] = cls(name=name, shape=shape, dtype=dtype, offset=offset, nbytes=nbytes)
        return meta

    @classmethod
    def from_json(cls, item: object) -> TensorMeta:
        """Inverse of :meth:`to_json`.

        Raises:
            RefitError: the item is not a well-formed metadata record.
        """
        try:
            name, shape, dt, offset, nbytes = item  # type: ignore[misc]
            if not isinstance(name, str) or not isinstance(dt, str):
                raise TypeError("name and dtype must be strings")
            shape_t = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape_t):
                raise ValueError("negative dimension")
            return cls.of(name, shape_t, dt, int(offset), int(nbytes))
        except (TypeError, ValueError) as exc:
            raise RefitError(f"malformed refit metadata record {item!r}: {exc}") from None


_SHARED_METAS: dict[tuple, TensorMeta] = {}
_MAX_SHARED = 1 << 17
"""Records :meth:`TensorMeta.of` keeps (a 70B model with its scales has ~2,000 per layout)."""


def encode_metas(metas: Iterable[TensorMeta]) -> bytes:
    """Serialize metadata records to UTF-8 JSON bytes (what travels before a payload)."""
    return ("[" + ",".join([m.json_text for m in metas]) + "]").encode("utf-8")


def decode_metas(data: bytes) -> tuple[TensorMeta, ...]:
    """Parse bytes written by :func:`encode_metas`.

    Raises:
        RefitError: not valid JSON or not a list of records.
    """
    try:
        items = json.loads(data.decode("utf-8")) if data else []
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RefitError(f"refit metadata is not valid JSON ({exc}); the header or metadata was corrupted") from None
    if not isinstance(items, list):
        raise RefitError(f"refit metadata must be a JSON list, got {type(items).__name__}")
    return tuple(TensorMeta.from_json(i) for i in items)


@dataclass(frozen=True)
class AnnouncedTensor:
    """One tensor of a version as its trailer announces it.

    Attributes:
        name: HF parameter name.
        shape: tensor shape.
        dtype: a :data:`DTYPES` key.
        nbytes: byte count.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def describe(self) -> str:
        """``"(256,) bfloat16, 512 bytes"``, for messages."""
        return f"{self.shape} {self.dtype}, {self.nbytes} bytes"

    @cached_property
    def json_text(self) -> str:
        """``[name, shape, dtype, nbytes]`` as compact JSON text (made once)."""
        return f"[{_json_str(self.name)},[{_shape_text(self.shape)}],{_json_str(self.dtype)},{int(self.nbytes)}]"


@dataclass(frozen=True)
class VersionTrailer:
    """What a version announces in its last bucket: the exact set of tensors the receiver must commit.

    Attributes:
        num_tensors: tensors in the version.
        tensors: every tensor of the version in stream order.
        digest: :class:`VersionDigest` hex digest over every ``(bucket index, name, shape, dtype, offset,
            nbytes)`` of the version.
    """

    num_tensors: int
    tensors: tuple[AnnouncedTensor, ...]
    digest: str

    def to_json(self) -> dict:
        """A compact JSON-able form."""
        return {
            "n": self.num_tensors,
            "t": [[t.name, list(t.shape), t.dtype, t.nbytes] for t in self.tensors],
            "d": self.digest,
        }

    @cached_property
    def json_text(self) -> str:
        """:meth:`to_json` as compact JSON text (``json.dumps(..., separators=(",", ":"))``'s characters), made once."""
        tensors = ",".join([t.json_text for t in self.tensors])
        return f'{{"n":{int(self.num_tensors)},"t":[{tensors}],"d":{_json_str(self.digest)}}}'

    @classmethod
    def from_json(cls, item: object) -> VersionTrailer:
        """Inverse of :meth:`to_json`.

        Raises:
            RefitError: the item is not a well-formed trailer.
        """
        try:
            tensors = tuple(
                AnnouncedTensor(name=str(n), shape=tuple(int(s) for s in shape), dtype=str(dt), nbytes=int(nb))
                for n, shape, dt, nb in item["t"]  # type: ignore[index]
            )
            trailer = cls(num_tensors=int(item["n"]), tensors=tensors, digest=str(item["d"]))  # type: ignore[index]
        except (TypeError, ValueError, KeyError) as exc:
            raise RefitError(f"malformed refit version trailer: {exc!r}") from None
        if trailer.num_tensors != len(trailer.tensors):
            raise RefitError(
                f"refit version trailer announces {trailer.num_tensors} tensors but lists {len(trailer.tensors)}"
            )
        return trailer


class VersionDigest:
    """Running digest (BLAKE2b-128) over every ``(bucket index, name, shape, dtype, offset, nbytes)`` of a version.

    Sender and receiver feed it the same records in stream order; equal hex digests mean the receiver got
    the metadata the sender packed, bucket by bucket, in the same order.
    """

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)

    def add(self, index: int, meta: TensorMeta) -> None:
        """Feed one tensor record of bucket ``index``: the compact JSON of
        ``[index, name, shape, dtype, offset, nbytes]`` and a newline (the bytes of
        ``json.dumps(record, separators=(",", ":"))``, made from the record's :attr:`TensorMeta.json_text`)."""
        self._h.update(f"[{int(index)},{meta.json_text[1:]}\n".encode("ascii"))

    def hexdigest(self) -> str:
        """The digest so far, 32 hex characters."""
        return self._h.hexdigest()


def encode_bucket_meta(metas: Iterable[TensorMeta], trailer: VersionTrailer | None) -> bytes:
    """Serialize a bucket's metadata records and its trailer (if any) to UTF-8 JSON bytes."""
    records = ",".join([m.json_text for m in metas])
    return f'{{"m":[{records}],"t":{trailer.json_text if trailer is not None else "null"}}}'.encode()


def decode_bucket_meta(data: bytes) -> tuple[tuple[TensorMeta, ...], VersionTrailer | None]:
    """Parse bytes written by :func:`encode_bucket_meta`: ``(metas, trailer or None)``.

    Raises:
        RefitError: not valid JSON or not a well-formed metadata object.
    """
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RefitError(f"refit metadata is not valid JSON ({exc}); the header or metadata was corrupted") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("m"), list):
        raise RefitError(f"refit bucket metadata must be a JSON object with a list 'm', got {type(obj).__name__}")
    metas = tuple(TensorMeta.from_json(i) for i in obj["m"])
    trailer = VersionTrailer.from_json(obj["t"]) if obj.get("t") is not None else None
    return metas, trailer


def bucket_from_wire(
    *,
    version: int,
    index: int,
    is_last: bool,
    meta: bytes,
    payload: torch.Tensor,
    checksum: int,
    stream_id: int,
    where: str,
) -> Bucket:
    """The :class:`Bucket` a transport received, decoded from its header fields and metadata bytes.

    Undecodable metadata is logged and left empty: the bucket's checksum, which covers its metadata,
    then refuses it in the receiver, which names the bucket (one refusal path for every transport).

    Args:
        where: the transport, for the log line (e.g. ``"gloo transport"``).
    """
    try:
        metas, trailer = decode_bucket_meta(meta)
    except RefitError as exc:
        logger.warning("%s: bucket %d of version %d: %s", where, index, version, exc)
        metas, trailer = (), None
    return Bucket(
        version=version,
        index=index,
        is_last=bool(is_last),
        metas=metas,
        payload=payload,
        checksum=checksum,
        stream_id=stream_id,
        trailer=trailer,
    )


@dataclass(frozen=True)
class RefitOutcome:
    """What a receiver reports back to the sender after one version.

    Attributes:
        version: the refit version.
        status: a :data:`megatron_fp8.vocab.REFIT_OUTCOMES` key (``committed``, ``refused``, ``rolled_back``, ``not_serving``).
        reason: why it was not committed (``""`` when committed), naming the tensor or check.
        stream_id: the :attr:`Bucket.stream_id` of the sending it answers.
        receiver: who answered, e.g. ``"rank 1"``, for messages.
    """

    version: int
    status: str
    reason: str = ""
    stream_id: int = 0
    receiver: str = "receiver"

    def __post_init__(self) -> None:
        if self.status not in REFIT_OUTCOMES:
            raise RefitError(f"unknown refit outcome {self.status!r}; valid outcomes: {sorted(REFIT_OUTCOMES)}")

    @property
    def committed(self) -> bool:
        """Whether the receiver committed the version."""
        return self.status == "committed"


@dataclass(frozen=True)
class Bucket:
    """One packed slice of a refit version.

    Attributes:
        version: refit version this bucket belongs to (strictly increasing across refits).
        index: position of the bucket in its version, starting at 0.
        is_last: whether this is the final bucket of the version.
        metas: tensors inside ``payload``, in stream order.
        payload: 1-D ``torch.uint8`` tensor; its length is a multiple of :data:`ALIGN`.
        checksum: :func:`~megatron_fp8.refit.integrity.checksum.bucket_checksum` computed by the sender: the payload
            checksum mixed with a digest of the header (version, index, is_last, stream_id, trailer) and metas.
        stream_id: random id of the sending this bucket belongs to (``0 <= id < 2**62``), echoed in the outcome.
        trailer: the version's announced set; present exactly on the last bucket.
    """

    version: int
    index: int
    is_last: bool
    metas: tuple[TensorMeta, ...]
    payload: torch.Tensor
    checksum: int
    stream_id: int = 0
    trailer: VersionTrailer | None = None

    @property
    def nbytes(self) -> int:
        """Payload length in bytes (tensor bytes plus alignment padding)."""
        return int(self.payload.numel())

    @property
    def tensor_bytes(self) -> int:
        """Sum of the tensors' byte counts (no padding)."""
        return sum(m.nbytes for m in self.metas)

    def describe(self) -> str:
        """``"bucket 3 of version 7"``, for messages."""
        return f"bucket {self.index} of version {self.version}"


class RefitVersion:
    """A thread-safe, strictly increasing refit version counter.

    The sender calls :meth:`next` for each refit; receivers call
    :meth:`observe` on what arrives, which refuses anything not newer than the
    last version seen.
    """

    def __init__(self, start: int = 0):
        if start < 0:
            raise RefitError(f"refit versions start at a non-negative int, got {start}")
        self._last = start
        self._lock = threading.Lock()

    @property
    def last(self) -> int:
        """The most recent version issued or observed (``start`` before any)."""
        return self._last

    def next(self) -> int:
        """Issue the next version (``last + 1``)."""
        with self._lock:
            self._last += 1
            return self._last

    def observe(self, version: int, *, what: str = "refit") -> None:
        """Record ``version`` as seen.

        Raises:
            RefitError: ``version`` is not greater than :attr:`last`.
        """
        with self._lock:
            if not isinstance(version, int) or version <= self._last:
                raise RefitError(
                    f"{what} version {version!r} is not newer than the last version {self._last}; versions must "
                    "strictly increase (use RefitVersion.next())"
                )
            self._last = version
