"""One refit, end to end, for a colocated trainer and engine.

:func:`refit_colocated` runs the sender (pack + send) on a thread and the
receiver (validate, stage, commit on an applier) on the caller's thread over an
in-process transport, so that what the trainer sends goes through exactly the
same buckets, checks, two-phase commit and outcome report as across processes.

A refusal surfaces as the receiver's own typed error (e.g.
:class:`~megatron_fp8.errors.RefitRolledBackError`, naming the tensor); the
sender's view of it, a :class:`~megatron_fp8.errors.RefitRefusedError`, is
kept in :attr:`ColocatedRefit.last_refusal`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable

import torch

from megatron_fp8.errors import RefitError, RefitRefusedError
from megatron_fp8.refit.applier import RefitApplier
from megatron_fp8.refit.receiver import ReceiveReport, RefitReceiver
from megatron_fp8.refit.sender import RefitSender, SendReport
from megatron_fp8.refit.transport.inproc import InProcTransport
from megatron_fp8.refit.wire import RefitVersion

logger = logging.getLogger(__name__)


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
        queued_buckets: buckets that may wait between sender and receiver (>= 1); with the sender's bucket being
            filled, the one awaiting its read and the receiver's, what a device holds of the refit at once.
    """

    def __init__(
        self,
        applier: RefitApplier,
        *,
        bucket_bytes: int | None = None,
        timeout: float = 120.0,
        queued_buckets: int = 4,
    ):
        self.transport = InProcTransport(maxsize=queued_buckets, timeout=timeout)
        self.sender = RefitSender(self.transport, bucket_bytes=bucket_bytes, timeout=timeout, versions=RefitVersion())
        self.receiver = RefitReceiver(self.transport, apply=applier, timeout=timeout, versions=RefitVersion())
        self.timeout = timeout
        self.last_refusal: RefitRefusedError | None = None
        self._next = 0

    def refit(self, stream: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> RefitResult:
        """Send ``stream`` as one version and apply it.

        Args:
            stream: ``(hf_name, tensor)`` pairs, consumed once on the sender thread.
            version: the refit version (default: one more than the last).

        Returns:
            A :class:`RefitResult`; the sender saw the ``committed`` outcome.

        Raises:
            RefitError: the receiver's error when it refused or rolled back (the sender's
                :class:`RefitRefusedError` is then in :attr:`last_refusal`), else the sender's error.
            NonFiniteError: the stream held NaN/Inf (nothing was sent of that bucket).
        """
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
        self.last_refusal = None
        try:
            receive = self.receiver.receive(timeout=self.timeout, first_timeout=self.timeout)
        except BaseException:
            thread.join(self.timeout)
            sent = box.get("error")
            if isinstance(sent, RefitRefusedError):
                self.last_refusal = sent
            elif thread.is_alive():
                logger.error("refit v%d: the sender thread is still running after the receiver failed", v)
            raise
        thread.join(self.timeout)
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        if "send" not in box:
            raise RefitError(
                f"refit version {v}: the engine committed it, but the sender thread did not see the outcome within "
                f"{self.timeout:.3g}s"
            )
        seconds = time.perf_counter() - start
        return RefitResult(version=v, send=box["send"], receive=receive, seconds=seconds)  # type: ignore[arg-type]

    def close(self) -> None:
        self.transport.close()
