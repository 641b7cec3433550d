"""Engine side of a refit: stage every bucket of a version, then apply it atomically.

:class:`RefitReceiver` collects all buckets of one version into a staging
area, validating each (version, order, checksum, offsets). Only when the last
bucket arrived and validated does it drive the two-phase :class:`RefitApplier`:
``begin`` (validate every name/shape/dtype against the engine), ``stage`` each
tensor, ``commit``. Any failure calls ``abort`` and raises
:class:`~megatron_fp8.errors.RefitError`; the engine keeps its last good
version. Buckets of an abandoned version still in the transport are drained
and dropped by the next :meth:`RefitReceiver.receive`.

Memory: the staging area holds one full version of received payload (the
price of atomicity); appliers receive zero-copy views of it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_fp8.errors import RefitAbortedError, RefitError, TransportClosedError
from megatron_fp8.refit.applier import CallableApplier, RefitApplier
from megatron_fp8.refit.buckets import unpack_bucket
from megatron_fp8.refit.transport.base import Transport
from megatron_fp8.refit.wire import RefitVersion, TensorMeta

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiveReport:
    """What one :meth:`RefitReceiver.receive` applied.

    Attributes:
        version: the committed version.
        num_tensors: tensors applied.
        num_buckets: buckets received.
        payload_bytes: tensor bytes received (no padding).
        seconds: wall time from the first bucket's arrival to the end of commit.
        discarded_buckets: stale buckets of earlier abandoned versions dropped first.
    """

    version: int
    num_tensors: int
    num_buckets: int
    payload_bytes: int
    seconds: float
    discarded_buckets: int = 0


class RefitReceiver:
    """Receive whole refit versions and apply each atomically.

    Args:
        transport: the receiving end.
        apply: a :class:`RefitApplier`, or ``apply(version, [(name, tensor)])`` called once per version.
        timeout: deadline for each bucket after the first, seconds (default: the transport's).
        verify_checksum: recompute each bucket's checksum.
        versions: version counter (default: a fresh one from 0); versions must strictly increase.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        apply: RefitApplier | Callable[[int, list[tuple[str, torch.Tensor]]], None],
        timeout: float | None = None,
        verify_checksum: bool = True,
        versions: RefitVersion | None = None,
    ):
        self.transport = transport
        self.applier: RefitApplier = apply if isinstance(apply, RefitApplier) else CallableApplier(apply)
        self.timeout = timeout
        self.verify_checksum = verify_checksum
        self.versions = versions if versions is not None else RefitVersion()
        self._abandoned: set[int] = set()

    @property
    def version(self) -> int:
        """The last committed version (the counter's start before any)."""
        return self.versions.last

    def _is_stale(self, version: int) -> bool:
        return version in self._abandoned or version <= self.versions.last

    def receive(self, *, timeout: float | None = None, first_timeout: float | None = None) -> ReceiveReport:
        """Receive, validate and apply the next complete version.

        Args:
            timeout: deadline per bucket after the first, seconds (default: the receiver's).
            first_timeout: deadline for the first bucket, e.g. the length of a train step (default: ``timeout``).

        Returns:
            A :class:`ReceiveReport` for the committed version.

        Raises:
            TransportTimeoutError: the sender died or stalled; nothing applied.
            RefitAbortedError: the sender abandoned the version; nothing applied.
            TransportClosedError: the sender closed the transport (between versions).
            RefitError: a corrupt or inconsistent bucket, a stale version, or an applier
                refusal; nothing applied.
        """
        per_bucket = timeout if timeout is not None else self.timeout
        wait = first_timeout if first_timeout is not None else per_bucket
        version: int | None = None
        expected_index = 0
        staged: list[tuple[str, torch.Tensor]] = []
        metas: list[TensorMeta] = []
        names: set[str] = set()
        discarded = 0
        payload_bytes = 0
        start = 0.0
        try:
            while True:
                try:
                    bucket = self.transport.recv(timeout=wait)
                except RefitAbortedError as exc:
                    if version is None and exc.version is not None and self._is_stale(exc.version):
                        logger.info("dropping the abort of already abandoned refit version %d", exc.version)
                        continue
                    if version is None and exc.version is not None:
                        version = exc.version  # abandoned before its first bucket
                    raise
                if version is None:
                    if self._is_stale(bucket.version):
                        if bucket.version not in self._abandoned:
                            self._abandoned.add(bucket.version)
                            raise RefitError(
                                f"bucket {bucket.index} of version {bucket.version}: version is not newer than the "
                                f"applied version {self.versions.last}; versions must strictly increase"
                            )
                        discarded += 1
                        logger.info("dropping stale %s of an abandoned refit", bucket.describe())
                        continue
                    version = bucket.version
                    start = time.perf_counter()
                if bucket.version != version:
                    raise RefitError(
                        f"bucket {bucket.index} of version {bucket.version} arrived while version {version} was "
                        f"incomplete (next expected: bucket {expected_index}); the stream mixes versions"
                    )
                if bucket.index != expected_index:
                    raise RefitError(
                        f"bucket {bucket.index} of version {version} arrived, expected bucket {expected_index}; "
                        "buckets were lost or reordered"
                    )
                pairs = unpack_bucket(bucket, expected_version=version, verify_checksum=self.verify_checksum)
                for name, _ in pairs:
                    if name in names:
                        raise RefitError(
                            f"bucket {bucket.index} of version {version}, tensor {name!r}: sent twice in one version"
                        )
                    names.add(name)
                staged.extend(pairs)
                metas.extend(bucket.metas)
                payload_bytes += bucket.tensor_bytes
                expected_index += 1
                wait = per_bucket
                if bucket.is_last:
                    break
            self.applier.begin(version, metas)
            for name, tensor in staged:
                self.applier.stage(name, tensor)
            self.applier.commit(version)
        except TransportClosedError:
            if version is not None:
                self._fail(version, "the sender closed the transport mid-version")
            raise
        except Exception as exc:
            if version is not None:
                self._fail(version, f"{type(exc).__name__}: {exc}")
            if isinstance(exc, RefitError):
                raise
            raise RefitError(f"refit version {version} failed: {type(exc).__name__}: {exc}") from exc
        self.versions.observe(version, what="refit receiver")
        report = ReceiveReport(
            version=version,
            num_tensors=len(staged),
            num_buckets=expected_index,
            payload_bytes=payload_bytes,
            seconds=time.perf_counter() - start,
            discarded_buckets=discarded,
        )
        logger.debug("refit v%d applied: %d tensors from %d buckets", version, report.num_tensors, report.num_buckets)
        return report

    def _fail(self, version: int, reason: str) -> None:
        self._abandoned.add(version)
        logger.warning("refit version %d abandoned, engine keeps version %d: %s", version, self.versions.last, reason)
        try:
            self.applier.abort(version, reason)
        except Exception as exc:  # the original failure is what the caller must see
            logger.error("applier.abort(%d) raised %s: %s", version, type(exc).__name__, exc)
