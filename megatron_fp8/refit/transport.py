"""Transports that move refit buckets from the trainer to the rollout engine(s).

One interface, :class:`Transport`, with four implementations picked by name from
:data:`FACTORIES` (:func:`make_transport`):

* ``inproc``: a bounded queue between two threads of one process;
* ``gloo`` / ``nccl``: :class:`TorchDistTransport`, a ``torch.distributed``
  broadcast from the trainer rank to every rollout rank of a process group;
* ``cuda_ipc``: :class:`CudaIpcTransport`, CUDA IPC handles of the bucket sent
  to a colocated engine process, which copies the bytes out.

Every wait has a deadline. A peer that dies or stalls becomes a
:class:`~megatron_fp8.errors.TransportTimeoutError` naming the peer rank(s) and
the bucket, never a hang. A sender that gives up mid-version sends an *abort*
message; the receiver's :meth:`Transport.recv` then raises
:class:`~megatron_fp8.errors.RefitAbortedError`. An orderly :meth:`Transport.close`
on the sender makes the receiver's next ``recv`` raise
:class:`~megatron_fp8.errors.TransportClosedError`.
"""

from __future__ import annotations

import abc
import collections
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from megatron_fp8.errors import (
    ConfigError,
    RefitAbortedError,
    RefitError,
    TransportClosedError,
    TransportTimeoutError,
)
from megatron_fp8.refit.buckets import Bucket, decode_metas, encode_metas

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
"""Default per-wait deadline of every transport, seconds."""

_KIND_BUCKET = 0
_KIND_ABORT = 1
_KIND_CLOSE = 2
_MAGIC = 0x46503852  # "FP8R"
_HEADER_LEN = 8  # magic, kind, version, index, is_last, meta_len, payload_len, checksum


