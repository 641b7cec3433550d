"""Stop a run at a safe point and save first: Slurm's SIGTERM / SIGUSR1, Ctrl-C, ``checkpoint_must_save_by``.

A cluster ends a job with SIGTERM (time limit, ``scancel``, preemption; SIGKILL follows after ``KillWait``) or,
when asked (``sbatch --signal=B:USR1@lead``), warns it with SIGUSR1 first. :class:`StopRequests` turns the first
such signal (and the first Ctrl-C) into a request; the run checks it at its safe points (after a step and the
checkpoint it was due), where every trainer rank agrees (one all-reduce of the request over the trainer world,
so no rank is left inside a collective), the last completed step is checkpointed if it is not on disk yet, and
:class:`RunStopped` ends the run: the driver rebuilds the summary and plot from the completed steps, the CLI
prints one line (what was saved, where, the command that continues) and exits with :data:`EXIT_STOPPED`
(:data:`~megatron_fp8.cli.EXIT_INTERRUPTED` after Ctrl-C). A second signal stops at once: Ctrl-C raises
``KeyboardInterrupt``, SIGTERM / SIGUSR1 get the default action (the process dies with 128 + signal number).

``checkpointing.checkpoint_must_save_by`` (NeMo-RL's key and format, ``DD:HH:MM:SS`` after the training loop
starts) asks for the same stop once the next step plus a save could cross it, judged from the longest step and
the longest save timed so far (before the first save: a save is assumed to take as long as a step).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch

from megatron_fp8.errors import ConfigError, MegatronFP8Error

logger = logging.getLogger(__name__)

EXIT_STOPPED = 75
"""Exit code of a run stopped early at a safe point with its last step saved (EX_TEMPFAIL: run the same command
again to continue). ``slurm/grpo.sbatch`` requeues the job on it. Stopped without checkpointing: exit 1."""

STOP_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT")
"""The signals that ask a run to save and stop (first one) or stop at once (second one)."""

DEADLINE = "checkpoint_must_save_by"
"""The stop reason of :attr:`StopRequests.deadline`."""

_REASONS = ("", *STOP_SIGNALS, DEADLINE)  # index = the code all-reduced between ranks (0 = go on)

FAULT_ENV = "MFP8_SIGNAL_AT"
"""Fault injection for tests (hooks, not sleeps): ``"POINT:SIGNAL[:STEP][@RANK],..."`` makes this process send
itself ``SIGNAL`` when the run reaches ``POINT`` (``rollout``, ``train``, ``refit`` of a step, ``save`` before a
checkpoint is written) of 0-based step ``STEP`` (any step when omitted), on the process whose ``RANK`` environment
variable is ``RANK`` (every process when omitted); each entry fires once."""

_fired: set[str] = set()


def signal_point(point: str, step: int) -> None:
    """Fire the :data:`FAULT_ENV` entries for ``point`` of ``step`` (a no-op unless the variable is set)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    for entry in spec.split(","):
        entry, _, rank = entry.strip().partition("@")
        where, _, rest = entry.partition(":")
        name, _, at = rest.partition(":")
        if where != point or entry in _fired or (at and int(at) != step):
            continue
        if rank and rank != os.environ.get("RANK", "0"):
            continue
        _fired.add(entry)
        logger.warning("%s: sending %s at %s of step %d", FAULT_ENV, name, point, step)
        os.kill(os.getpid(), getattr(signal, name))


