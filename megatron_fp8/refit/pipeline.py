"""One refit, end to end, for a colocated trainer and engine.

:func:`refit_colocated` runs the sender (pack + send) on a thread and the
receiver (validate, stage, commit on an applier) on the caller's thread over an
in-process transport, so that what the trainer sends goes through exactly the
same buckets, checks and two-phase commit as across processes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable

import torch

from megatron_fp8.refit.applier import RefitApplier
from megatron_fp8.refit.receiver import ReceiveReport, RefitReceiver
from megatron_fp8.refit.sender import RefitSender, SendReport
from megatron_fp8.refit.transport.inproc import InProcTransport
from megatron_fp8.refit.wire import RefitVersion


@dataclasses.dataclass(frozen=True)
class RefitResult:
    """One refit: what was sent, what was applied, how long it took.

    Attributes:
        version: the refit version.
        send: the sender's report (payload bytes per class, buckets, seconds).
        receive: the receiver's report.
        seconds: wall time from the first tensor produced (quantization included)
            to the verified commit.
    """

    version: int
    send: SendReport
    receive: ReceiveReport
    seconds: float


class ColocatedRefit:
    """A sender and a receiver joined by an in-process transport, reused across refits.

    Args:
        applier: the engine side (e.g. :class:`~megatron_fp8.rollout.vllm.applier.VllmApplier`).
        bucket_bytes: bucket capacity in bytes (default: sized for the device).
        timeout: seconds any single wait may take before it is an error.
    """

    def __init__(self, applier: RefitApplier, *, bucket_bytes: int | None = None, timeout: float = 120.0):
        self.transport = InProcTransport(timeout=timeout)
        self.sender = RefitSender(self.transport, bucket_bytes=bucket_bytes, timeout=timeout, versions=RefitVersion())
        self.receiver = RefitReceiver(self.transport, apply=applier, timeout=timeout, versions=RefitVersion())
        self.timeout = timeout
        self._next = 0

    def refit(self, stream: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> RefitResult:
        """Send ``stream`` as one version and apply it; raises if anything fails (nothing applied)."""
        self._next = version if version is not None else self._next + 1
        v = self._next
        box: dict[str, object] = {}

        def send() -> None:
            try:
                box["send"] = self.sender.send(stream, version=v)
            except BaseException as exc:  # surfaced on the caller's thread below
                box["error"] = exc

        start = time.perf_counter()
        thread = threading.Thread(target=send, name=f"refit-sender-v{v}", daemon=True)
        thread.start()
        try:
            receive = self.receiver.receive(timeout=self.timeout, first_timeout=self.timeout)
        finally:
            thread.join(self.timeout)
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        seconds = time.perf_counter() - start
        return RefitResult(version=v, send=box["send"], receive=receive, seconds=seconds)  # type: ignore[arg-type]

    def close(self) -> None:
        self.transport.close()
