"""``gloo`` / ``nccl``: a ``torch.distributed`` broadcast of each bucket from the trainer rank to the rollout ranks."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_fp8.errors import (
    ConfigError,
    RefitAbortedError,
    RefitError,
    TransportClosedError,
    TransportTimeoutError,
)
from megatron_fp8.refit.transport.base import DEFAULT_TIMEOUT_S, KIND_ABORT, KIND_BUCKET, KIND_CLOSE, Transport
from megatron_fp8.refit.wire import Bucket, RefitOutcome, bucket_from_wire, encode_bucket_meta
from megatron_fp8.vocab import REFIT_OUTCOMES

if TYPE_CHECKING:
    # not imported at run time: torch builds without distributed support lack these names
    from torch.distributed import ProcessGroup, Work

logger = logging.getLogger(__name__)

_MAGIC = 0x46503852  # "FP8R"
_HEADER_LEN = 9  # magic, kind, version, index, is_last, meta_len, payload_len, checksum, stream_id
_OUTCOME_MAGIC = 0x46503855  # "FP8U"
_OUTCOME_TAG = 0x4F55  # point-to-point tag of outcome records (receiver -> sender)
_OUTCOME_BYTES = 4096  # fixed record: 5 int64 [magic, version, stream_id, status, reason_len] + UTF-8 reason
_OUTCOME_HEAD = 5 * 8
_STATUSES = tuple(REFIT_OUTCOMES)


def _encode_outcome(outcome: RefitOutcome) -> torch.Tensor:
    reason = outcome.reason.encode("utf-8")[: _OUTCOME_BYTES - _OUTCOME_HEAD]
    head = torch.tensor(
        [_OUTCOME_MAGIC, outcome.version, outcome.stream_id, _STATUSES.index(outcome.status), len(reason)],
        dtype=torch.int64,
    )
    record = torch.zeros(_OUTCOME_BYTES, dtype=torch.uint8)
    record[:_OUTCOME_HEAD] = head.view(torch.uint8)
    if reason:
        record[_OUTCOME_HEAD : _OUTCOME_HEAD + len(reason)] = torch.frombuffer(bytearray(reason), dtype=torch.uint8)
    return record


def _decode_outcome(record: torch.Tensor, receiver: str) -> RefitOutcome | None:
    data = record.cpu()
    magic, version, stream_id, status, reason_len = data[:_OUTCOME_HEAD].view(torch.int64).tolist()
    if magic != _OUTCOME_MAGIC or not 0 <= status < len(_STATUSES) or not 0 <= reason_len <= _OUTCOME_BYTES:
        return None
    reason = data[_OUTCOME_HEAD : _OUTCOME_HEAD + reason_len].numpy().tobytes().decode("utf-8", errors="replace")
    return RefitOutcome(version, _STATUSES[status], reason, stream_id=stream_id, receiver=receiver)


@dataclass
class _InFlight:
    """One message the sender issued and has not waited for yet."""

    works: list[Work]
    tensors: tuple[torch.Tensor, ...]  # kept alive until the broadcasts complete
    what: str
    deadline: float  # time.monotonic() instant


class TorchDistTransport(Transport):
    """Broadcast buckets from rank ``src`` to the other ranks of a process group.

    Wire format per message: an int64 header ``[magic, kind, version, index,
    is_last, meta_len, payload_len, checksum, stream_id]``, then the metadata
    (and, on the last bucket, the version trailer) as JSON bytes (``uint8``),
    then the payload (``uint8``); empty parts are skipped. The
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

    Outcomes: each receiver sends one fixed-size record (4 KiB: version,
    stream id, status, reason) point-to-point to ``src`` (tag ``0x4F55``), so an
    outcome never interleaves with the broadcast stream, even when a receiver
    refused mid-version. The sender keeps one receive posted per receiver; a
    record of another version (a late answer) is skipped.

    Args:
        src: global rank of the trainer (the sender), as ``group``'s rank map names it.
        group: process group holding ``src`` and the rollout ranks (default WORLD).
        timeout: default deadline of every wait, seconds. Keep it below the
            process group's own timeout so the transport reports first.
        device: where received buffers live; default CUDA current device for
            NCCL, CPU otherwise.
        max_in_flight: buckets the sender keeps outstanding (>= 1).
    """

    name = "torch_dist"
    fresh_payloads = True  # a fresh ``torch.empty`` per received bucket

    def __init__(
        self,
        *,
        src: int = 0,
        group: ProcessGroup | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        device: torch.device | str | None = None,
        max_in_flight: int = 2,
    ):
        super().__init__(timeout=timeout)
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "TorchDistTransport needs an initialized torch.distributed process group "
                "(call torch.distributed.init_process_group first)"
            )
        if max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.group = group
        self.backend = str(dist.get_backend(group)).lower()
        self.name = self.backend
        self.src = int(src)
        # with a group: this process's rank as the group's rank map names it (a group built over processes that
        # share no default group, megatron_fp8.rl.cluster.roles.identity_group, names its members by their group ranks)
        self.rank = dist.get_global_rank(group, group.rank()) if group is not None else dist.get_rank()
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
        self._prefetch: tuple[Work, torch.Tensor, float] | None = None
        self._broken: str | None = None
        self._outcome_recvs: dict[int, tuple[Work, torch.Tensor]] = {}  # sender: peer -> posted receive
        self._outcome_inbox: list[RefitOutcome] = []  # sender: records not claimed yet
        self._outcome_sends: list[tuple[Work, torch.Tensor]] = []  # receiver: sends kept alive until done

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

    def _wait(self, work: Work, deadline: float, what: str) -> None:
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

    def _broadcast(self, tensor: torch.Tensor) -> Work:
        return dist.broadcast(tensor, src=self.src, group=self.group, async_op=True)

    def _header(
        self,
        kind: int,
        version: int,
        index: int,
        is_last: bool,
        meta_len: int,
        payload_len: int,
        checksum: int,
        stream_id: int = 0,
    ) -> torch.Tensor:
        values = [_MAGIC, kind, version, index, int(is_last), meta_len, payload_len, checksum, stream_id]
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
        meta = encode_bucket_meta(bucket.metas, bucket.trailer)
        payload = bucket.payload if bucket.payload.device == self.device else bucket.payload.to(self.device)
        header = self._header(
            KIND_BUCKET,
            bucket.version,
            bucket.index,
            bucket.is_last,
            len(meta),
            payload.numel(),
            bucket.checksum,
            bucket.stream_id,
        )
        self._issue([header, self._bytes_tensor(meta), payload], f"sending {bucket.describe()}", timeout)
        self.buckets_sent += 1
        self.bytes_sent += bucket.nbytes
        if bucket.is_last:
            self._pump_outcomes()  # receivers answer after the last bucket: have a receive posted for each

    def send_abort(self, version: int, index: int, reason: str, *, timeout: float | None = None) -> None:
        self._require_sender("send an abort")
        self._check_usable()
        text = reason.encode("utf-8")[:65536]
        header = self._header(KIND_ABORT, version, index, False, len(text), 0, 0)
        self._issue([header, self._bytes_tensor(text)], f"sending the abort of version {version}", timeout)
        self.flush(timeout)
        self.aborts_sent += 1

    def flush(self, timeout: float | None = None) -> None:
        while self._in_flight:
            item = self._in_flight.popleft()
            deadline = item.deadline if timeout is None else min(item.deadline, self._deadline(timeout))
            for work in item.works:
                self._wait(work, deadline, item.what)

    def _post_outcome_recv(self, peer: int) -> None:
        record = torch.empty(_OUTCOME_BYTES, dtype=torch.uint8, device=self.device)
        work = dist.irecv(record, src=peer, group=self.group, tag=_OUTCOME_TAG)
        self._outcome_recvs[peer] = (work, record)

    def _take_outcome(self, peer: int) -> None:
        """The posted receive from ``peer`` completed: keep its record (the next one is posted when needed)."""
        _work, record = self._outcome_recvs.pop(peer)
        outcome = _decode_outcome(record, f"rank {peer}")
        if outcome is None:
            logger.warning("%s transport: dropped a malformed outcome record from rank %d", self.name, peer)
        else:
            self._outcome_inbox.append(outcome)
            del self._outcome_inbox[:-64]  # unclaimed answers of earlier versions are dropped, oldest first

    def _pump_outcomes(self) -> None:
        """Keep one outcome receive posted per receiver; collect those that completed. Never raises."""
        for peer in self.peers:
            try:
                if peer in self._outcome_recvs and self._outcome_recvs[peer][0].is_completed():
                    self._outcome_recvs[peer][0].wait()
                    self._take_outcome(peer)
                if peer not in self._outcome_recvs:
                    self._post_outcome_recv(peer)
            except RuntimeError as exc:  # a dead receiver: recv_outcomes reports it
                logger.debug("%s transport: outcome receive from rank %d: %s", self.name, peer, exc)

    def _claim(self, peer: int, version: int, stream_id: int) -> RefitOutcome | None:
        for outcome in self._outcome_inbox:
            if outcome.receiver == f"rank {peer}" and outcome.version == version and outcome.stream_id == stream_id:
                self._outcome_inbox.remove(outcome)
                return outcome
        return None

    def _wait_p2p(self, work: Work, deadline: float) -> None:
        """Wait for a point-to-point operation; raise RuntimeError/TimeoutError like :meth:`_wait` sees them."""
        if self._poll:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError("deadline passed")
                time.sleep(1e-3)
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))

    def recv_outcomes(self, version: int, stream_id: int, *, timeout: float | None = None) -> tuple[RefitOutcome, ...]:
        self._require_sender("collect outcomes")
        self._check_usable()
        deadline = self._deadline(timeout)
        self._pump_outcomes()
        got: dict[int, RefitOutcome] = {}
        for peer in self.peers:
            while (outcome := self._claim(peer, version, stream_id)) is None:
                try:
                    if peer not in self._outcome_recvs:
                        self._post_outcome_recv(peer)
                    self._wait_p2p(self._outcome_recvs[peer][0], deadline)
                except (RuntimeError, TimeoutError) as exc:
                    missing = [p for p in self.peers if p not in got]
                    first = str(exc).splitlines()[0][:200]
                    self._broken = f"waiting for the outcome of refit version {version}: {first}"
                    raise TransportTimeoutError(
                        f"{self.name} transport: receiver rank(s) {missing} sent no outcome for refit version "
                        f"{version} within the {self.timeout if timeout is None else timeout:.3g}s deadline ({first}); "
                        "the receiver died or stalled before (or while) applying it. Check the rollout process; "
                        "re-create the process group to refit again."
                    ) from exc
                self._take_outcome(peer)
            got[peer] = outcome
        return tuple(got[p] for p in self.peers)

    # -- receiver side

    def send_outcome(self, outcome: RefitOutcome, *, timeout: float | None = None) -> None:
        if self.is_sender:
            raise RefitError(f"rank {self.rank} is the sender of this transport; it cannot send an outcome")
        self._outcome_sends = [(w, t) for w, t in self._outcome_sends if not w.is_completed()]
        record = _encode_outcome(dataclasses.replace(outcome, receiver=f"rank {self.rank}")).to(self.device)
        work = dist.isend(record, dst=self.src, group=self.group, tag=_OUTCOME_TAG)
        self._outcome_sends.append((work, record))
        try:
            self._wait_p2p(work, self._deadline(timeout))
        except (RuntimeError, TimeoutError) as exc:
            raise TransportTimeoutError(
                f"{self.name} transport (rank {self.rank}): sender rank {self.src} did not take the outcome of "
                f"refit version {outcome.version} ({outcome.status}) within the deadline; it died or stopped "
                f"waiting ({str(exc).splitlines()[0][:200]})"
            ) from exc

    def _post_header(self) -> tuple[Work, torch.Tensor]:
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
        magic, kind, version, index, is_last, meta_len, payload_len, checksum, stream_id = header.tolist()
        if magic != _MAGIC or kind not in (KIND_BUCKET, KIND_ABORT, KIND_CLOSE) or meta_len < 0 or payload_len < 0:
            self._broken = "corrupt header"
            raise RefitError(
                f"{self.name} transport (rank {self.rank}): corrupt bucket header {header.tolist()} from sender "
                f"rank {self.src}; sender and receiver disagree on the protocol or the stream is out of step"
            )
        if kind == KIND_CLOSE:
            self._closed = True
            raise TransportClosedError(f"sender rank {self.src} closed the {self.name} transport")
        meta = torch.empty(meta_len, dtype=torch.uint8, device=self.device)
        payload = torch.empty(payload_len if kind == KIND_BUCKET else 0, dtype=torch.uint8, device=self.device)
        what = f"receiving bucket {index} of version {version}"
        works = [self._broadcast(t) for t in (meta, payload) if t.numel()]
        for w in works:
            self._wait(w, deadline, what)
        meta_bytes = meta.cpu().numpy().tobytes()
        if kind == KIND_ABORT:
            reason = meta_bytes.decode("utf-8", errors="replace")
            raise RefitAbortedError(
                f"sender rank {self.src} abandoned refit version {version} at bucket {index}: {reason}", version=version
            )
        if not is_last:
            work_next, header_next = self._post_header()
            self._prefetch = (work_next, header_next, time.monotonic())
        self.buckets_received += 1
        return bucket_from_wire(
            version=version,
            index=index,
            is_last=bool(is_last),
            meta=meta_bytes,
            payload=payload,
            checksum=checksum,
            stream_id=stream_id,
            where=f"{self.name} transport",
        )

    def close(self) -> None:
        if self._closed:
            return
        if self.is_sender and self._broken is None:
            try:
                self.flush(timeout=min(self.timeout, 10.0))
                header = self._header(KIND_CLOSE, 0, 0, False, 0, 0, 0)
                self._issue([header], "sending close", min(self.timeout, 10.0))
                self.flush()
            except RefitError as exc:
                logger.warning("closing the %s transport: receivers were not told (%s)", self.name, exc)
        self._closed = True
