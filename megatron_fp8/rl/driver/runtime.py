"""What the GRPO driver shows and sets around its phases: phase log lines, the progress bar, the environment.

* :func:`phase` -- one INFO line when a phase starts and one with its time when it ends;
* :func:`progress_bar` -- a rich progress bar on stderr (log lines print above it);
* :func:`bar_callback` -- a warm-start progress task on that bar;
* :func:`environment` -- environment variables set for a block, then restored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

__all__ = ["bar_callback", "environment", "phase", "progress_bar"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """One INFO line when a phase starts and one with its time when it ends."""
    logger.info("%s ...", what)
    t0 = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what.split(" (")[0], time.perf_counter() - t0)


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``policy.megatron_cfg.env_vars`` for the duration of the run, then restore."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def progress_bar(enabled: bool) -> Iterator[Progress | None]:
    """A rich progress bar on stderr (``None`` when disabled); log lines print above it meanwhile."""
    if not enabled:
        yield None
        return
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=Console(stderr=True),
    )
    with bar:
        # on a terminal the bar redirects sys.stderr: log handlers writing to the real stderr follow it
        handlers = [
            h
            for h in logging.getLogger().handlers
            if type(h) is logging.StreamHandler and h.stream in (sys.__stderr__, sys.stderr)
        ]
        saved = [h.setStream(sys.stderr) for h in handlers]
        try:
            yield bar
        finally:
            for h, stream in zip(handlers, saved, strict=True):
                if stream is not None:
                    h.setStream(stream)


def bar_callback(bar: Progress | None) -> Callable[[int, int, float], None] | None:
    """A warm-start progress task on ``bar`` (``None`` without a bar: the warm start logs its own lines)."""
    if bar is None:
        return None
    task_id: list[TaskID] = []

    def on_step(step: int, total: int, loss: float) -> None:
        if not task_id:
            task_id.append(bar.add_task("warm start", total=total, info=""))
        bar.update(task_id[0], completed=step + 1, info=f"step {step + 1}/{total} NLL {loss:.3f}")

    return on_step
