"""``cuda_ipc``: CUDA IPC handles of each bucket sent to a colocated engine process, which copies the bytes out."""

from __future__ import annotations

import collections
import logging
import queue
import time
from typing import Protocol

import torch
from torch.multiprocessing.reductions import reduce_tensor

from megatron_fp8.errors import (
    ConfigError,
    RefitAbortedError,
    RefitError,
    TransportClosedError,
    TransportTimeoutError,
)
from megatron_fp8.refit.transport.base import DEFAULT_TIMEOUT_S, KIND_ABORT, KIND_BUCKET, KIND_CLOSE, Transport
from megatron_fp8.refit.wire import Bucket, RefitOutcome, bucket_from_wire, encode_bucket_meta

logger = logging.getLogger(__name__)


class IpcQueue(Protocol):
    """A process-safe queue, e.g. ``torch.multiprocessing.get_context("spawn").Queue()``.

    Data messages are 10-tuples ``(kind, seq, version, index, is_last, meta_bytes,
    checksum, stream_id, rebuild, rebuild_args)``; the back queue carries
    acknowledgements ``("ack", seq, error or None)`` and outcomes
    ``("outcome", version, stream_id, status, reason)``.
    """

    def put(self, obj: tuple, block: bool = True, timeout: float | None = None) -> None:
        """Enqueue ``obj``; raise :class:`queue.Full` after ``timeout`` seconds."""

    def get(self, block: bool = True, timeout: float | None = None) -> tuple:
        """Dequeue the next message; raise :class:`queue.Empty` after ``timeout`` seconds."""


