"""Trainer side of a refit: pack a weight stream into buckets, push them through a transport, and learn the outcome.

:meth:`RefitSender.send` returns only when every receiver reported that it
committed the version; it raises :class:`~megatron_fp8.errors.RefitRefusedError`
when one refused it or rolled back, and
:class:`~megatron_fp8.errors.TransportTimeoutError` when one sent no outcome
within the deadline (it died or stalled before applying).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from megatron_fp8.errors import RefitError, RefitRefusedError, TransportClosedError, TransportTimeoutError
from megatron_fp8.refit.buckets import default_bucket_bytes, pack_buckets
from megatron_fp8.refit.transport.base import Transport
from megatron_fp8.refit.wire import DTYPES, RefitOutcome, RefitVersion, TensorMeta
from megatron_fp8.vocab import PAYLOAD_CLASSES

logger = logging.getLogger(__name__)


_FP8_DTYPES = frozenset(n for n in DTYPES if n.startswith("float8_") and n != "float8_e8m0fnu")
_SCALE_SUFFIXES = ("_scale_inv", "_scale")


def payload_class(meta: TensorMeta) -> str:
    """The :data:`PAYLOAD_CLASSES` entry a tensor's bytes count towards.

    ``fp8``: any FP8 element dtype; ``scales``: a name ending in ``_scale_inv``
    or ``_scale`` (weight block scales, KV scales) or a UE8M0 tensor;
    ``bf16``: bfloat16; ``other``: everything else.
    """
    if meta.dtype in _FP8_DTYPES:
        return "fp8"
    if meta.dtype == "float8_e8m0fnu" or meta.name.endswith(_SCALE_SUFFIXES):
        return "scales"
    if meta.dtype == "bfloat16":
        return "bf16"
    return "other"


@dataclass(frozen=True)
class SendReport:
    """What one :meth:`RefitSender.send` moved.

    Attributes:
        version: refit version.
        num_tensors: tensors sent.
        num_buckets: buckets sent.
        payload_bytes: tensor bytes by class (:data:`PAYLOAD_CLASSES`), no padding.
        wire_bytes: payload bytes including alignment padding.
        seconds: wall time from the first stream item to the receivers' outcomes
            (includes producing the stream, e.g. quantization, and the receivers' commit), seconds.
        outcomes: one ``committed`` :class:`RefitOutcome` per receiver.
    """

    version: int
    num_tensors: int
    num_buckets: int
    payload_bytes: Mapping[str, int] = field(default_factory=dict)
    wire_bytes: int = 0
    seconds: float = 0.0
    outcomes: tuple[RefitOutcome, ...] = ()

    @property
    def total_bytes(self) -> int:
        """Sum of :attr:`payload_bytes`."""
        return sum(self.payload_bytes.values())

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1e9 bytes) of tensor bytes over :attr:`seconds`."""
        return self.total_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        """A JSON-able dict."""
        return {
            "version": self.version,
            "num_tensors": self.num_tensors,
            "num_buckets": self.num_buckets,
            "payload_bytes": dict(self.payload_bytes),
            "total_bytes": self.total_bytes,
            "wire_bytes": self.wire_bytes,
            "seconds": self.seconds,
            "gbps": self.gbps,
        }


def _raise_unless_committed(version: int, outcomes: tuple[RefitOutcome, ...]) -> None:
    """Raise :class:`RefitRefusedError` unless every outcome is ``committed``."""
    failed = [o for o in outcomes if not o.committed]
    if not failed:
        return
    status = "rolled_back" if any(o.status == "rolled_back" for o in failed) else "refused"
    reason = "; ".join(f"{o.receiver}: {o.reason}" for o in failed)
    committed = [o.receiver for o in outcomes if o.committed]
    also = f" ({', '.join(committed)} committed it: the engines now differ)" if committed else ""
    raise RefitRefusedError(
        f"refit version {version} was {status.replace('_', ' ')} by {len(failed)} of {len(outcomes)} receiver(s)"
        f"{also}: {reason}",
        version=version,
        outcome=status,
        reason=reason,
    )


class RefitSender:
    """Send whole refit versions through a :class:`Transport`.

    If the stream fails part-way (a NaN weight, a duplicate name, a transport
    error, an exception from the stream itself), the sender tells the
    receivers to abandon the version (when the wire still works) and re-raises;
    receivers stage buckets and apply nothing of an unfinished version. A
    NaN in the first bucket is caught before any bucket is sent. Each sending
    gets a random stream id, which every bucket carries and every outcome echoes.

    Args:
        transport: the sending end.
        bucket_bytes: bucket capacity in bytes; default :func:`default_bucket_bytes` for ``device``.
        device: where bucket buffers live (default: the device of each bucket's first tensor).
        timeout: per-wait deadline in seconds (default: the transport's).
        versions: version counter to enforce strictly increasing versions (default: a fresh one from 0).
        outcome_timeout: how long :meth:`send` waits, after the last bucket was delivered, for every receiver
            to validate, commit and report, seconds (default: ``timeout``, else the transport's).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        bucket_bytes: int | None = None,
        device: torch.device | str | None = None,
        timeout: float | None = None,
        versions: RefitVersion | None = None,
        outcome_timeout: float | None = None,
    ):
        self.transport = transport
        self.device = device
        self.bucket_bytes = bucket_bytes if bucket_bytes is not None else default_bucket_bytes(device)
        self.timeout = timeout
        self.versions = versions if versions is not None else RefitVersion()
        self.outcome_timeout = outcome_timeout if outcome_timeout is not None else timeout

    def send(
        self, stream: Iterable[tuple[str, torch.Tensor]], *, version: int, outcome_timeout: float | None = None
    ) -> SendReport:
        """Pack and send one version, then wait until every receiver reports that it committed it.

        Args:
            stream: ``(hf_name, tensor)`` pairs (FP8 weights, float32 ``*_scale_inv``,
                BF16 tensors, KV scales); consumed once.
            version: refit version, greater than every version sent before.
            outcome_timeout: deadline for the receivers' outcomes after the last bucket, seconds
                (default: the sender's).

        Returns:
            A :class:`SendReport` (with every receiver's ``committed`` outcome).

        Raises:
            RefitRefusedError: a receiver refused the version or rolled its engine back; ``reason`` is its reason.
            TransportTimeoutError: a receiver took no bucket, or sent no outcome within the deadline (it died or
                stalled); the message names the receiver(s) and the version.
            RefitError: version not increasing, bad stream item, transport failure.
            NonFiniteError: a tensor holds NaN/Inf.
        """
        self.versions.observe(version, what="refit sender")
        start = time.perf_counter()
        stream_id = secrets.randbits(62)
        by_class = dict.fromkeys(PAYLOAD_CLASSES, 0)
        num_tensors = num_buckets = wire = 0
        try:
            for bucket in pack_buckets(
                stream, version=version, bucket_bytes=self.bucket_bytes, device=self.device, stream_id=stream_id
            ):
                self.transport.send(bucket, timeout=self.timeout)
                num_buckets += 1
                num_tensors += len(bucket.metas)
                wire += bucket.nbytes
                for meta in bucket.metas:
                    by_class[payload_class(meta)] += meta.nbytes
            self.transport.flush(self.timeout)
        except Exception as exc:
            self._abort(version, num_buckets, exc)
            raise
        wait = outcome_timeout if outcome_timeout is not None else self.outcome_timeout
        outcomes = self.transport.recv_outcomes(version, stream_id, timeout=wait)
        _raise_unless_committed(version, outcomes)
        seconds = time.perf_counter() - start
        report = SendReport(
            version=version,
            num_tensors=num_tensors,
            num_buckets=num_buckets,
            payload_bytes=MappingProxyType(by_class),
            wire_bytes=wire,
            seconds=seconds,
            outcomes=outcomes,
        )
        logger.debug(
            "refit v%d sent: %d tensors in %d buckets, %.1f MB in %.3fs (%.2f GB/s)",
            version,
            num_tensors,
            num_buckets,
            report.total_bytes / 1e6,
            seconds,
            report.gbps,
        )
        return report

    def _abort(self, version: int, index: int, exc: Exception) -> None:
        if isinstance(exc, (TransportTimeoutError, TransportClosedError)):
            return  # the wire is gone; receivers time out on their own
        reason = f"{type(exc).__name__}: {exc}"
        try:
            self.transport.send_abort(version, index, reason, timeout=self.timeout)
        except RefitError as abort_exc:
            logger.warning("refit v%d: could not tell the receivers to abort (%s)", version, abort_exc)

    def close(self) -> None:
        """Close the transport (receivers get an orderly close)."""
        self.transport.close()
