"""``inproc``: a bounded queue between a sender thread and a receiver thread of one process."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass

from megatron_fp8.errors import ConfigError, RefitAbortedError, TransportClosedError, TransportTimeoutError
from megatron_fp8.refit.transport.base import DEFAULT_TIMEOUT_S, Transport
from megatron_fp8.refit.wire import Bucket, RefitOutcome

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Abort:
    """The sender abandoned ``version`` at bucket ``index`` because of ``reason``."""

    version: int
    index: int
    reason: str


_Message = Bucket | _Abort | None
"""What travels through the queue; ``None`` means the sender closed the transport."""

_MAX_UNCLAIMED_OUTCOMES = 64
"""Outcomes no sender waits for (e.g. for buckets pushed in by hand) are kept up to this many, oldest dropped."""


class InProcTransport(Transport):
    """A bounded queue between a sender thread and a receiver thread of one process.

    The bucket object itself is passed (no copy): :func:`~megatron_fp8.refit.buckets.pack_buckets`
    gives every bucket a fresh buffer, so nothing is overwritten while queued. Outcomes travel back
    through a mailbox keyed by ``(version, stream_id)``, so several senders may share one transport.

    Args:
        maxsize: buckets the queue holds before :meth:`send` blocks (>= 1).
        timeout: default deadline of every wait, seconds.
    """

    name = "inproc"
    fresh_payloads = (
        True  # the sender's own bucket, a fresh buffer per bucket (:func:`~megatron_fp8.refit.buckets.pack_buckets`)
    )

    def __init__(self, *, maxsize: int = 4, timeout: float = DEFAULT_TIMEOUT_S):
        super().__init__(timeout=timeout)
        if maxsize < 1:
            raise ConfigError(f"InProcTransport maxsize must be >= 1, got {maxsize}")
        self._queue: queue.Queue[_Message] = queue.Queue(maxsize=maxsize)
        self._peer_closed = False
        self._outcomes: collections.deque[RefitOutcome] = collections.deque(maxlen=_MAX_UNCLAIMED_OUTCOMES)
        self._outcome_cv = threading.Condition()

    def _put(self, item: _Message, timeout: float | None, what: str) -> None:
        self._check_open()
        wait = self.timeout if timeout is None else timeout
        try:
            self._queue.put(item, timeout=wait)
        except queue.Full:
            raise TransportTimeoutError(
                f"inproc transport: the receiver did not take {what} within {wait:.3g}s "
                f"(queue of {self._queue.maxsize} full); is the receiver running?"
            ) from None

    def send(self, bucket: Bucket, *, timeout: float | None = None) -> None:
        self._put(bucket, timeout, bucket.describe())
        self.buckets_sent += 1
        self.bytes_sent += bucket.nbytes

    def send_abort(self, version: int, index: int, reason: str, *, timeout: float | None = None) -> None:
        self._put(_Abort(version, index, reason), timeout, f"the abort of version {version}")
        self.aborts_sent += 1

    def recv(self, timeout: float | None = None) -> Bucket:
        if self._peer_closed:
            raise TransportClosedError("inproc transport: the sender closed it; no more buckets will come")
        wait = self.timeout if timeout is None else timeout
        try:
            item = self._queue.get(timeout=wait)
        except queue.Empty:
            raise TransportTimeoutError(
                f"inproc transport: no bucket arrived from the sender within {wait:.3g}s"
            ) from None
        if item is None:
            self._peer_closed = True
            raise TransportClosedError("inproc transport: the sender closed it; no more buckets will come")
        if isinstance(item, _Abort):
            raise RefitAbortedError(
                f"the sender abandoned refit version {item.version} at bucket {item.index}: {item.reason}",
                version=item.version,
            )
        self.buckets_received += 1
        return item

    def send_outcome(self, outcome: RefitOutcome, *, timeout: float | None = None) -> None:
        with self._outcome_cv:
            self._outcomes.append(outcome)
            self._outcome_cv.notify_all()

    def recv_outcomes(self, version: int, stream_id: int, *, timeout: float | None = None) -> tuple[RefitOutcome, ...]:
        deadline = self._deadline(timeout)
        with self._outcome_cv:
            while True:
                for outcome in self._outcomes:
                    if outcome.version == version and outcome.stream_id == stream_id:
                        self._outcomes.remove(outcome)
                        return (outcome,)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeoutError(
                        f"inproc transport: the receiver sent no outcome for refit version {version} within "
                        f"{self.timeout if timeout is None else timeout:.3g}s; it died or stalled before applying, "
                        "or no RefitReceiver reads this transport"
                    )
                self._outcome_cv.wait(left)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            logger.warning("inproc transport closed with a full queue; the receiver will time out instead")
        self._closed = True
