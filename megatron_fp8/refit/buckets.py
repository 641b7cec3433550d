"""Refit buckets: a stream of named tensors packed into flat byte buffers, and unpacked again.

:func:`pack_buckets` turns a stream of ``(name, tensor)`` pairs into
:class:`~megatron_fp8.refit.wire.Bucket` objects (the wire format, see
:mod:`megatron_fp8.refit.wire`). The metadata is produced by the same single
pass that copies the bytes, so names, shapes, dtypes and order can never drift
from the data (DESIGN.md pitfall "metadata must come from the same iterator").

Validation happens on both ends:

* as a tensor is taken: known dtype, unique name; before its bucket is yielded:
  finite values (float tensors via an infinity norm, FP8 tensors through their
  NaN/Inf bit patterns, e.g. ``0x7f``/``0xff`` for ``float8_e4m3fn``; see
  :class:`~megatron_fp8.refit.integrity.finite.FiniteProbe`), read back with the checksum
  in the bucket's one host sync;
* when a bucket is unpacked (:func:`unpack_bucket`): version, checksum (over the
  payload *and* the header and metadata), every ``offset + nbytes`` inside the
  payload, no overlapping ranges, byte counts that agree with shape and dtype.

The last bucket of a version carries its :class:`VersionTrailer` (tensor count,
every name/shape/dtype/nbytes, and the :class:`VersionDigest`), built by the
same pass.

Offsets are aligned to :data:`ALIGN` (16) bytes, which satisfies every
supported dtype, so tensors come out as zero-copy views of the payload.

The wire names (:class:`TensorMeta`, :class:`Bucket`, :class:`RefitVersion`,
:data:`DTYPES`, ...) are re-exported here for existing imports.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.layout import ceil_div
from megatron_fp8.quant.grouped import zero_scalar
from megatron_fp8.refit import fused_fill
from megatron_fp8.refit.fused_fill import PATTERNS, Segment, fill_and_flag
from megatron_fp8.refit.inbucket import BucketJobs, PendingPart
from megatron_fp8.refit.integrity.checksum import (
    HostRead,
    bucket_checksum,
    checksum_partials,
    finish_checksum,
    header_digest,
    payload_checksum,
)
from megatron_fp8.refit.integrity.finite import FiniteProbe, FlagProbe, check_finite
from megatron_fp8.refit.wire import (
    ALIGN,
    DTYPES,
    AnnouncedTensor,
    Bucket,
    RefitVersion,
    TensorMeta,
    VersionDigest,
    VersionTrailer,
    decode_metas,
    dtype_name,
    encode_metas,
    torch_dtype,
)

__all__ = [
    "ALIGN",
    "DTYPES",
    "GiB",
    "MiB",
    "Bucket",
    "RefitVersion",
    "TensorMeta",
    "align_up",
    "bucket_checksum",
    "check_finite",
    "checksum_error",
    "checksum_of",
    "decode_metas",
    "default_bucket_bytes",
    "dtype_name",
    "encode_metas",
    "pack_buckets",
    "payload_checksum",
    "torch_dtype",
    "unpack_bucket",
    "verify_bucket_checksum",
]

MiB = 1 << 20
GiB = 1 << 30


def align_up(n: int, alignment: int = ALIGN) -> int:
    """``n`` (bytes, >= 0) rounded up to a multiple of ``alignment`` (bytes)."""
    return ceil_div(n, alignment) * alignment


def header_digest_of(bucket: Bucket) -> int:
    """:func:`header_digest` of a bucket's own header fields, metadata and trailer."""
    return header_digest(
        version=bucket.version,
        index=bucket.index,
        is_last=bucket.is_last,
        stream_id=bucket.stream_id,
        metas=bucket.metas,
        trailer=bucket.trailer,
    )


def checksum_of(bucket: Bucket) -> int:
    """:func:`bucket_checksum` recomputed from a bucket's fields and payload (what the receiver compares)."""
    return bucket_checksum(
        bucket.payload,
        version=bucket.version,
        index=bucket.index,
        is_last=bucket.is_last,
        stream_id=bucket.stream_id,
        metas=bucket.metas,
        trailer=bucket.trailer,
    )