class CudaIpcTransport(Transport):
    """Pass CUDA IPC handles of bucket payloads to a colocated engine process.

    The sender shares each CUDA payload with
    :func:`torch.multiprocessing.reductions.reduce_tensor` and puts the handle
    plus header and metadata on ``data_queue``; the receiver rebuilds the
    tensor, copies it into its own buffer, synchronizes, and acknowledges on
    ``ack_queue`` so the sender may free its buffer. At most ``max_in_flight``
    buckets are unacknowledged (2: double buffering). Both queues come from
    :meth:`make_queues` (``spawn`` context) and are passed to the engine
    process at start. Sender and receiver must be different processes on the
    same GPU node. After each version the receiver puts its outcome on
    ``ack_queue``; the sender skips stale ones (another version or sending).

    Args:
        data_queue: sender -> receiver messages.
        ack_queue: receiver -> sender acknowledgements.
        role: ``"sender"`` or ``"receiver"``.
        timeout: default deadline of every wait, seconds.
        device: CUDA device for received copies (default: the current device).
        max_in_flight: unacknowledged buckets the sender allows (>= 1).
    """

    name = "cuda_ipc"
    fresh_payloads = True  # a fresh copy of the sender's buffer per received bucket
    ROLES = ("sender", "receiver")

    def __init__(
        self,
        data_queue: IpcQueue,
        ack_queue: IpcQueue,
        *,
        role: str,
        timeout: float = DEFAULT_TIMEOUT_S,
        device: torch.device | str | None = None,
        max_in_flight: int = 2,
    ):
        super().__init__(timeout=timeout)
        if role not in self.ROLES:
            raise ConfigError(f"CudaIpcTransport role {role!r} is unknown; valid roles: {list(self.ROLES)}")
        if not torch.cuda.is_available():
            raise ConfigError("the cuda_ipc transport needs CUDA; use 'inproc' or 'gloo' on CPU")
        if max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.role = role
        self._data = data_queue
        self._ack = ack_queue
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.max_in_flight = max_in_flight
        # sequence number -> (payload kept alive until acknowledged, bucket description)
        self._unacked: collections.OrderedDict[int, tuple[torch.Tensor, str]] = collections.OrderedDict()
        self._seq = 0
        self._outcomes: list[RefitOutcome] = []  # outcomes read while waiting for acknowledgements

    @staticmethod
    def make_queues() -> tuple[IpcQueue, IpcQueue]:
        """``(data_queue, ack_queue)`` from a ``spawn`` multiprocessing context."""
        ctx = torch.multiprocessing.get_context("spawn")
        return ctx.Queue(), ctx.Queue()

    def _require(self, role: str, op: str) -> None:
        if self.role != role:
            raise RefitError(f"this cuda_ipc transport end is the {self.role}; it cannot {op}")

    def _put(self, msg: tuple, timeout: float | None, what: str) -> None:
        wait = self.timeout if timeout is None else timeout
        try:
            self._data.put(msg, timeout=wait)
        except queue.Full:
            raise TransportTimeoutError(f"cuda_ipc: the receiver did not take {what} within {wait:.3g}s") from None

    def _next_back(self, deadline: float, what: str) -> tuple:
        """The next acknowledgement from the back queue; outcomes met on the way are kept."""
        while True:
            try:
                got = self._ack.get(timeout=max(deadline - time.monotonic(), 1e-3))
            except queue.Empty:
                raise TransportTimeoutError(
                    f"cuda_ipc: the receiver process sent no {what} within {self.timeout:.3g}s; "
                    "it died or stalled (the engine keeps its last good version)"
                ) from None
            if got[0] != "outcome":
                return got
            _, version, stream_id, status, reason = got
            self._outcomes.append(RefitOutcome(version, status, reason, stream_id=stream_id, receiver="engine process"))
            del self._outcomes[:-64]

    def _wait_ack(self, deadline: float) -> None:
        seq, (_, what) = next(iter(self._unacked.items()))
        _, ack_seq, error = self._next_back(deadline, f"acknowledgement of {what}")
        if error:
            raise RefitError(f"cuda_ipc: the receiver failed to open {what}: {error}")
        if ack_seq != seq:
            raise RefitError(f"cuda_ipc: acknowledgement out of order (expected message {seq}, got {ack_seq})")
        self._unacked.popitem(last=False)

    def send(self, bucket: Bucket, *, timeout: float | None = None) -> None:
        self._require("sender", "send")
        self._check_open()
        if bucket.payload.device.type != "cuda":
            raise RefitError(
                f"cuda_ipc carries CUDA payloads, but {bucket.describe()} lives on {bucket.payload.device}; "
                "pack on the GPU (pack_buckets(device='cuda')) or use the 'inproc'/'gloo' transport"
            )
        deadline = self._deadline(timeout)
        while len(self._unacked) >= self.max_in_flight:
            self._wait_ack(deadline)
        rebuild, args = reduce_tensor(bucket.payload)
        self._seq += 1
        msg = (
            KIND_BUCKET,
            self._seq,
            bucket.version,
            bucket.index,
            bucket.is_last,
            encode_bucket_meta(bucket.metas, bucket.trailer),
            bucket.checksum,
            bucket.stream_id,
            rebuild,
            args,
        )
        self._unacked[self._seq] = (bucket.payload, bucket.describe())
        self._put(msg, timeout, bucket.describe())
        self.buckets_sent += 1
        self.bytes_sent += bucket.nbytes

    def send_abort(self, version: int, index: int, reason: str, *, timeout: float | None = None) -> None:
        self._require("sender", "send an abort")
        self._check_open()
        self._put(
            (KIND_ABORT, 0, version, index, False, reason.encode("utf-8"), 0, 0, None, None),
            timeout,
            f"the abort of version {version}",
        )
        self.aborts_sent += 1

    def flush(self, timeout: float | None = None) -> None:
        if self.role != "sender":
            return
        deadline = self._deadline(timeout)
        while self._unacked:
            self._wait_ack(deadline)

    def send_outcome(self, outcome: RefitOutcome, *, timeout: float | None = None) -> None:
        self._require("receiver", "send an outcome")
        msg = ("outcome", outcome.version, outcome.stream_id, outcome.status, outcome.reason)
        try:
            self._ack.put(msg, timeout=self.timeout if timeout is None else timeout)
        except queue.Full:
            raise TransportTimeoutError(
                f"cuda_ipc: the sender did not take the outcome of refit version {outcome.version}"
            ) from None

    def recv_outcomes(self, version: int, stream_id: int, *, timeout: float | None = None) -> tuple[RefitOutcome, ...]:
        self._require("sender", "collect outcomes")
        deadline = self._deadline(timeout)
        while True:
            for outcome in self._outcomes:
                if outcome.version == version and outcome.stream_id == stream_id:
                    self._outcomes.remove(outcome)
                    return (outcome,)
            try:
                got = self._ack.get(timeout=max(deadline - time.monotonic(), 1e-3))
            except queue.Empty:
                raise TransportTimeoutError(
                    f"cuda_ipc: the engine process sent no outcome for refit version {version} within "
                    f"{self.timeout if timeout is None else timeout:.3g}s; it died or stalled before applying"
                ) from None
            if got[0] == "outcome":
                _, v, sid, status, reason = got
                self._outcomes.append(RefitOutcome(v, status, reason, stream_id=sid, receiver="engine process"))
                del self._outcomes[:-64]
            else:
                logger.warning("cuda_ipc: dropping an acknowledgement that arrived after flush: %s", got)

    def recv(self, timeout: float | None = None) -> Bucket:
        self._require("receiver", "recv")
        self._check_open()
        wait = self.timeout if timeout is None else timeout
        try:
            kind, seq, version, index, is_last, meta, checksum, stream_id, rebuild, args = self._data.get(timeout=wait)
        except queue.Empty:
            raise TransportTimeoutError(
                f"cuda_ipc: no bucket arrived from the sender process within {wait:.3g}s"
            ) from None
        if kind == KIND_CLOSE:
            self._closed = True
            raise TransportClosedError("cuda_ipc: the sender closed the transport")
        if kind == KIND_ABORT:
            raise RefitAbortedError(
                f"the sender abandoned refit version {version} at bucket {index}: "
                f"{meta.decode('utf-8', errors='replace')}",
                version=version,
            )
        try:
            shared = rebuild(*args)
            payload = torch.empty(shared.numel(), dtype=torch.uint8, device=self.device)
            payload.copy_(shared)
            torch.cuda.current_stream(self.device).synchronize()
            del shared
        except Exception as exc:  # report to the sender, then fail here too
            self._ack.put(("ack", seq, f"{type(exc).__name__}: {exc}"))
            raise RefitError(f"cuda_ipc: could not open bucket {index} of version {version}: {exc}") from exc
        self._ack.put(("ack", seq, None))
        self.buckets_received += 1
        return bucket_from_wire(
            version=version,
            index=index,
            is_last=bool(is_last),
            meta=meta,
            payload=payload,
            checksum=checksum,
            stream_id=stream_id,
            where="cuda_ipc",
        )

    def close(self) -> None:
        if self._closed:
            return
        if self.role == "sender":
            try:
                self.flush(timeout=min(self.timeout, 10.0))
                self._data.put((KIND_CLOSE, 0, 0, 0, False, b"", 0, 0, None, None), timeout=min(self.timeout, 10.0))
            except (RefitError, queue.Full) as exc:
                logger.warning("closing the cuda_ipc transport: the receiver was not told (%s)", exc)
        self._closed = True
