"""The :class:`Transport` interface every refit transport implements, and its deadlines.

Every wait has a deadline. A peer that dies or stalls becomes a
:class:`~megatron_fp8.errors.TransportTimeoutError` naming the peer rank(s) and
the bucket, never a hang. A sender that gives up mid-version sends an *abort*
message; the receiver's :meth:`Transport.recv` then raises
:class:`~megatron_fp8.errors.RefitAbortedError`. An orderly :meth:`Transport.close`
on the sender makes the receiver's next ``recv`` raise
:class:`~megatron_fp8.errors.TransportClosedError`.

The wire also runs backwards: after each version every receiver sends one
:class:`~megatron_fp8.refit.wire.RefitOutcome` (:meth:`Transport.send_outcome`)
and the sender collects one per receiver (:meth:`Transport.recv_outcomes`), with
a deadline, so ``RefitSender.send`` knows whether its version was committed.
"""

from __future__ import annotations

import abc
import time

from megatron_fp8.errors import ConfigError, TransportClosedError
from megatron_fp8.refit.wire import Bucket, RefitOutcome

DEFAULT_TIMEOUT_S = 120.0
"""Default per-wait deadline of every transport, seconds."""

KIND_BUCKET = 0
"""Message kind of the inter-process transports: a bucket follows."""
KIND_ABORT = 1
"""Message kind: the sender abandoned a version (the reason follows as UTF-8)."""
KIND_CLOSE = 2
"""Message kind: the sender closed the transport; nothing more comes."""


class Transport(abc.ABC):
    """Moves :class:`~megatron_fp8.refit.wire.Bucket` objects from one sender to one or more receivers.

    Counters (``buckets_sent``, ``bytes_sent``, ``aborts_sent``,
    ``buckets_received``) count what actually went on (or came off) the wire.

    Args:
        timeout: default deadline of every wait, seconds.
    """

    name: str = "transport"
    fresh_payloads: bool = False
    """Every bucket :meth:`recv` returns carries a payload buffer of its own that nothing else writes afterwards (the
    receiver may then keep it as the staging area of its version, without a copy). ``False``: it may be reused."""

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT_S):
        if timeout <= 0:
            raise ConfigError(f"transport timeout must be > 0 seconds, got {timeout}")
        self.timeout = float(timeout)
        self.buckets_sent = 0
        self.bytes_sent = 0
        self.aborts_sent = 0
        self.buckets_received = 0
        self._closed = False

    def _deadline(self, timeout: float | None) -> float:
        """The :func:`time.monotonic` instant by which a wait of ``timeout`` seconds (default: the transport's) ends."""
        return time.monotonic() + (self.timeout if timeout is None else float(timeout))

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError(f"the {self.name} transport is closed; create a new one to refit again")

    @abc.abstractmethod
    def send(self, bucket: Bucket, *, timeout: float | None = None) -> None:
        """Hand ``bucket`` to the receiver(s); may return before delivery (see :meth:`flush`).

        Raises:
            TransportTimeoutError: the receiver(s) did not take it within ``timeout`` seconds.
        """

    @abc.abstractmethod
    def send_abort(self, version: int, index: int, reason: str, *, timeout: float | None = None) -> None:
        """Tell the receiver(s) that ``version`` is abandoned at bucket ``index`` (they discard it)."""

    @abc.abstractmethod
    def recv(self, timeout: float | None = None) -> Bucket:
        """Wait for the next bucket.

        Raises:
            TransportTimeoutError: nothing arrived within ``timeout`` seconds, or the sender died.
            RefitAbortedError: the sender abandoned the version being received.
            TransportClosedError: the sender closed the transport.
        """

    @abc.abstractmethod
    def send_outcome(self, outcome: RefitOutcome, *, timeout: float | None = None) -> None:
        """Receiver side: tell the sender what became of ``outcome.version``.

        Raises:
            TransportTimeoutError: the sender did not take it within ``timeout`` seconds (it died).
        """

    @abc.abstractmethod
    def recv_outcomes(self, version: int, stream_id: int, *, timeout: float | None = None) -> tuple[RefitOutcome, ...]:
        """Sender side: wait for the outcome of ``(version, stream_id)`` from every receiver.

        Outcomes of other versions or sendings (late answers to an earlier call) are skipped.

        Returns:
            One :class:`RefitOutcome` per receiver.

        Raises:
            TransportTimeoutError: some receiver sent none within ``timeout`` seconds; the message names the
                receiver(s) and the version (the receiver died, stalled, or nothing is receiving).
        """

    def flush(self, timeout: float | None = None) -> None:  # noqa: B027 - optional hook, no-op by default
        """Wait until every bucket handed to :meth:`send` has been delivered."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources; a sender tells its receivers that no more buckets come."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