class _Filling:
    """The single bucket being filled by :func:`pack_buckets`.

    Tensors are only recorded as they arrive (offset, metadata, a reference to the source); :meth:`launch`
    moves them all at once: one multi-tensor copy into the bucket (the alignment gaps zeroed in the same op),
    the FP8 quantization of the bucket's pending parts (:mod:`megatron_fp8.refit.inbucket`) straight into their
    places, the NaN/Inf probe of the bucket's typed views (:class:`FiniteProbe`; a quantized weight is probed
    through its block scales, never through its FP8 bytes), the payload checksum's partials, and one host read
    for both (:meth:`_Launched.complete`). A handful of device ops per bucket, whatever its tensor count.
    """

    def __init__(self, version: int, index: int, capacity: int, device: torch.device, stream_id: int):
        self.version = version
        self.index = index
        self.stream_id = stream_id
        self.buffer = torch.empty(capacity, dtype=torch.uint8, device=device)
        self.capacity = capacity
        self.used = 0
        self.metas: list[TensorMeta] = []
        self._copies: list[Segment] = []  # plain tensors (probe=True) and parts quantized in an earlier bucket
        self._copy_meta: list[int] = []  # the meta index of each copy
        self._gaps: list[tuple[int, int]] = []  # [start, end) byte ranges zeroed
        self._jobs = BucketJobs()
        self._parts: dict[int, PendingPart] = {}  # meta index -> the pending part placed there

    def fits(self, nbytes: int) -> bool:
        return align_up(self.used) + nbytes <= self.capacity

    def add(self, name: str, tensor: torch.Tensor | PendingPart, dt: str, nbytes: int) -> None:
        """Record ``tensor`` at the next aligned offset; its bytes are read (or quantized) when the bucket is finished."""
        offset = align_up(self.used)
        if offset > self.used:
            self._gaps.append((self.used, offset))
        if isinstance(tensor, PendingPart):
            src = self._jobs.place(tensor, self.buffer, offset)
            if src is not None:  # its job ran in an earlier bucket
                self._copies.append(Segment(offset, src.reshape(-1)))
                self._copy_meta.append(len(self.metas))
            self._parts[len(self.metas)] = tensor
        elif nbytes:  # a contiguous tensor is kept as it is: no op per tensor (the fill detaches what it views)
            src = tensor if tensor.is_contiguous() else tensor.detach().contiguous()
            self._copies.append(Segment(offset, src, probe=True))
            self._copy_meta.append(len(self.metas))
        self.metas.append(TensorMeta.of(name, tuple(tensor.shape), dt, offset, nbytes))
        self.used = offset + nbytes

    def _fill(self) -> list:
        """Copy the recorded sources, zero the gaps and quantize the pending parts (torch path); the jobs'
        ``(job, scales)``."""
        buf = self.buffer
        dst = [buf[c.offset : c.offset + c.src.numel() * c.src.element_size()] for c in self._copies]
        src = [c.src.detach().reshape(-1).view(torch.uint8) for c in self._copies]
        if self._gaps:
            zero = zero_scalar(buf.device, torch.uint8)
            dst += [buf[a:b] for a, b in self._gaps]
            src += [zero.expand(b - a) for a, b in self._gaps]
        return self._jobs.run((dst, src))

    def _fill_fused(self, metas: tuple[TensorMeta, ...], check_finite_values: bool) -> tuple[list, list]:
        """The CUDA path: the pending parts quantized, then every copy and gap in one Triton pass per element width
        that also flags NaN/Inf (:mod:`megatron_fp8.refit.fused_fill`); the jobs' ``(job, scales)`` and the probes."""
        jobs = self._jobs.run(([], []), fused=True)
        zeros = _zeros16(self.buffer.device)
        segments = [c if check_finite_values else Segment(c.offset, c.src) for c in self._copies]
        segments += [Segment(a, zeros[: b - a]) for a, b in self._gaps]
        flags = fill_and_flag(self.buffer, segments)
        entries = [metas[i] if c.probe else None for i, c in zip(self._copy_meta, self._copies, strict=True)]
        probes: list = (
            [FlagProbe(entries + [None] * len(self._gaps), self.buffer, flags)] if check_finite_values else []
        )
        if check_finite_values:  # floating dtypes without a bit pattern (the fnuz formats): the torch probe
            other = [m for m in entries if m is not None and DTYPES[m.dtype] not in PATTERNS]
            if other:
                probes.append(FiniteProbe([(m.name, _view(self.buffer, m)) for m in other]))
        return jobs, probes

    def launch(self, *, trailer: VersionTrailer | None, check_finite_values: bool) -> _Launched:
        """Issue the bucket's device work (fill, quantize, probe, checksum partials) and start its one host read.

        On CUDA the read is a non-blocking copy into pinned memory: the host goes on (e.g. filling the next
        bucket) while the GPU works; :meth:`_Launched.complete` waits for it.
        """
        end = align_up(self.used)
        if end > self.used:
            self._gaps.append((self.used, end))
        payload = self.buffer[:end]
        metas = tuple(self.metas)
        if _fused_on(self.buffer):
            flags, probes = self._fill_fused(metas, check_finite_values)
        else:
            flags, probes = self._fill(), []
            if check_finite_values:  # plain tensors by their views; quantized weights by their scales (below)
                probes.append(
                    FiniteProbe([(m.name, _view(payload, m)) for i, m in enumerate(metas) if i not in self._parts])
                )
        if not check_finite_values:
            flags = []
        self._copies, self._copy_meta, self._gaps = [], [], []
        p, q = checksum_partials(payload)
        parts = [p, q]
        parts += [pr.values.view(torch.int32) for pr in probes if pr.values is not None]
        parts += [t for verdict in flags for t in verdict.tensors]
        read = HostRead(torch.cat(parts))
        return _Launched(self, payload, metas, trailer, probes, flags, p.numel(), read)


