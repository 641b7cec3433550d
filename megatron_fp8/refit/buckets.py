"""Refit buckets: a stream of named tensors packed into flat byte buffers.

A refit moves one *version* of the weights as a sequence of :class:`Bucket`
objects. Each bucket is a 1-D ``uint8`` payload plus the :class:`TensorMeta`
records (name, shape, dtype, byte offset, byte count) of the tensors inside it.
The metadata is produced by the same single pass that copies the bytes
(:func:`pack_buckets`), so names, shapes, dtypes and order can never drift from
the data (DESIGN.md pitfall "metadata must come from the same iterator").

Validation happens on both ends:

* before a tensor is packed: known dtype, unique name, finite values (float
  tensors via ``isfinite``; FP8 tensors through their NaN/Inf bit patterns,
  e.g. ``0x7f``/``0xff`` for ``float8_e4m3fn``);
* when a bucket is unpacked (:func:`unpack_bucket`): version, checksum, every
  ``offset + nbytes`` inside the payload, no overlapping ranges, byte counts
  that agree with shape and dtype.

Offsets are aligned to :data:`ALIGN` (16) bytes, which satisfies every
supported dtype, so tensors come out as zero-copy views of the payload.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from megatron_fp8.errors import NonFiniteError, RefitError
from megatron_fp8.quant.formats import WIRE_DTYPES

logger = logging.getLogger(__name__)

ALIGN = 16
"""Byte alignment of every tensor offset inside a bucket payload (and of the payload length)."""

MiB = 1 << 20
GiB = 1 << 30

DTYPES: dict[str, torch.dtype] = WIRE_DTYPES
"""Dtypes a bucket can carry, by the string stored in :attr:`TensorMeta.dtype`."""

_DTYPE_TO_NAME: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


_CHECK_CHUNK = 1 << 24  # elements per reduction in the finiteness fast path (bounds the temporaries)


def _chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), _CHECK_CHUNK):
        yield flat[start : start + _CHECK_CHUNK]


def _float_has_nonfinite(t: torch.Tensor) -> bool:
    # amax propagates NaN and |-inf| = inf: one cheap reduction per chunk instead of a bool mask.
    return any(not bool(torch.isfinite(c.abs().amax())) for c in _chunks(t))


def _float_nonfinite_mask(t: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(t)


def _fp8_rule(
    has_bad: Callable[[torch.Tensor], torch.Tensor], mask: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[Callable[[torch.Tensor], bool], Callable[[torch.Tensor], torch.Tensor]]:
    def fast(t: torch.Tensor) -> bool:
        return any(bool(has_bad(c)) for c in _chunks(t.view(torch.uint8)))

    def slow(t: torch.Tensor) -> torch.Tensor:
        return mask(t.view(torch.uint8))

    return fast, slow


# dtype name -> (fast "holds a NaN/Inf?" test, mask of the offending elements for the error message).
# Integer and bool dtypes have no non-finite values and are absent.
_NONFINITE_RULES: dict[str, tuple[Callable[[torch.Tensor], bool], Callable[[torch.Tensor], torch.Tensor]]] = {
    "bfloat16": (_float_has_nonfinite, _float_nonfinite_mask),
    "float16": (_float_has_nonfinite, _float_nonfinite_mask),
    "float32": (_float_has_nonfinite, _float_nonfinite_mask),
    "float64": (_float_has_nonfinite, _float_nonfinite_mask),
    # e4m3fn: no Inf; NaN is S.1111.111 (0x7f, 0xff).
    "float8_e4m3fn": _fp8_rule(lambda b: (b & 0x7F).amax() == 0x7F, lambda b: (b & 0x7F) == 0x7F),
    # e5m2 (IEEE-like): exponent 11111 is Inf (mantissa 0) or NaN: 0x7c..0x7f, 0xfc..0xff.
    "float8_e5m2": _fp8_rule(lambda b: (b & 0x7F).amax() >= 0x7C, lambda b: (b & 0x7F) >= 0x7C),
    # fnuz formats: the single NaN is 0x80 (negative zero's pattern).
    "float8_e4m3fnuz": _fp8_rule(lambda b: (b == 0x80).any(), lambda b: b == 0x80),
    "float8_e5m2fnuz": _fp8_rule(lambda b: (b == 0x80).any(), lambda b: b == 0x80),
    # UE8M0 scales: 0xff is NaN.
    "float8_e8m0fnu": _fp8_rule(lambda b: b.amax() == 0xFF, lambda b: b == 0xFF),
}


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


def align_up(n: int, alignment: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``alignment`` (bytes)."""
    return (n + alignment - 1) // alignment * alignment


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


# ----------------------------------------------------------------------------- checksum

