"""Engine side of a refit: stage every bucket of a version, check it is exactly the announced set, apply it.

:class:`RefitReceiver` collects all buckets of one version into a staging
area, validating each (version, stream, order, checksum over payload *and*
header and metadata, offsets). Only when the last bucket arrived, and the set
received equals the set its trailer announces (names, shapes, dtypes, byte
counts and the digest over every ``(bucket index, name, shape, dtype, offset,
nbytes)``), does it drive the two-phase :class:`RefitApplier`: ``begin``,
``stage`` each tensor, ``commit``. Any failure calls ``abort`` and raises
:class:`~megatron_fp8.errors.RefitError`; the engine keeps its last good
version.

When a version fails before its last bucket (a corrupt or missing bucket, a
stale version, another sending interleaved), the receiver keeps reading that
version's remaining buckets without staging them, up to its last bucket (an
``is_last`` flag is trusted only on a bucket whose checksum holds), so the wire
stays in step and the report can name what was missing or extra. Then, after
every version it saw, it sends a :class:`~megatron_fp8.refit.wire.RefitOutcome`
back to the sender (``committed`` / ``refused`` / ``rolled_back`` / ``not_serving`` with the
reason), except when the sender itself aborted the version or is gone.

Calls to :meth:`RefitReceiver.receive` are serialized: a second concurrent call
waits for the first (within its own first-bucket deadline) or is refused.

Memory: the staging area holds one full version of received payload (the
price of atomicity); appliers receive zero-copy views of it. The announced set
costs ~100 bytes per tensor of the version. An applier that keeps the version on
one device until its commit (:func:`~megatron_fp8.refit.applier.staging_device`: the
vLLM applier, whose in-process workers load from that device) gets the staging area
there: a bucket that arrives on that device is kept as it is (a transport with
``fresh_payloads`` hands out a buffer per bucket that nothing else writes: no copy;
colocated on a GPU, the version stays on the GPU), any other is copied there as it
arrives (to the host: on CUDA into pinned memory, behind the host's back, right after
its checksum pass is queued, and the device bucket is dropped, so a GPU holds only the
buckets in flight); the applier is handed views of memory that holds this version alone,
with ``owned=True``, and keeps them without a copy of its own.
:attr:`ReceiveReport.host_staged_bytes` / ``device_staged_bytes`` say where it was staged. For an applier that accepts checked values
(:func:`~megatron_fp8.refit.applier.accepts_checked_values`) each bucket's tensors are probed for NaN/Inf
where the bucket arrived (before its host copy; the verdicts read back with the checksum partials), a
NaN/Inf refuses the version naming the tensor, and a clean version is announced with
``values_checked(version)`` before its commit.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from megatron_fp8.errors import (
    EngineNotServingError,
    NonFiniteError,
    RefitAbortedError,
    RefitError,
    RefitRolledBackError,
    TransportClosedError,
    TransportTimeoutError,
)
from megatron_fp8.refit.applier import CallableApplier, RefitApplier, accepts_checked_values, staging_device
from megatron_fp8.refit.buckets import checksum_error, header_digest_of, unpack_bucket
from megatron_fp8.refit.integrity.checksum import (
    HostCopy,
    HostRead,
    checksum_partials,
    finish_checksum,
    read_host_int64,
)
from megatron_fp8.refit.integrity.finite import FiniteProbe
from megatron_fp8.refit.transport.base import Transport
from megatron_fp8.refit.wire import Bucket, RefitOutcome, RefitVersion, TensorMeta, VersionDigest, VersionTrailer

logger = logging.getLogger(__name__)

_SHOW = 5
"""Names shown in a message about missing or extra tensors."""


@dataclasses.dataclass(frozen=True)
class ReceiveReport:
    """What one :meth:`RefitReceiver.receive` applied.

    Attributes:
        version: the committed version.
        num_tensors: tensors applied.
        num_buckets: buckets received.
        payload_bytes: tensor bytes received (no padding).
        seconds: wall time from the first bucket's arrival to the end of commit.
        tail_seconds: wall time from the last bucket's arrival to the end of commit (the receiver's work that
            nothing overlaps: settling what is still pending, the announced-set check, the applier).
        discarded_buckets: stale buckets of earlier abandoned versions dropped first.
        outcome_delivered: the sender took the ``committed`` outcome (``False``: it is gone or stopped waiting).
        host_staged_bytes: payload bytes of the version the applier was handed in host memory it owns (its staging
            device is the host).
        device_staged_bytes: the same on an accelerator (its staging device is a GPU: the version stayed there).
        staging_copies: buckets copied to the staging device (0: every bucket was kept where it arrived).
    """

    version: int
    num_tensors: int
    num_buckets: int
    payload_bytes: int
    seconds: float
    tail_seconds: float = 0.0
    discarded_buckets: int = 0
    outcome_delivered: bool = True
    host_staged_bytes: int = 0
    device_staged_bytes: int = 0
    staging_copies: int = 0


def _names(names: list[str]) -> str:
    return f"{names[:_SHOW]}{' ...' if len(names) > _SHOW else ''}"


def trailer_mismatch(
    version: int, trailer: VersionTrailer, received: dict[str, TensorMeta], digest: str, *, buckets: int
) -> str | None:
    """Compare what arrived with what the version's trailer announced; ``None`` when they are the same.

    Args:
        version: the refit version, for the message.
        trailer: the announced set.
        received: name -> metadata of every tensor that arrived in a bucket whose checksum holds.
        digest: :class:`VersionDigest` of what arrived.
        buckets: buckets that arrived, for the message.

    Returns:
        The reason naming the counts and the first missing / extra / differing tensors, or ``None``.
    """
    announced = {t.name: t for t in trailer.tensors}
    missing = [t.name for t in trailer.tensors if t.name not in received]
    extra = [n for n in received if n not in announced]
    if missing or extra:
        return (
            f"refit version {version} is not the announced set: the sender announced {trailer.num_tensors} "
            f"tensor(s), {len(received)} arrived in {buckets} bucket(s); {len(missing)} missing {_names(missing)}, "
            f"{len(extra)} extra {_names(extra)}. Buckets were lost or the stream was cut or mixed with another "
            "sender's; nothing was applied (check the transport and that one sender feeds this receiver)"
        )
    for t in trailer.tensors:
        got = received[t.name]
        if (got.shape, got.dtype, got.nbytes) != (t.shape, t.dtype, t.nbytes):
            return (
                f"refit version {version}, tensor {t.name!r}: arrived as {got.shape} {got.dtype}, {got.nbytes} bytes, "
                f"but the version announced {t.describe()}; its metadata was altered in transit"
            )
    if digest != trailer.digest:
        return (
            f"refit version {version}: the digest over every (bucket index, name, shape, dtype, offset, nbytes) "
            f"differs from the announced one ({digest} != {trailer.digest}); tensors were reordered or moved "
            "between buckets in transit; nothing was applied"
        )
    return None


class _Version:
    """The version being received: what arrived, staged, and the first failure.

    With a ``staging`` device every bucket's payload is kept on it when it arrives: the bucket itself where it is
    already there and ``fresh`` (its buffer is this version's alone), else a copy made there (to the host:
    :class:`HostCopy`), of which only the copy is kept; staged views are then ``owned``. Without one the bucket itself
    is kept.
    """

    def __init__(
        self,
        bucket: Bucket,
        *,
        verify_checksum: bool,
        staging: torch.device | None = None,
        fresh: bool = False,
        check_values: bool = False,
    ):
        self.version = bucket.version
        self.stream_id = bucket.stream_id
        self.verify_checksum = verify_checksum
        self.staging = staging
        self.fresh = fresh
        self.copies = 0  # buckets copied to the staging device
        self.check_values = check_values and verify_checksum  # the values' read shares the checksum's host read
        self.start = time.perf_counter()
        self.last_arrival = self.start
        self.expected_index = 0
        self.num_buckets = 0
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.metas: list[TensorMeta] = []
        self.received: dict[str, TensorMeta] = {}
        self.digest = VersionDigest()
        self.payload_bytes = 0
        self.trailer: VersionTrailer | None = None
        self.error: BaseException | None = None
        self.ended = False  # a trusted last bucket arrived
        # not settled yet: (bucket as kept, what its host read reads (checksum partials p, q and the probe's
        # values), the partials' length, the NaN/Inf probe of its tensors, the read started on CUDA)
        self.pending: list[tuple[Bucket, tuple[torch.Tensor, ...], int, FiniteProbe | None, HostRead | None]] = []

    @property
    def key(self) -> tuple[int, int]:
        return self.version, self.stream_id

    def fail(self, error: BaseException) -> None:
        """Record the first failure (pending buckets settled first, so failures stay in bucket order);
        from now on buckets are read (to stay in step) but not staged."""
        self.settle()
        if self.error is None:
            self.error = error
            self.staged.clear()

    def take(self, bucket: Bucket) -> None:
        """Account for one bucket of this version (validate and stage it, or just read it after a failure).

        The checksum's device pass starts here. On CUDA the host read of its partials starts too, and every
        pending bucket whose read has already landed (:meth:`HostRead.ready`, not a sync) is settled now
        (:meth:`settle`: checksum compared, tensors recorded, views made), so that host work overlaps the
        device's work on the rest of the version instead of following the last bucket. Elsewhere (reads are
        synchronous) the partials of every bucket are read back in one read when a bucket claims to be the last
        (or the version fails). Buckets are accepted or refused in order either way.
        """
        self.num_buckets += 1
        if bucket.index != self.expected_index:
            self.fail(
                RefitError(
                    f"bucket {bucket.index} of version {self.version} arrived, expected bucket {self.expected_index}; "
                    "buckets were lost or reordered"
                )
            )
        self.expected_index = bucket.index + 1
        if not self.verify_checksum:
            self._accept(self._kept(bucket, wait=True))
            return
        probe = None
        try:
            p, q = checksum_partials(bucket.payload)
            if self.check_values:
                # the values where they arrived, before the host copy (a few multi-tensor ops, no op per tensor),
                # through views of records checked to lie inside the payload (the checksum is compared at settle)
                probe = FiniteProbe(unpack_bucket(bucket, expected_version=self.version, verify_checksum=False))
        except RefitError as exc:
            self.settle()
            self.fail(RefitError(f"{bucket.describe()}: {exc}"))
            return
        parts = [p, q]
        if probe is not None and probe.values is not None:
            parts.append(probe.values.view(torch.int32))  # float32 bits, read back with the partials
        bucket = self._kept(bucket, wait=False)  # a host copy is queued before the partials' read below
        read = HostRead(torch.cat(parts)) if p.is_cuda else None
        self.pending.append((bucket, tuple(parts), p.numel(), probe, read))
        if bucket.is_last:
            self.settle()
        elif read is not None:
            self.settle(ready_only=True)

    def settle(self, *, ready_only: bool = False) -> None:
        """Compare the checksums of the pending buckets and accept or refuse each, in order.

        Args:
            ready_only: settle only the leading buckets whose partials have reached the host (CUDA reads that
                landed); by default every pending bucket, waiting for its read where needed.
        """
        n = len(self.pending)
        if ready_only:
            n = 0
            while n < len(self.pending) and (read := self.pending[n][4]) is not None and read.ready():
                n += 1
        if n == 0:
            return
        # out of self.pending while they settle: a failure recorded meanwhile (fail() settles first) must not
        # settle a later bucket ahead of the rest of this batch
        pending, kept, self.pending = self.pending[:n], self.pending[n:], []
        unread = [t for _, parts, _, _, read in pending if read is None for t in parts]
        host_unread = read_host_int64(torch.cat(unread)) if unread else None  # one read for all synchronous ones
        at = 0
        for bucket, parts, nb, probe, read in pending:
            if read is None:
                n = sum(t.numel() for t in parts)
                host, at = host_unread[at : at + n], at + n
            else:
                host = read.result()
            got = finish_checksum(host[:nb], host[nb : 2 * nb], nbytes=bucket.nbytes)
            got ^= header_digest_of(bucket)
            if got != bucket.checksum:
                self.fail(checksum_error(bucket, got))
                continue
            if probe is not None:
                try:  # the bytes are the sender's (checksum above): a NaN/Inf is the sender's, named here
                    probe.check(host[2 * nb :].astype(np.int32).view(np.float32), version=self.version)
                except NonFiniteError as exc:
                    self.fail(exc)
                    continue
            self._accept(bucket)  # a host copy has landed: it was queued before the partials' read
        self.pending = kept + self.pending

    @property
    def owned(self) -> bool:
        """Whether the staged views are of memory that holds this version alone (a staging device was asked for)."""
        return self.staging is not None

    def _kept(self, bucket: Bucket, *, wait: bool) -> Bucket:
        """``bucket`` as this version keeps it: itself, or, with a ``staging`` device it is not on (or a payload that
        is not ``fresh``), carrying a copy of its payload made there (the arriving payload no longer referenced here).
        ``wait=False`` leaves a CUDA copy in flight: it lands before any host read queued after it on the stream (the
        bucket's partials)."""
        payload = bucket.payload
        if self.staging is None or (self.fresh and payload.device == self.staging):
            return bucket
        self.copies += 1
        if self.staging.type == "cpu":
            copy = HostCopy(payload)
            return dataclasses.replace(bucket, payload=copy.tensor() if wait else copy.destination)
        # to the staging accelerator (or a copy on it of a reused buffer): queued on the stream, so it lands before
        # any later read of it there; a read on another device waits for it (a host read of the partials syncs)
        copied = torch.empty_like(payload, device=self.staging).copy_(payload, non_blocking=not wait)
        return dataclasses.replace(bucket, payload=copied)

    def _accept(self, bucket: Bucket) -> None:
        """A bucket whose checksum holds: record its tensors, trust its ``is_last``, stage it."""
        for meta in bucket.metas:
            self.digest.add(bucket.index, meta)
            if meta.name in self.received:
                self.fail(
                    RefitError(
                        f"bucket {bucket.index} of version {self.version}, tensor {meta.name!r}: sent twice in "
                        "one version"
                    )
                )
            self.received[meta.name] = meta
        if bucket.is_last:
            self.ended = True
            self.trailer = bucket.trailer
        if self.error is None:
            try:
                pairs = unpack_bucket(bucket, expected_version=self.version, verify_checksum=False)
            except RefitError as exc:
                self.fail(exc)
            else:
                self.staged.extend(pairs)
                self.metas.extend(bucket.metas)
                self.payload_bytes += bucket.tensor_bytes

    def staged_bytes(self) -> tuple[int, int]:
        """``(host, device)`` payload bytes staged in memory the applier owns (0, 0 without a staging device)."""
        if self.staging is None:
            return 0, 0
        return (self.payload_bytes, 0) if self.staging.type == "cpu" else (0, self.payload_bytes)

    def wire_error(self) -> BaseException | None:
        """The first failure, with the announced-set comparison added when the trailer arrived; else ``None``."""
        self.settle()
        mismatch = None
        if self.trailer is not None:
            mismatch = trailer_mismatch(
                self.version, self.trailer, self.received, self.digest.hexdigest(), buckets=self.num_buckets
            )
        if self.error is None:
            return RefitError(mismatch) if mismatch else None
        if mismatch is None or type(self.error) is not RefitError:
            return self.error
        return RefitError(f"{self.error}; and: {mismatch}")


class RefitReceiver:
    """Receive whole refit versions, apply each atomically, and tell the sender what became of it.

    Args:
        transport: the receiving end.
        apply: a :class:`RefitApplier`, or ``apply(version, [(name, tensor)])`` called once per version.
        timeout: deadline for each bucket after the first, seconds (default: the transport's).
        verify_checksum: recompute each bucket's checksum.
        versions: version counter (default: a fresh one from 0); versions must strictly increase.
        outcome_timeout: deadline for handing the outcome to the sender, seconds (default: the transport's).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        apply: RefitApplier | Callable[[int, list[tuple[str, torch.Tensor]]], None],
        timeout: float | None = None,
        verify_checksum: bool = True,
        versions: RefitVersion | None = None,
        outcome_timeout: float | None = None,
    ):
        self.transport = transport
        self.applier: RefitApplier = apply if isinstance(apply, RefitApplier) else CallableApplier(apply)
        self.timeout = timeout
        self.verify_checksum = verify_checksum
        self.versions = versions if versions is not None else RefitVersion()
        self.outcome_timeout = outcome_timeout
        self._abandoned: set[tuple[int, int]] = set()  # (version, stream_id) of versions given up
        self._aborted: set[int] = set()  # versions the sender aborted (an abort carries no stream id)
        self._pushed_back: Bucket | None = None  # a bucket of another sending read while draining
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        """The last committed version (the counter's start before any)."""
        return self.versions.last

    def receive(self, *, timeout: float | None = None, first_timeout: float | None = None) -> ReceiveReport:
        """Receive, validate and apply the next complete version, then report the outcome to the sender.

        Args:
            timeout: deadline per bucket after the first, seconds (default: the receiver's).
            first_timeout: deadline for the first bucket, e.g. the length of a train step (default: ``timeout``);
                a concurrent ``receive()`` waits for this one within it.

        Returns:
            A :class:`ReceiveReport` for the committed version.

        Raises:
            TransportTimeoutError: the sender died or stalled; nothing applied.
            RefitAbortedError: the sender abandoned the version; nothing applied.
            TransportClosedError: the sender closed the transport (between versions).
            RefitRolledBackError: the applier failed after its first write and restored the last good version.
            RefitError: a corrupt, incomplete or inconsistent version, a stale version, another
                ``receive()`` still running after ``first_timeout``, or an applier refusal; nothing applied.
        """
        per_bucket = timeout if timeout is not None else self.timeout
        wait = first_timeout if first_timeout is not None else per_bucket
        lock_wait = wait if wait is not None else self.transport.timeout
        if not self._lock.acquire(timeout=lock_wait):
            raise RefitError(
                f"another receive() is in progress on this receiver and did not finish within {lock_wait:.3g}s; "
                "call receive() from one thread at a time"
            )
        try:
            return self._receive(per_bucket, wait)
        finally:
            self._lock.release()

    def _is_stale(self, version: int) -> bool:
        return (
            version <= self.versions.last or version in self._aborted or any(v == version for v, _ in self._abandoned)
        )

    def _next_bucket(self, wait: float | None) -> Bucket:
        if self._pushed_back is not None:
            bucket, self._pushed_back = self._pushed_back, None
            return bucket
        return self.transport.recv(timeout=wait)

    def _receive(self, per_bucket: float | None, wait: float | None) -> ReceiveReport:
        cur: _Version | None = None
        discarded = 0
        while cur is None or not cur.ended:
            try:
                bucket = self._next_bucket(wait)
            except RefitAbortedError as exc:
                version = exc.version
                if cur is None or (version is not None and version != cur.version):
                    if version is not None and self._is_stale(version):
                        logger.info("dropping the abort of already abandoned refit version %d", version)
                        continue
                    if cur is not None:
                        logger.warning(
                            "ignoring the abort of refit version %d while receiving %d", version, cur.version
                        )
                        continue
                    if version is not None:  # abandoned before its first bucket
                        self._aborted.add(version)
                        self._fail(version, None, str(exc))
                    raise
                self._aborted.add(cur.version)
                self._fail(cur.version, cur.stream_id, str(exc))
                raise
            except (TransportTimeoutError, TransportClosedError, RefitError) as exc:
                if cur is None:
                    raise
                if cur.error is not None and isinstance(exc, TransportTimeoutError):
                    break  # the rest of an already refused version never came: refuse it now
                self._fail(cur.version, cur.stream_id, f"{type(exc).__name__}: {exc}")
                raise
            key = (bucket.version, bucket.stream_id)
            if key in self._abandoned:
                discarded += 1
                logger.info("dropping stale %s of an abandoned refit", bucket.describe())
                continue
            if cur is None:
                cur = _Version(
                    bucket,
                    verify_checksum=self.verify_checksum,
                    staging=staging_device(self.applier),
                    fresh=bool(getattr(self.transport, "fresh_payloads", False)),
                    check_values=accepts_checked_values(self.applier),
                )
                if bucket.version <= self.versions.last:
                    cur.fail(
                        RefitError(
                            f"bucket {bucket.index} of version {bucket.version}: version is not newer than the "
                            f"applied version {self.versions.last}; versions must strictly increase (a replayed or "
                            "stale version, or a second sender on this receiver)"
                        )
                    )
            elif key != cur.key:
                cur.fail(
                    RefitError(
                        f"bucket {bucket.index} of version {bucket.version} (another sending) arrived while version "
                        f"{cur.version} was incomplete (next expected: bucket {cur.expected_index}); the stream mixes "
                        "versions: two senders on one transport, or a stale bucket"
                    )
                )
                self._pushed_back = bucket  # it starts the next receive()
                break
            cur.last_arrival = time.perf_counter()
            cur.take(bucket)
            wait = per_bucket
        assert cur is not None
        return self._finish(cur, discarded)

    def _finish(self, cur: _Version, discarded: int) -> ReceiveReport:
        error = cur.wire_error()
        status = "refused"
        if error is None:
            try:
                self.applier.begin(cur.version, cur.metas)
                stage_many = getattr(self.applier, "stage_many", None)  # optional: the whole version at once
                if cur.owned:  # views of memory holding this version alone, on the applier's device: no copy
                    for name, tensor in cur.staged:
                        self.applier.stage(name, tensor, owned=True)
                elif stage_many is not None:
                    stage_many(cur.staged)
                else:
                    for name, tensor in cur.staged:
                        self.applier.stage(name, tensor)
                if cur.check_values:  # every bucket's values passed the probe (a NaN/Inf refused the version)
                    self.applier.values_checked(cur.version)  # type: ignore[attr-defined]
                self.applier.commit(cur.version)
            except RefitRolledBackError as exc:
                error, status = exc, "rolled_back"
            except EngineNotServingError as exc:
                error, status = exc, "not_serving"
            except Exception as exc:
                error = exc
        if error is not None:
            reason = f"{type(error).__name__}: {error}"
            self._fail(cur.version, cur.stream_id, reason)
            self._report(RefitOutcome(cur.version, status, reason, stream_id=cur.stream_id))
            if isinstance(error, RefitError):
                raise error
            raise RefitError(f"refit version {cur.version} failed: {reason}") from error
        self.versions.observe(cur.version, what="refit receiver")
        delivered = self._report(RefitOutcome(cur.version, "committed", stream_id=cur.stream_id))
        host_staged, device_staged = cur.staged_bytes()
        report = ReceiveReport(
            version=cur.version,
            num_tensors=len(cur.staged),
            num_buckets=cur.num_buckets,
            payload_bytes=cur.payload_bytes,
            seconds=(end := time.perf_counter()) - cur.start,
            tail_seconds=end - cur.last_arrival,
            discarded_buckets=discarded,
            outcome_delivered=delivered,
            host_staged_bytes=host_staged,
            device_staged_bytes=device_staged,
            staging_copies=cur.copies,
        )
        logger.debug("refit v%d applied: %d tensors from %d buckets", cur.version, report.num_tensors, cur.num_buckets)
        return report

    def _report(self, outcome: RefitOutcome) -> bool:
        """Send ``outcome`` to the sender; ``False`` (logged) when it could not be delivered."""
        try:
            self.transport.send_outcome(outcome, timeout=self.outcome_timeout)
        except RefitError as exc:
            logger.warning("refit v%d: the sender was not told %r (%s)", outcome.version, outcome.status, exc)
            return False
        return True

    def _fail(self, version: int, stream_id: int | None, reason: str) -> None:
        if stream_id is not None:
            self._abandoned.add((version, stream_id))
        logger.warning("refit version %d abandoned, engine keeps version %d: %s", version, self.versions.last, reason)
        try:
            self.applier.abort(version, reason)
        except Exception as exc:  # the original failure is what the caller must see
            logger.error("applier.abort(%d) raised %s: %s", version, type(exc).__name__, exc)