class _Launched:
    """A bucket whose device work is issued; :meth:`complete` reads its values back and builds the :class:`Bucket`."""

    def __init__(self, filling, payload, metas, trailer, probes, flags, nb, read: HostRead) -> None:
        self.filling, self.payload, self.metas, self.trailer = filling, payload, metas, trailer
        self.probes, self.flags, self.nb, self.read = probes, flags, nb, read

    def complete(self) -> Bucket:
        """Wait for the bucket's host read; refuse a NaN/Inf tensor by name; the finished :class:`Bucket`."""
        f = self.filling
        host = self.read.result()  # the bucket's one host read
        nb = self.nb
        rest = host[2 * nb :].astype(np.int32)
        at = 0
        for probe in self.probes:  # in stream order within each probe
            n = 0 if probe.values is None else probe.values.numel()
            probe.check(rest[at : at + n] if isinstance(probe, FlagProbe) else rest[at : at + n].view(np.float32),
                        version=f.version)  # fmt: skip
            at += n
        for verdict in self.flags:  # the quantized weights' NaN/Inf verdicts
            n = sum(t.numel() for t in verdict.tensors)
            verdict.check(rest[at : at + n], version=f.version)
            at += n
        is_last = self.trailer is not None
        end = self.payload.numel()
        checksum = finish_checksum(host[:nb], host[nb : 2 * nb], nbytes=end) ^ header_digest(
            version=f.version,
            index=f.index,
            is_last=is_last,
            stream_id=f.stream_id,
            metas=self.metas,
            trailer=self.trailer,
        )
        return Bucket(
            version=f.version,
            index=f.index,
            is_last=is_last,
            metas=self.metas,
            payload=self.payload,
            checksum=checksum,
            stream_id=f.stream_id,
            trailer=self.trailer,
        )


def _view(buffer: torch.Tensor, m: TensorMeta) -> torch.Tensor:
    """The typed, shaped view of ``m`` in a bucket's buffer."""
    return buffer[m.offset : m.offset + m.nbytes].view(DTYPES[m.dtype]).view(m.shape)


_ZEROS16: dict[torch.device, torch.Tensor] = {}


def _zeros16(device: torch.device) -> torch.Tensor:
    """16 zero bytes on ``device`` (the source of an alignment gap in the fused fill)."""
    z = _ZEROS16.get(device)
    if z is None:
        z = _ZEROS16[device] = torch.zeros(16, dtype=torch.uint8, device=device)
    return z


_FORCE_FUSED = False
"""Tests set this to run the fused fill on CPU tensors under ``TRITON_INTERPRET=1``."""


def _fused_on(buffer: torch.Tensor) -> bool:
    """Whether a bucket is filled by :func:`fill_and_flag` (CUDA and Triton, or forced under the interpreter)."""
    return fused_fill.available() and (buffer.is_cuda or (_FORCE_FUSED and fused_fill.interpreter_active()))