class RunStopped(MegatronFP8Error):
    """The run stopped early at a safe point (a signal or ``checkpoint_must_save_by``).

    Attributes:
        reason: a :data:`STOP_SIGNALS` name or :data:`DEADLINE`.
        arm: the arm that was running.
        completed_steps: steps of that arm done and recorded.
        total_steps: steps the arm runs in all.
        checkpoint: the checkpoint holding the last completed step (``None``: checkpointing off).
        out_dir: the run's output folder (set by the driver as the stop passes it; ``None`` before).
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        arm: str,
        completed_steps: int,
        total_steps: int,
        checkpoint: Path | None,
        out_dir: Path | None = None,
    ):
        super().__init__(message)
        self.reason = reason
        self.arm = arm
        self.completed_steps = completed_steps
        self.total_steps = total_steps
        self.checkpoint = checkpoint
        self.out_dir = out_dir


def parse_duration(text: str) -> float:
    """NeMo-RL's ``DD:HH:MM:SS`` (fewer fields allowed: ``HH:MM:SS``, ``MM:SS``, ``SS``) -> seconds.

    Raises:
        ConfigError: not 1-4 non-negative integer fields, naming the key.
    """
    parts = str(text).strip().split(":")
    if not 1 <= len(parts) <= 4 or not all(p.isdigit() for p in parts):
        raise ConfigError(
            f"checkpointing.checkpoint_must_save_by={text!r}: expected DD:HH:MM:SS (e.g. 00:03:30:00 for 3.5 hours "
            "after the training loop starts)"
        )
    seconds = 0
    for value, unit in zip(reversed([int(p) for p in parts]), (1, 60, 3600, 86400), strict=False):
        seconds += value * unit
    return float(seconds)


@dataclass
class _Timing:
    longest_step: float = 0.0
    longest_save: float | None = None


def _late_usr1(signum: int, frame: FrameType | None) -> None:
    logger.warning("SIGUSR1 outside the GRPO step loop (before it starts or after its last step): nothing to save")


def tolerate_usr1_outside_steps() -> None:
    """Make SIGUSR1 harmless while no :class:`StopRequests` holds it (the process's setup and its exit).

    Slurm's "time limit near" warning (``--signal=B:USR1@lead``, passed on to every rank by ``grpo.sbatch``) can
    reach a rank that already finished its last step and is writing its outputs; the default action would kill it
    (exit 138) and fail a completed run. Inside the step loop :class:`StopRequests` installs its own handler and
    restores this one after. Only where SIGUSR1 has its default action, in the main thread (``nohup``-ignored
    signals stay ignored).
    """
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(usr1) is signal.SIG_DFL:
        signal.signal(usr1, _late_usr1)


class StopRequests:
    """The run's stop requests: signal handlers for its duration, and the deadline (a context manager).

    Handlers are installed only in the main thread (Python delivers signals there), and not for a signal the
    process was started with ignored (``nohup``, a background shell's SIGINT); elsewhere the run can still stop for
    its deadline or :meth:`request`.

    Args:
        must_save_by: ``checkpointing.checkpoint_must_save_by`` (``None``: no deadline).
    """

    def __init__(self, must_save_by: str | None = None):
        self.budget = parse_duration(must_save_by) if must_save_by else None
        self.requested: str | None = None
        self._start: float | None = None
        self._timing = _Timing()
        self._previous: dict[int, object] = {}

    # ------------------------------------------------------------------ signals

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                num = getattr(signal, name)
                if signal.getsignal(num) is not signal.SIG_IGN:
                    self._previous[num] = signal.signal(num, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for num, previous in self._previous.items():
            signal.signal(num, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:  # a second signal: stop now
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            logger.warning("%s again: stopping now, without saving", name)
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.request(name)

    def request(self, reason: str) -> None:
        """Ask the run to save and stop at its next safe point (what a first signal does)."""
        if self.requested is None:
            self.requested = reason
            logger.warning(
                "%s: saving after the current step and stopping (send it again to stop at once, without saving)",
                reason,
            )

    # ------------------------------------------------------------------ deadline

    def start_loop(self) -> None:
        """Mark the start of the training loop (the origin of ``checkpoint_must_save_by``); idempotent."""
        if self._start is None:
            self._start = time.monotonic()

    def timed_step(self, seconds: float) -> None:
        """Record how long a step took."""
        self._timing.longest_step = max(self._timing.longest_step, seconds)

    def timed_save(self, seconds: float) -> None:
        """Record how long a checkpoint save took."""
        self._timing.longest_save = max(self._timing.longest_save or 0.0, seconds)

    def deadline_near(self) -> bool:
        """Whether the next step plus a save could end after ``checkpoint_must_save_by``."""
        if self.budget is None or self._start is None:
            return False
        save = self._timing.longest_save if self._timing.longest_save is not None else self._timing.longest_step
        return time.monotonic() - self._start + self._timing.longest_step + save > self.budget

    # ------------------------------------------------------------------ the decision

    def local_reason(self) -> str | None:
        """This rank's reason to stop now (a signal first, then the deadline), ``None`` to go on."""
        if self.requested is not None:
            return self.requested
        return DEADLINE if self.deadline_near() else None

    def agreed_reason(self) -> str | None:
        """The reason to stop that every trainer rank agrees on (any rank's request stops all), ``None`` to go on.

        Collective over the default process group when one is initialized: every trainer rank calls it at the
        same safe point.
        """
        local = self.local_reason()
        code = _REASONS.index(local) if local is not None else 0
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([code], dtype=torch.int64)
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        return _REASONS[code] or None


def next_command(argv: Sequence[str], stopped: RunStopped) -> list[str]:
    """The ``grpo`` arguments that go on after ``stopped``, run as printed: ``argv`` with ``--out`` naming the run's
    folder when it was chosen for the run (a rerun without it would open a new one); when a checkpoint holds the last
    step, without ``--overwrite`` (it would remove that checkpoint and start over), else (checkpointing off) with it:
    the partial outputs are replaced and the run starts over, with ``checkpointing.enabled=true`` after a deadline
    (the same deadline would stop the same step again)."""
    args = [a for a in argv if a != "--overwrite"] if stopped.checkpoint is not None else list(argv)
    given = any(a == "--out" or a.startswith("--out=") for a in args)
    if not given and stopped.out_dir is not None:
        args += ["--out", str(stopped.out_dir)]
    if stopped.checkpoint is None and "--overwrite" not in args:
        args.append("--overwrite")
    if stopped.checkpoint is None and stopped.reason == DEADLINE:  # the same deadline would stop the same step again
        args = [a for a in args if not a.lstrip("+").startswith("checkpointing.enabled=")]  # (=false): replaced
        args.append("checkpointing.enabled=true")  # save steps
    return args


def stop_message(stopped: RunStopped, *, command: str) -> str:
    """The one line the CLI prints: why, what was saved where, and the command that continues (or starts over).

    Args:
        stopped: the stop.
        command: the command to print, from :func:`next_command`.
    """
    why = {DEADLINE: "checkpointing.checkpoint_must_save_by is near", "SIGINT": "interrupted by Ctrl-C"}.get(
        stopped.reason, stopped.reason
    )
    if stopped.checkpoint is not None:
        saved = f"the last completed step is saved in {stopped.checkpoint} (folder names count steps from 0)"
        verb = "continue with"
    else:
        kept = f"; the completed steps' metrics are in {stopped.out_dir}" if stopped.out_dir is not None else ""
        saved = f"nothing was saved (checkpointing.enabled=false){kept}"
        verb = "start over with (--overwrite replaces this run's outputs; add checkpointing.enabled=true to save steps)"
        if stopped.reason == DEADLINE:  # started over as it was, the run would stop at the same step every time
            verb = (
                "start over with checkpoints on (the same deadline would stop the same step again; saved steps "
                "let the next run go on from them)"
            )
    return (
        f"stopped ({why}) after {stopped.completed_steps} of {stopped.total_steps} steps of arm {stopped.arm}; "
        f"{saved}; {verb}: {command}"
    )