class Transport(abc.ABC):
    """Moves :class:`Bucket` objects from one sender to one or more receivers.

    Counters (``buckets_sent``, ``bytes_sent``, ``aborts_sent``,
    ``buckets_received``) count what actually went on (or came off) the wire.

    Args:
        timeout: default deadline of every wait, seconds.
    """

    name: str = "transport"

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

    def flush(self, timeout: float | None = None) -> None:  # noqa: B027 - optional hook, no-op by default
        """Wait until every bucket handed to :meth:`send` has been delivered."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources; a sender tells its receivers that no more buckets come."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- inproc


class InProcTransport(Transport):
    """A bounded queue between a sender thread and a receiver thread of one process.

    The bucket object itself is passed (no copy): :func:`pack_buckets` gives
    every bucket a fresh buffer, so nothing is overwritten while queued.

    Args:
        maxsize: buckets the queue holds before :meth:`send` blocks (>= 1).
        timeout: default deadline of every wait, seconds.
    """

    name = "inproc"

    def __init__(self, *, maxsize: int = 4, timeout: float = DEFAULT_TIMEOUT_S):
        super().__init__(timeout=timeout)
        if maxsize < 1:
            raise ConfigError(f"InProcTransport maxsize must be >= 1, got {maxsize}")
        self._queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=maxsize)
        self._peer_closed = False

    def _put(self, item: tuple[int, Any], timeout: float | None, what: str) -> None:
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
        self._put((_KIND_BUCKET, bucket), timeout, bucket.describe())
        self.buckets_sent += 1
        self.bytes_sent += bucket.nbytes

    def send_abort(self, version: int, index: int, reason: str, *, timeout: float | None = None) -> None:
        self._put((_KIND_ABORT, (version, index, reason)), timeout, f"the abort of version {version}")
        self.aborts_sent += 1

    def recv(self, timeout: float | None = None) -> Bucket:
        if self._peer_closed:
            raise TransportClosedError("inproc transport: the sender closed it; no more buckets will come")
        wait = self.timeout if timeout is None else timeout
        try:
            kind, item = self._queue.get(timeout=wait)
        except queue.Empty:
            raise TransportTimeoutError(
                f"inproc transport: no bucket arrived from the sender within {wait:.3g}s"
            ) from None
        if kind == _KIND_CLOSE:
            self._peer_closed = True
            raise TransportClosedError("inproc transport: the sender closed it; no more buckets will come")
        if kind == _KIND_ABORT:
            version, index, reason = item
            raise RefitAbortedError(
                f"the sender abandoned refit version {version} at bucket {index}: {reason}", version=version
            )
        self.buckets_received += 1
        return item

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait((_KIND_CLOSE, None))
        except queue.Full:
            logger.warning("inproc transport closed with a full queue; the receiver will time out instead")
        self._closed = True


# ----------------------------------------------------------------------------- torch.distributed


@dataclass
class _InFlight:
    works: list[Any]
    tensors: tuple[torch.Tensor, ...]
    what: str
    deadline: float


class TorchDistTransport(Transport):
    """Broadcast buckets from rank ``src`` to the other ranks of a process group.

    Wire format per message: an int64 header ``[magic, kind, version, index,
    is_last, meta_len, payload_len, checksum]``, then the metadata as JSON bytes
    (``uint8``), then the payload (``uint8``); empty parts are skipped. The
    sender issues all three broadcasts with ``async_op=True`` and keeps at most
    ``max_in_flight`` buckets outstanding (2: double buffering, so packing the
    next bucket overlaps the transfer of this one). The receiver posts the next
    header broadcast as soon as it has a non-final bucket, so the transfer
    overlaps its unpacking.

    Waits: gloo uses ``work.wait(timeout=...)``, which raises on a stalled or a
    dead peer (measured with torch 2.13: "Operation timed out!" / "Connection
    reset by peer"); NCCL polls ``work.is_completed()`` against the deadline
    (its ``wait`` only orders streams). After a timeout the process group has a
    collective stuck in flight: the transport is marked broken and refuses
    further use; re-create the process group to refit again.

    Args:
        src: global rank of the trainer (the sender).
        group: process group holding ``src`` and the rollout ranks (default WORLD).
        timeout: default deadline of every wait, seconds. Keep it below the
            process group's own timeout so the transport reports first.
        device: where received buffers live; default CUDA current device for
            NCCL, CPU otherwise.
        max_in_flight: buckets the sender keeps outstanding (>= 1).
    """

    name = "torch_dist"

    def __init__(
        self,
        *,
        src: int = 0,
        group: Any = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        device: torch.device | str | None = None,
        max_in_flight: int = 2,
    ):
        super().__init__(timeout=timeout)
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "TorchDistTransport needs an initialized torch.distributed process group "
                "(call torch.distributed.init_process_group first)"
            )
        if max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self._dist = dist
        self.group = group
        self.backend = str(dist.get_backend(group)).lower()
        self.name = self.backend
        self.src = int(src)
        self.rank = dist.get_rank()
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        if self.src not in ranks:
            raise ConfigError(f"sender rank {self.src} is not in the refit process group (ranks {ranks})")
        if self.rank not in ranks:
            raise ConfigError(f"rank {self.rank} is not in the refit process group (ranks {ranks})")
        self.peers = [r for r in ranks if r != self.src]
        self.is_sender = self.rank == self.src
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.max_in_flight = max_in_flight
        self._poll = self.backend == "nccl"
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._prefetch: tuple[Any, torch.Tensor, float] | None = None
        self._broken: str | None = None

    # -- helpers

    def _peer_desc(self) -> str:
        if self.is_sender:
            return f"receiver rank(s) {self.peers}"
        return f"sender rank {self.src}"

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RefitError(
                f"{self.name} transport is unusable after an earlier failure ({self._broken}); "
                "re-create the process group and the transport"
            )
        self._check_open()

    def _wait(self, work: Any, deadline: float, what: str) -> None:
        try:
            if self._poll:
                pause = 1e-4
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError("deadline passed")
                    time.sleep(pause)
                    pause = min(pause * 2, 0.01)
                work.wait()
            else:
                remaining = max(deadline - time.monotonic(), 1e-3)
                work.wait(timeout=timedelta(seconds=remaining))
        except (RuntimeError, TimeoutError) as exc:
            self._broken = f"{what}: {str(exc).splitlines()[0][:200]}"
            raise TransportTimeoutError(
                f"{self.name} transport (rank {self.rank}): {what} did not complete within the {self.timeout:.3g}s "
                f"deadline; {self._peer_desc()} died or stalled ({str(exc).splitlines()[0][:200]}). "
                "The engine keeps its last good version; re-create the process group to refit again."
            ) from exc

    def _broadcast(self, tensor: torch.Tensor) -> Any:
        return self._dist.broadcast(tensor, src=self.src, group=self.group, async_op=True)

    def _header(
        self, kind: int, version: int, index: int, is_last: bool, meta_len: int, payload_len: int, checksum: int
    ) -> torch.Tensor:
        values = [_MAGIC, kind, version, index, int(is_last), meta_len, payload_len, checksum]
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _bytes_tensor(self, data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)

    def _issue(self, parts: list[torch.Tensor], what: str, timeout: float | None) -> None:
        while len(self._in_flight) >= self.max_in_flight:
            oldest = self._in_flight.popleft()
            for work in oldest.works:
                self._wait(work, oldest.deadline, oldest.what)
        works = [self._broadcast(t) for t in parts if t.numel()]
        self._in_flight.append(
            _InFlight(works=works, tensors=tuple(parts), what=what, deadline=self._deadline(timeout))
        )

    def _require_sender(self, op: str) -> None:
        if not self.is_sender:
            raise RefitError(
                f"rank {self.rank} is a receiver of this transport (sender is rank {self.src}); it cannot {op}"
            )

    # -- sender side

    def send(self, bucket: Bucket, *, timeout: float | None = None) -> None:
        self._require_sender("send")
        self._check_usable()
        meta = encode_metas(bucket.metas)
        payload = bucket.payload if bucket.payload.device == self.device else bucket.payload.to(self.device)
        header = self._header(
            _KIND_BUCKET, bucket.version, bucket.index, bucket.is_last, len(meta), payload.numel(), bucket.checksum
        )
        self._issue([header, self._bytes_tensor(meta), payload], f"sending {bucket.describe()}", timeout)
        self.buckets_sent += 1
        self.bytes_sent += bucket.nbytes

    def send_abort(self, version: int, index: int, reason: str, *, timeout: float | None = None) -> None:
        self._require_sender("send an abort")
        self._check_usable()
        text = reason.encode("utf-8")[:65536]
        header = self._header(_KIND_ABORT, version, index, False, len(text), 0, 0)
        self._issue([header, self._bytes_tensor(text)], f"sending the abort of version {version}", timeout)
        self.flush(timeout)
        self.aborts_sent += 1

    def flush(self, timeout: float | None = None) -> None:
        while self._in_flight:
            item = self._in_flight.popleft()
            deadline = item.deadline if timeout is None else min(item.deadline, self._deadline(timeout))
            for work in item.works:
                self._wait(work, deadline, item.what)

    # -- receiver side

    def _post_header(self) -> tuple[Any, torch.Tensor]:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        return self._broadcast(header), header

    def recv(self, timeout: float | None = None) -> Bucket:
        if self.is_sender:
            raise RefitError(f"rank {self.rank} is the sender of this transport; it cannot recv")
        self._check_usable()
        deadline = self._deadline(timeout)
        if self._prefetch is not None:
            work, header, _posted = self._prefetch
            self._prefetch = None
        else:
            work, header = self._post_header()
        self._wait(work, deadline, "receiving the next bucket header")
        magic, kind, version, index, is_last, meta_len, payload_len, checksum = header.tolist()
        if magic != _MAGIC or kind not in (_KIND_BUCKET, _KIND_ABORT, _KIND_CLOSE) or meta_len < 0 or payload_len < 0:
            self._broken = "corrupt header"
            raise RefitError(
                f"{self.name} transport (rank {self.rank}): corrupt bucket header {header.tolist()} from sender "
                f"rank {self.src}; sender and receiver disagree on the protocol or the stream is out of step"
            )
        if kind == _KIND_CLOSE:
            self._closed = True
            raise TransportClosedError(f"sender rank {self.src} closed the {self.name} transport")
        meta = torch.empty(meta_len, dtype=torch.uint8, device=self.device)
        payload = torch.empty(payload_len if kind == _KIND_BUCKET else 0, dtype=torch.uint8, device=self.device)
        what = f"receiving bucket {index} of version {version}"
        works = [self._broadcast(t) for t in (meta, payload) if t.numel()]
        for w in works:
            self._wait(w, deadline, what)
        meta_bytes = meta.cpu().numpy().tobytes()
        if kind == _KIND_ABORT:
            reason = meta_bytes.decode("utf-8", errors="replace")
            raise RefitAbortedError(
                f"sender rank {self.src} abandoned refit version {version} at bucket {index}: {reason}", version=version
            )
        if not is_last:
            work_next, header_next = self._post_header()
            self._prefetch = (work_next, header_next, time.monotonic())
        self.buckets_received += 1
        return Bucket(
            version=version,
            index=index,
            is_last=bool(is_last),
            metas=decode_metas(meta_bytes),
            payload=payload,
            checksum=checksum,
        )

    def close(self) -> None:
        if self._closed:
            return
        if self.is_sender and self._broken is None:
            try:
                self.flush(timeout=min(self.timeout, 10.0))
                header = self._header(_KIND_CLOSE, 0, 0, False, 0, 0, 0)
                self._issue([header], "sending close", min(self.timeout, 10.0))
                self.flush()
            except RefitError as exc:
                logger.warning("closing the %s transport: receivers were not told (%s)", self.name, exc)
        self._closed = True


# ----------------------------------------------------------------------------- CUDA IPC


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
    same GPU node.

    Args:
        data_queue: sender -> receiver messages.
        ack_queue: receiver -> sender acknowledgements.
        role: ``"sender"`` or ``"receiver"``.
        timeout: default deadline of every wait, seconds.
        device: CUDA device for received copies (default: the current device).
        max_in_flight: unacknowledged buckets the sender allows (>= 1).
    """

    name = "cuda_ipc"
    ROLES = ("sender", "receiver")

    def __init__(
        self,
        data_queue: Any,
        ack_queue: Any,
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
        self._unacked: collections.OrderedDict[int, tuple[torch.Tensor, str]] = collections.OrderedDict()
        self._seq = 0

    @staticmethod
    def make_queues() -> tuple[Any, Any]:
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

    def _wait_ack(self, deadline: float) -> None:
        seq, (_, what) = next(iter(self._unacked.items()))
        try:
            got = self._ack.get(timeout=max(deadline - time.monotonic(), 1e-3))
        except queue.Empty:
            raise TransportTimeoutError(
                f"cuda_ipc: the receiver process did not acknowledge {what} within {self.timeout:.3g}s; "
                "it died or stalled (the engine keeps its last good version)"
            ) from None
        ack_seq, error = got
        if error:
            raise RefitError(f"cuda_ipc: the receiver failed to open {what}: {error}")
        if ack_seq != seq:
            raise RefitError(f"cuda_ipc: acknowledgement out of order (expected message {seq}, got {ack_seq})")
        self._unacked.popitem(last=False)

    def send(self, bucket: Bucket, *, timeout: float | None = None) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

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
            _KIND_BUCKET,
            self._seq,
            bucket.version,
            bucket.index,
            bucket.is_last,
            encode_metas(bucket.metas),
            bucket.checksum,
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
            (_KIND_ABORT, 0, version, index, False, reason.encode("utf-8"), 0, None, None),
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

    def recv(self, timeout: float | None = None) -> Bucket:
        self._require("receiver", "recv")
        self._check_open()
        wait = self.timeout if timeout is None else timeout
        try:
            kind, seq, version, index, is_last, meta, checksum, rebuild, args = self._data.get(timeout=wait)
        except queue.Empty:
            raise TransportTimeoutError(
                f"cuda_ipc: no bucket arrived from the sender process within {wait:.3g}s"
            ) from None
        if kind == _KIND_CLOSE:
            self._closed = True
            raise TransportClosedError("cuda_ipc: the sender closed the transport")
        if kind == _KIND_ABORT:
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
            self._ack.put((seq, f"{type(exc).__name__}: {exc}"))
            raise RefitError(f"cuda_ipc: could not open bucket {index} of version {version}: {exc}") from exc
        self._ack.put((seq, None))
        self.buckets_received += 1
        return Bucket(
            version=version,
            index=index,
            is_last=bool(is_last),
            metas=decode_metas(meta),
            payload=payload,
            checksum=checksum,
        )

    def close(self) -> None:
        if self._closed:
            return
        if self.role == "sender":
            try:
                self.flush(timeout=min(self.timeout, 10.0))
                self._data.put((_KIND_CLOSE, 0, 0, 0, False, b"", 0, None, None), timeout=min(self.timeout, 10.0))
            except (RefitError, queue.Full) as exc:
                logger.warning("closing the cuda_ipc transport: the receiver was not told (%s)", exc)
        self._closed = True


# ----------------------------------------------------------------------------- registry


def _torch_dist(backend: str) -> Callable[..., Transport]:
    def build(**kwargs: Any) -> Transport:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            actual = str(dist.get_backend(kwargs.get("group"))).lower()
            if actual != backend:
                raise ConfigError(
                    f"transport {backend!r} was asked for, but the refit process group uses {actual!r}; "
                    f"create the group with backend={backend!r} or ask for transport {actual!r}"
                )
        return TorchDistTransport(**kwargs)

    build.__doc__ = f"A :class:`TorchDistTransport` over a {backend} process group."
    return build


FACTORIES: dict[str, Callable[..., Transport]] = {
    "inproc": InProcTransport,
    "gloo": _torch_dist("gloo"),
    "nccl": _torch_dist("nccl"),
    "cuda_ipc": CudaIpcTransport,
}
"""Transport factories by name (the keys of :data:`megatron_fp8.vocab.TRANSPORTS`); keyword arguments go to the class."""


def make_transport(name: str, **kwargs: Any) -> Transport:
    """Build the transport registered as ``name`` in :data:`FACTORIES`.

    Raises:
        ConfigError: unknown name (the message lists the valid names) or a bad option.
    """
    try:
        factory = FACTORIES[name]
    except KeyError:
        raise ConfigError(f"unknown refit transport {name!r}; valid transports: {sorted(FACTORIES)}") from None
    return factory(**kwargs)