def pack_buckets(
    stream: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_bytes: int,
    device: torch.device | str | None = None,
    check_finite_values: bool = True,
    stream_id: int = 0,
    lookahead: bool | None = None,
) -> Iterator[Bucket]:
    """Pack a stream of named tensors into buckets, in one pass, with bounded memory.

    Each tensor is validated and its bytes copied at its (16-byte aligned)
    offset as it is consumed; a bucket is yielded as soon as the next tensor does
    not fit (or the stream ends, then with ``is_last=True``). Only one bucket is
    ever being filled; a tensor larger than ``bucket_bytes`` gets a bucket of its
    own sized to it. A bucket's bytes are copied when it is finished (one
    multi-tensor copy), so a stream item's tensor is read then, not when it is
    yielded: a stream must not change a yielded tensor before its bucket is
    handed out (yielding a buffer and then refilling it for the next item would
    send the refilled bytes: yield fresh tensors; one tensor under two names, as
    for tied embeddings, is fine). Zero-size tensors are carried (metadata only). A fresh
    buffer is allocated per bucket, so a yielded bucket stays valid while a
    transport still sends it. On CUDA a bucket is handed out once the next
    bucket's device work is issued (its host read waits while the GPU works on
    the next one, so the GPU does not idle while the host lays out a bucket):
    two bucket buffers exist at once there.

    Args:
        stream: ``(name, tensor)`` pairs; any supported dtype (:data:`DTYPES`),
            any device, contiguous or not; or ``(name, part)`` pairs of
            :func:`~megatron_fp8.refit.inbucket.blockwise_items`, quantized straight into
            the bucket when it is finished (the same bytes as the finished tensors).
        version: refit version stamped on every bucket (>= 0).
        bucket_bytes: target payload capacity in bytes (>= :data:`ALIGN`).
        device: where payload buffers live; default: the device of the first
            tensor of each bucket.
        check_finite_values: refuse NaN/Inf (see :func:`check_finite`).
        stream_id: id of this sending stamped on every bucket (``0 <= stream_id < 2**62``).
        lookahead: hand a bucket out only after the next one's device work is issued; ``None``: on CUDA
            buckets only (on a CPU the ops run as they are issued: nothing to overlap).

    Yields:
        :class:`Bucket` objects with indices 0, 1, ...; the last has ``is_last=True`` and the
        :class:`VersionTrailer` (the announced set: memory ~100 bytes per tensor of the version).

    Raises:
        NonFiniteError: a tensor holds NaN/Inf (raised before its bucket is yielded).
        RefitError: duplicate name, unsupported dtype, bad argument, or an empty stream.
    """
    if not isinstance(version, int) or version < 0:
        raise RefitError(f"refit version must be a non-negative int, got {version!r}")
    if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN:
        raise RefitError(f"bucket_bytes must be an int >= {ALIGN}, got {bucket_bytes!r}")
    if not isinstance(stream_id, int) or not 0 <= stream_id < 1 << 62:
        raise RefitError(f"stream_id must be an int in [0, 2**62), got {stream_id!r}")
    dev = torch.device(device) if device is not None else None
    seen: set[str] = set()
    announced: list[AnnouncedTensor] = []
    digest = VersionDigest()
    index = 0
    current: _Filling | None = None
    ahead: _Launched | None = None  # a CUDA bucket launched, completed (host read) after the next one is launched
    for item in stream:
        try:
            name, tensor = item
        except (TypeError, ValueError):
            raise RefitError(f"refit stream items must be (name, tensor) pairs, got {type(item).__name__}") from None
        if not isinstance(name, str) or not name:
            raise RefitError(f"refit stream yielded a tensor with an invalid name {name!r} (need a non-empty str)")
        if not isinstance(tensor, (torch.Tensor, PendingPart)):
            raise RefitError(
                f"refit stream item {name!r} is a {type(tensor).__name__}, not a torch.Tensor (or a PendingPart)"
            )
        if name in seen:
            raise RefitError(
                f"tensor {name!r} appears twice in the stream of refit version {version}; each name must be sent "
                "once (check the name mapping for fused/unfused duplicates)"
            )
        seen.add(name)
        dt = dtype_name(tensor.dtype, tensor_name=name)
        nbytes = tensor.numel() * tensor.element_size()
        if current is not None and not current.fits(nbytes):
            launched = current.launch(trailer=None, check_finite_values=check_finite_values)
            current = None
            if ahead is not None:  # the earlier bucket completes while the device works on this one
                yield ahead.complete()
            ahead = launched if (lookahead if lookahead is not None else launched.read.asynchronous) else None
            if ahead is None:
                yield launched.complete()
            index += 1
        if current is None:
            capacity = max(bucket_bytes, align_up(nbytes))
            current = _Filling(version, index, capacity, dev if dev is not None else tensor.device, stream_id)
        current.add(name, tensor, dt, nbytes)
        meta = current.metas[-1]
        digest.add(index, meta)
        announced.append(AnnouncedTensor(name=name, shape=meta.shape, dtype=dt, nbytes=nbytes))
    if current is None:
        raise RefitError(
            f"the stream of refit version {version} yielded no tensors; an empty refit is almost certainly a bug "
            "(check the FP8 manifest and the parameter filter)"
        )
    trailer = VersionTrailer(num_tensors=len(announced), tensors=tuple(announced), digest=digest.hexdigest())
    last = current.launch(trailer=trailer, check_finite_values=check_finite_values)
    if ahead is not None:
        yield ahead.complete()
    yield last.complete()