_CK_COLS = 251  # prime column count: word i gets weight (i mod 251) + 1
_CK_ROWS = 1 << 14  # rows per chunk: a chunk is 251 * 16384 words = ~15.7 MiB of payload
_M61 = (1 << 61) - 1
_CK_MUL = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)


def payload_checksum(payload: torch.Tensor) -> int:
    """A fast, position-sensitive checksum of a 1-D ``uint8`` payload, computed on its own device.

    The payload is read as unsigned 32-bit words ``w_i`` in chunks of ~15.7 MiB.
    Per chunk ``k`` it accumulates the plain sum ``S``, the position-weighted
    sum ``sum(w_i * ((i mod 251) + 1))`` and ``(k + 1) * S``; trailing bytes
    (length not a multiple of 4) and the length itself are mixed in; the result
    is reduced modulo the Mersenne prime ``2**61 - 1`` (fits in an int64 header).
    Every single-byte change, truncation, and misplacement of data by a
    non-multiple of 1004 bytes changes it. It is not cryptographic.

    Cost: one read of the payload plus an int64 temporary of 2x the chunk
    (~63 MiB) on the payload's device, two small reductions per chunk and one
    host sync per chunk; measured ~0.4 GB/s on one shared CPU core, memory-bound on a GPU.

    Args:
        payload: 1-D ``torch.uint8`` tensor (any device, contiguous).

    Returns:
        The checksum as a Python int in ``[0, 2**61 - 1)``.
    """
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise RefitError(
            f"a bucket payload must be a 1-D uint8 tensor, got {payload.dtype} of shape {tuple(payload.shape)}"
        )
    payload = payload.contiguous()
    n = payload.numel()
    nwords = n // 4
    s1 = s2 = s3 = 0
    if nwords:
        words = payload[: nwords * 4].view(torch.int32)
        weights = torch.arange(1, _CK_COLS + 1, dtype=torch.int64, device=payload.device)
        chunk = _CK_COLS * _CK_ROWS
        for k, start in enumerate(range(0, nwords, chunk)):
            w = words[start : start + chunk].to(torch.int64).bitwise_and_(0xFFFFFFFF)
            full = w.numel() // _CK_COLS * _CK_COLS
            tail = w[full:]
            colsum = w[:full].view(-1, _CK_COLS).sum(0)  # each < 2**46
            plain = colsum.sum() + tail.sum()
            weighted = (colsum * weights).sum() + (tail * weights[: tail.numel()]).sum()  # < 2**62
            p, q = torch.stack([plain, weighted]).tolist()
            s1 += p
            s2 += q
            s3 += (k + 1) * p
    rest = payload[nwords * 4 :].tolist()
    s_tail = sum((i + 1) * b for i, b in enumerate(rest))
    return (s1 + s2 * _CK_MUL[0] + s3 * _CK_MUL[1] + s_tail * _CK_MUL[2] + n) % _M61


# ----------------------------------------------------------------------------- bucket


