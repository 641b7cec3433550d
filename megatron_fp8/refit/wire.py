"""The refit wire format: what one bucket of one version carries, and how its metadata is encoded.

A refit moves one *version* of the weights as a sequence of :class:`Bucket`
objects. Each bucket is a 1-D ``uint8`` payload plus the :class:`TensorMeta`
records (name, shape, dtype, byte offset, byte count) of the tensors inside it.
Metadata travels as compact UTF-8 JSON (:func:`encode_metas` /
:func:`decode_metas`); dtypes travel by name (:data:`DTYPES`, from
:data:`megatron_fp8.quant.formats.WIRE_DTYPES`). Versions strictly increase
(:class:`RefitVersion`).

Packing and unpacking live in :mod:`megatron_fp8.refit.buckets`, the payload
checksum in :mod:`megatron_fp8.refit.checksum`, the NaN/Inf refusal in
:mod:`megatron_fp8.refit.finite`.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.quant.formats import WIRE_DTYPES

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
        raise RefitError(f"{who}unknown dtype {name!r} in refit metadata; valid dtypes: {sorted(DTYPES)}") from None


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
            return cls(name=name, shape=shape_t, dtype=dt, offset=int(offset), nbytes=int(nbytes))
        except (TypeError, ValueError) as exc:
            raise RefitError(f"malformed refit metadata record {item!r}: {exc}") from None


def encode_metas(metas: Iterable[TensorMeta]) -> bytes:
    """Serialize metadata records to UTF-8 JSON bytes (what travels before a payload)."""
    return json.dumps([m.to_json() for m in metas], separators=(",", ":")).encode("utf-8")


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
class Bucket:
    """One packed slice of a refit version.

    Attributes:
        version: refit version this bucket belongs to (strictly increasing across refits).
        index: position of the bucket in its version, starting at 0.
        is_last: whether this is the final bucket of the version.
        metas: tensors inside ``payload``, in stream order.
        payload: 1-D ``torch.uint8`` tensor; its length is a multiple of :data:`ALIGN`.
        checksum: :func:`~megatron_fp8.refit.checksum.payload_checksum` of ``payload`` computed by the sender.
    """

    version: int
    index: int
    is_last: bool
    metas: tuple[TensorMeta, ...]
    payload: torch.Tensor
    checksum: int

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