def verify_bucket_checksum(bucket: Bucket) -> None:
    """Recompute a bucket's checksum (payload, header, metadata, trailer) and compare it with the sender's.

    Raises:
        RefitError: naming the bucket: the payload, a metadata record or the header was changed in transit.
    """
    if not isinstance(bucket.payload, torch.Tensor) or bucket.payload.dtype != torch.uint8 or bucket.payload.dim() != 1:
        raise RefitError(f"{bucket.describe()}: payload must be a 1-D uint8 tensor")
    got = checksum_of(bucket)
    if got != bucket.checksum:
        raise checksum_error(bucket, got)


def checksum_error(bucket: Bucket, got: int) -> RefitError:
    """The error for a bucket whose recomputed checksum ``got`` differs from the one it carries."""
    return RefitError(
        f"{bucket.describe()}: checksum mismatch over the header, {len(bucket.metas)} metadata record(s) and "
        f"{bucket.nbytes} payload bytes (sender {bucket.checksum}, received {got}); the payload, a tensor's "
        "name/shape/offset or the header (is_last, index) was corrupted or truncated in transit"
    )


def unpack_bucket(
    bucket: Bucket, *, expected_version: int | None = None, verify_checksum: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """Validate a bucket and return its tensors as typed, shaped views of the payload.

    Args:
        bucket: a received bucket.
        expected_version: refuse a bucket of any other version.
        verify_checksum: recompute :func:`bucket_checksum` (payload, header, metadata, trailer) and compare.

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
        verify_bucket_checksum(bucket)
    if bucket.is_last != (bucket.trailer is not None):
        raise RefitError(
            f"{where}: is_last={bucket.is_last} but the bucket {'lacks' if bucket.is_last else 'carries'} the "
            "version trailer; a version ends exactly at the bucket that announces its tensor set (a buggy packer "
            "or a forged header)"
        )
    names: set[str] = set()
    in_order = True  # the packer lays tensors out by increasing offset: no sort needed to find an overlap
    end = 0
    for m in bucket.metas:
        problem = m.problem
        if problem is not None:
            raise RefitError(f"{where}, tensor {m.name!r}: {problem}")
        if m.offset + m.nbytes > size:
            raise RefitError(
                f"{where}, tensor {m.name!r}: bytes [{m.offset}, {m.offset + m.nbytes}) run past the payload end "
                f"({size} bytes); the payload is truncated or the metadata does not belong to it"
            )
        if m.name in names:
            raise RefitError(f"{where}, tensor {m.name!r}: name appears twice in the bucket")
        names.add(m.name)
        if m.nbytes:
            in_order = in_order and m.offset >= end
            end = m.offset + m.nbytes
    if not in_order:
        by_offset = sorted((m for m in bucket.metas if m.nbytes), key=lambda m: m.offset)
        for prev, nxt in zip(by_offset, by_offset[1:], strict=False):
            if nxt.offset < prev.offset + prev.nbytes:
                raise RefitError(
                    f"{where}, tensor {nxt.name!r}: bytes from offset {nxt.offset} overlap tensor {prev.name!r} "
                    f"[{prev.offset}, {prev.offset + prev.nbytes})"
                )
    return _views(payload, bucket.metas)


def _views(payload: torch.Tensor, metas: tuple[TensorMeta, ...]) -> list[tuple[str, torch.Tensor]]:
    """``(name, typed and shaped view)`` per record of a validated bucket: the payload is viewed once per dtype
    and each tensor is one strided view of that (one op per tensor instead of a slice and two views)."""
    typed: dict[torch.dtype, torch.Tensor | None] = {}
    out = []
    for m in metas:
        dt = DTYPES[m.dtype]
        base = typed.get(dt, False)
        if base is False:
            base = typed[dt] = _typed(payload, dt)
        if base is None or not m.nbytes:
            view = payload[m.offset : m.offset + m.nbytes].view(dt).view(m.shape)
        else:
            view = base.as_strided(m.shape, m.strides, base.storage_offset() + m.offset // dt.itemsize)
        out.append((m.name, view))
    return out


def _typed(payload: torch.Tensor, dt: torch.dtype) -> torch.Tensor | None:
    """The whole payload viewed as ``dt``, or ``None`` where its length or start do not allow it."""
    if payload.numel() % dt.itemsize or (payload.storage_offset() % dt.itemsize):
        return None
    return payload.view(dt)


# ----------------------------------------------------------------------------- sizing


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