@dataclass(frozen=True)
class Bucket:
    """One packed slice of a refit version.

    Attributes:
        version: refit version this bucket belongs to (strictly increasing across refits).
        index: position of the bucket in its version, starting at 0.
        is_last: whether this is the final bucket of the version.
        metas: tensors inside ``payload``, in stream order.
        payload: 1-D ``torch.uint8`` tensor; its length is a multiple of :data:`ALIGN`.
        checksum: :func:`payload_checksum` of ``payload`` computed by the sender.
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


def _first_bad_index(mask_bad: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    flat = int(mask_bad.reshape(-1).nonzero()[0, 0])
    if not shape:
        return ()
    idx = []
    for dim in reversed(shape):
        idx.append(flat % dim)
        flat //= dim
    return tuple(reversed(idx))


def check_finite(name: str, tensor: torch.Tensor, *, version: int | None = None) -> None:
    """Refuse a tensor holding NaN/Inf (float dtypes) or a NaN/Inf bit pattern (FP8 dtypes).

    Raises:
        NonFiniteError: naming the tensor, the count and the first offending index.
    """
    if tensor.numel() == 0:
        return
    rule = _NONFINITE_RULES.get(dtype_name(tensor.dtype, tensor_name=name))
    if rule is None:
        return
    has_bad, bad_mask = rule
    tensor = tensor.detach()
    if not has_bad(tensor):
        return
    bad = bad_mask(tensor)
    count = int(bad.sum())
    first = _first_bad_index(bad, tuple(tensor.shape))
    where = f" of version {version}" if version is not None else ""
    raise NonFiniteError(
        f"tensor {name!r}{where} ({tensor.dtype}, shape {tuple(tensor.shape)}) holds {count} NaN/Inf value(s), "
        f"first at index {first}; refusing to refit it (the engine keeps its last good version). "
        "Find the step that produced it (loss scale, grad clipping, zero-amax blocks) before refitting again.",
        name=name,
        block=first,
    )


class _Filling:
    """The single bucket being filled by :func:`pack_buckets`."""

    def __init__(self, version: int, index: int, capacity: int, device: torch.device):
        self.version = version
        self.index = index
        self.buffer = torch.empty(capacity, dtype=torch.uint8, device=device)
        self.capacity = capacity
        self.used = 0
        self.metas: list[TensorMeta] = []

    def fits(self, nbytes: int) -> bool:
        return align_up(self.used) + nbytes <= self.capacity

    def add(self, name: str, tensor: torch.Tensor, dt: str, nbytes: int) -> None:
        offset = align_up(self.used)
        if offset > self.used:
            self.buffer[self.used : offset].zero_()
        if nbytes:
            src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            self.buffer[offset : offset + nbytes].copy_(src)
        self.metas.append(TensorMeta(name=name, shape=tuple(tensor.shape), dtype=dt, offset=offset, nbytes=nbytes))
        self.used = offset + nbytes

    def finish(self, *, is_last: bool) -> Bucket:
        end = align_up(self.used)
        if end > self.used:
            self.buffer[self.used : end].zero_()
        payload = self.buffer[:end]
        return Bucket(
            version=self.version,
            index=self.index,
            is_last=is_last,
            metas=tuple(self.metas),
            payload=payload,
            checksum=payload_checksum(payload),
        )


def pack_buckets(
    stream: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_bytes: int,
    device: torch.device | str | None = None,
    check_finite_values: bool = True,
) -> Iterator[Bucket]:
    """Pack a stream of named tensors into buckets, in one pass, with bounded memory.

    Each tensor is validated and its bytes copied at its (16-byte aligned)
    offset as it is consumed; a bucket is yielded as soon as the next tensor does
    not fit (or the stream ends, then with ``is_last=True``). Only one bucket is
    ever being filled; a tensor larger than ``bucket_bytes`` gets a bucket of its
    own sized to it. Zero-size tensors are carried (metadata only). A fresh
    buffer is allocated per bucket, so a yielded bucket stays valid while a
    transport still sends it.

    Args:
        stream: ``(name, tensor)`` pairs; any supported dtype (:data:`DTYPES`),
            any device, contiguous or not.
        version: refit version stamped on every bucket (>= 0).
        bucket_bytes: target payload capacity in bytes (>= :data:`ALIGN`).
        device: where payload buffers live; default: the device of the first
            tensor of each bucket.
        check_finite_values: refuse NaN/Inf (see :func:`check_finite`).

    Yields:
        :class:`Bucket` objects with indices 0, 1, ...; the last has ``is_last=True``.

    Raises:
        NonFiniteError: a tensor holds NaN/Inf (raised before its bucket is yielded).
        RefitError: duplicate name, unsupported dtype, bad argument, or an empty stream.
    """
    if not isinstance(version, int) or version < 0:
        raise RefitError(f"refit version must be a non-negative int, got {version!r}")
    if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN:
        raise RefitError(f"bucket_bytes must be an int >= {ALIGN}, got {bucket_bytes!r}")
    dev = torch.device(device) if device is not None else None
    seen: set[str] = set()
    index = 0
    current: _Filling | None = None
    for item in stream:
        try:
            name, tensor = item
        except (TypeError, ValueError):
            raise RefitError(f"refit stream items must be (name, tensor) pairs, got {type(item).__name__}") from None
        if not isinstance(name, str) or not name:
            raise RefitError(f"refit stream yielded a tensor with an invalid name {name!r} (need a non-empty str)")
        if not isinstance(tensor, torch.Tensor):
            raise RefitError(f"refit stream item {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if name in seen:
            raise RefitError(
                f"tensor {name!r} appears twice in the stream of refit version {version}; each name must be sent "
                "once (check the name mapping for fused/unfused duplicates)"
            )
        seen.add(name)
        dt = dtype_name(tensor.dtype, tensor_name=name)
        if check_finite_values:
            check_finite(name, tensor, version=version)
        nbytes = tensor.numel() * tensor.element_size()
        if current is not None and not current.fits(nbytes):
            bucket = current.finish(is_last=False)
            current = None
            yield bucket
            index += 1
        if current is None:
            capacity = max(bucket_bytes, align_up(nbytes))
            current = _Filling(version, index, capacity, dev if dev is not None else tensor.device)
        current.add(name, tensor, dt, nbytes)
    if current is None:
        raise RefitError(
            f"the stream of refit version {version} yielded no tensors; an empty refit is almost certainly a bug "
            "(check the FP8 manifest and the parameter filter)"
        )
    yield current.finish(is_last=True)


def unpack_bucket(
    bucket: Bucket, *, expected_version: int | None = None, verify_checksum: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """Validate a bucket and return its tensors as typed, shaped views of the payload.

    Args:
        bucket: a received bucket.
        expected_version: refuse a bucket of any other version.
        verify_checksum: recompute :func:`payload_checksum` and compare.

    Returns:
        ``[(name, tensor), ...]`` in the bucket's metadata order; each tensor is
        a view into ``bucket.payload`` (copy it before the payload is reused).

    Raises:
        RefitError: naming the bucket index and, where it applies, the tensor:
            version mismatch, payload not 1-D uint8, checksum mismatch, unknown
            dtype, ``nbytes`` disagreeing with shape and dtype, misaligned or
            out-of-range offset, overlapping tensors, duplicate names.
    """
    where = bucket.describe()
    if expected_version is not None and bucket.version != expected_version:
        raise RefitError(
            f"{where}: expected version {expected_version}; the stream mixes refit versions "
            "(a stale bucket from an aborted refit, or two senders on one transport)"
        )
    payload = bucket.payload
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise RefitError(f"{where}: payload must be a 1-D uint8 tensor")
    size = payload.numel()
    if verify_checksum:
        got = payload_checksum(payload)
        if got != bucket.checksum:
            raise RefitError(
                f"{where}: checksum mismatch over {size} payload bytes (sender {bucket.checksum}, received {got}); "
                "the payload was corrupted or truncated in transit"
            )
    names: set[str] = set()
    for m in bucket.metas:
        dt = torch_dtype(m.dtype, tensor_name=m.name)
        itemsize = torch.empty((), dtype=dt).element_size()
        if m.nbytes != m.numel * itemsize:
            raise RefitError(
                f"{where}, tensor {m.name!r}: nbytes {m.nbytes} does not match shape {m.shape} x {m.dtype} "
                f"({m.numel * itemsize} bytes)"
            )
        if m.offset < 0 or m.offset % ALIGN:
            raise RefitError(f"{where}, tensor {m.name!r}: offset {m.offset} is not a non-negative multiple of {ALIGN}")
        if m.offset + m.nbytes > size:
            raise RefitError(
                f"{where}, tensor {m.name!r}: bytes [{m.offset}, {m.offset + m.nbytes}) run past the payload end "
                f"({size} bytes); the payload is truncated or the metadata does not belong to it"
            )
        if m.name in names:
            raise RefitError(f"{where}, tensor {m.name!r}: name appears twice in the bucket")
        names.add(m.name)
    by_offset = sorted((m for m in bucket.metas if m.nbytes), key=lambda m: m.offset)
    for prev, nxt in zip(by_offset, by_offset[1:], strict=False):
        if nxt.offset < prev.offset + prev.nbytes:
            raise RefitError(
                f"{where}, tensor {nxt.name!r}: bytes from offset {nxt.offset} overlap tensor {prev.name!r} "
                f"[{prev.offset}, {prev.offset + prev.nbytes})"
            )
    out = []
    for m in bucket.metas:
        dt = DTYPES[m.dtype]
        view = payload[m.offset : m.offset + m.nbytes].view(dt).view(m.shape)
        out.append((m.name, view))
    return out


# ----------------------------------------------------------------------------- sizing and versions


def default_bucket_bytes(
    device: torch.device | str | None = None,
    *,
    cpu_bytes: int = 64 * MiB,
    cuda_max_bytes: int = 1 * GiB,
    cuda_free_fraction: float = 0.05,
    min_bytes: int = 1 * MiB,
) -> int:
    """A bucket size suited to ``device``.

    CPU: ``cpu_bytes`` (64 MiB). CUDA: ``min(cuda_max_bytes, cuda_free_fraction *
    free memory)``, never below ``min_bytes``, rounded down to a MiB. With a
    double-buffered transport two buckets are in flight per end, so 5% of free
    memory keeps the refit's footprint near 10%.

    Args:
        device: target device; default CPU.
        cpu_bytes: size used for CPU devices, bytes.
        cuda_max_bytes: upper bound for CUDA devices, bytes.
        cuda_free_fraction: fraction of currently free device memory, in (0, 1].
        min_bytes: lower bound, bytes.

    Returns:
        Bucket capacity in bytes (a multiple of :data:`ALIGN`).
    """
    if not 0 < cuda_free_fraction <= 1:
        raise RefitError(f"cuda_free_fraction must be in (0, 1], got {cuda_free_fraction}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        size = min(cuda_max_bytes, int(free * cuda_free_fraction)) // MiB * MiB
    else:
        size = cpu_bytes
    return align_up(max(min_bytes, size))


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
