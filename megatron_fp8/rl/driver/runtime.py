"""What the GRPO driver shows, records and sets around its phases: phase log lines, the progress bar, the per-step
records, the environment.

* :func:`phase` -- one INFO line when a phase starts and one with its time when it ends;
* :func:`progress_bar` -- a rich progress bar on stderr (log lines print above it);
* :func:`bar_callback` -- a warm-start progress task on that bar;
* :func:`environment` -- environment variables set for a block, then restored;
* :func:`step_recorder`, :func:`validation_recorder` -- after each step and validation: ``metrics.jsonl`` (the
  writer's :class:`MetricsSink`, appended and flushed per step), ``validation.jsonl``, the loggers, the bar (every
  trainer rank averages its step metrics over the data-parallel group first);
* :func:`kept_records` -- on resume, the metrics of the steps a run keeps;
* :func:`trainer_dtype`, :func:`training_math_label`, :func:`rollout_dtype_stream` -- the trainer's precision on this
  machine and what the rollout holds of it; :func:`quiet_stdout` -- the Megatron stack's prints hidden.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from megatron_fp8.files import disk_guard, write_atomically
from megatron_fp8.recipes.precision import math_label, rounded_dtype_name, trainer_dtype_name
from megatron_fp8.rl.cluster.distributed import DataParallel, average_over_ranks
from megatron_fp8.rl.driver.validation import ValidationResult
from megatron_fp8.rl.state import report
from megatron_fp8.rl.state.loggers import MetricsLogger, step_scalars
from megatron_fp8.rl.state.outputs import OUT_FULL_FIX
from megatron_fp8.rl.state.results import METRICS_FILE, StepMetrics

__all__ = [
    "MetricsSink",
    "bar_callback",
    "environment",
    "ignore_resume",
    "kept_records",
    "phase",
    "progress_bar",
    "step_recorder",
    "validation_recorder",
]

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


def kept_records(out: Path, resumed: dict[str, object]) -> dict[str, tuple[StepMetrics, ...]]:
    """The metrics of the steps a resumed run keeps (up to each arm's checkpoint); rewrites ``metrics.jsonl``."""
    path = out / METRICS_FILE
    if not path.is_file():
        return {}
    kept_lines: list[str] = []
    kept: dict[str, list[StepMetrics]] = {}
    for number, record in enumerate(report.read_metrics(path), start=1):
        info = resumed.get(str(record.get("arm")))
        last = getattr(info, "step", -1) if info is not None else -1
        step = record.get("step")
        if isinstance(step, int) and step <= last:
            kept.setdefault(str(record["arm"]), []).append(StepMetrics.from_json_dict(record, where=f"{path}:{number}"))
            kept_lines.append(json.dumps(record))
    write_atomically(path, "".join(line + "\n" for line in kept_lines))
    dropped = {a: len(v) for a, v in kept.items()}
    logger.info("resuming: kept the metrics of the checkpointed steps in %s (%s)", path, dropped or "none")
    return {a: tuple(v) for a, v in kept.items()}


class MetricsSink:
    """``metrics.jsonl`` of the writer: one line appended and flushed per step; a resumed arm's lines from the step
    it really resumes at are dropped (a damaged newest checkpoint makes it resume earlier than planned)."""

    def __init__(self, path: Path, *, mode: str):
        self.path = path
        self._file: IO[str] = path.open(mode)

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def append(self, record: dict[str, object]) -> None:
        """Append one step record (flushed: a crash keeps every completed step)."""
        line = json.dumps(record, sort_keys=False) + "\n"
        with disk_guard(self.path, needed=len(line), kept="the lines of the steps before it", fix=OUT_FULL_FIX):
            self._file.write(line)
            self._file.flush()

    def drop_from(self, arm: str, first: int) -> None:
        """Remove ``arm``'s records of steps ``>= first`` (they are about to be redone), if any."""
        records = report.read_metrics(self.path)
        kept = [r for r in records if r.get("arm") != arm or not isinstance(r.get("step"), int) or r["step"] < first]
        if len(kept) == len(records):
            return
        self._file.close()
        write_atomically(self.path, "".join(json.dumps(r, sort_keys=False) + "\n" for r in kept))
        self._file = self.path.open("a")
        logger.info(
            "arm %s: %d metrics record(s) from step %d on dropped (redone)", arm, len(records) - len(kept), first + 1
        )


def ignore_resume(arm: str, first: int) -> None:
    """Ranks that write no metrics have nothing to drop."""


def step_recorder(
    dp: DataParallel,
    *,
    sink: MetricsSink | None,
    bar: Progress | None,
    total_steps: int,
    n_steps: int,
    loggers: MetricsLogger,
) -> Callable[..., StepMetrics]:
    """What happens after every step: average over ranks, append to ``metrics.jsonl`` and the loggers, advance the bar."""
    bar_task: TaskID | None = bar.add_task("GRPO", total=total_steps, info="") if bar is not None else None

    def on_step(local: StepMetrics, *, training: tuple[str, str] = ("n/a", "n/a")) -> StepMetrics:
        m = average_over_ranks(local, dp)
        if sink is not None:  # appended and flushed per step: a crash keeps every completed step
            record = m.to_json_dict() | {"training_recipe": training[0], "training_math": training[1]}
            sink.append(record)
            loggers.log(step_scalars(record), step=m.step, arm=m.arm)
        if m.reward_errors:
            logger.warning("GRPO arm %s step %d: %d reward(s) raised (scored 0)", m.arm, m.step + 1, m.reward_errors)
        log = logger.debug if bar is not None else logger.info  # without a bar: one line per step
        log("GRPO arm %s step %d/%d: reward %.3f gen_kl %.2e", m.arm, m.step + 1, n_steps, m.reward_mean, m.gen_kl)
        if bar is not None and bar_task is not None:
            bar.update(
                bar_task,
                advance=1,
                description=f"GRPO {m.arm}",
                info=f"step {m.step + 1}/{n_steps} reward {m.reward_mean:.3f} gen_kl {m.gen_kl:.1e}",
            )
        return m

    return on_step


def validation_recorder(
    dp: DataParallel, *, sink: IO[str] | None, loggers: MetricsLogger
) -> Callable[[ValidationResult], None]:
    """After every validation: one line in ``validation.jsonl``, the loggers, and the log."""

    def on_validation(result: ValidationResult) -> None:
        logger.info(
            "validation arm %s after %d step(s): accuracy %.3f (%d problems), reward %.3f",
            result.arm,
            result.step,
            result.accuracy,
            result.problems,
            result.reward_mean,
        )
        if sink is not None:
            line = json.dumps(result.to_json_dict()) + "\n"
            with disk_guard(sink.name, needed=len(line), kept="the earlier validations", fix=OUT_FULL_FIX):
                sink.write(line)
                sink.flush()
            loggers.log_validation(
                result.accuracy, step=result.step, arm=result.arm, extra={"reward_mean": result.reward_mean}
            )

    return on_validation


def trainer_dtype(precision: str = "bfloat16") -> torch.dtype:
    """The trainer's parameter / compute dtype: ``policy.precision`` on a GPU, float32 on a CPU machine.

    CPUs without AVX512-BF16 / AMX have no fast BF16 GEMM in torch (on the 2-core CI machine a BF16
    ``[640, 256] x [256, 512]`` matmul takes ~50x the float32 time), and the trainer's GEMMs are most of a
    GRPO step; so on CPU the trainer keeps float32 weights (rounded to FP16 for ``policy.precision: float16``:
    :func:`trainer_rounding`) and the refit sends them as the rollout holds them: BF16, or FP8 quantized
    (:func:`rollout_dtype_stream`), exactly as on a GPU.
    """
    return getattr(torch, trainer_dtype_name(has_gpu=torch.cuda.is_available(), precision=precision))


def trainer_rounding(precision: str = "bfloat16") -> torch.dtype | None:
    """The dtype a float32 CPU trainer rounds its weights to: ``torch.float16`` for ``policy.precision: float16``
    on a CPU (FP16 emulated), else ``None``."""
    name = rounded_dtype_name(has_gpu=torch.cuda.is_available(), precision=precision)
    return getattr(torch, name) if name else None


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Hide what the Megatron stack prints on stdout while it builds a model (its loading bar, parameter counts);
    shown when the root logger is at DEBUG (``-v``)."""
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def training_math_label(math: str, dtype: torch.dtype, rounded: torch.dtype | None = None) -> str:
    """What the trainer's math really was: the recipe's ``math`` (``bf16``, ``bf16-emulated``, ``fp8``) or, with a
    float32 trainer (:func:`trainer_dtype`), ``fp32`` / ``fp32-emulated`` (FP8 recipe validated and recorded), with
    `` (fp16 weights)`` where it rounds them (:func:`trainer_rounding`):
    :func:`megatron_fp8.recipes.precision.math_label`, the label of the run's one precision sentence."""
    return math_label(math, str(dtype), rounded=str(rounded) if rounded is not None else None)


def rollout_dtype_stream(
    stream: Iterable[tuple[str, torch.Tensor]], *, keep: Container[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF weights as the rollout holds them: float32 (a CPU trainer) and FP16 (``policy.precision: float16``)
    weights cast to BF16; others, and the names in ``keep`` (an FP16 trainer's FP8 weights, quantized from its own
    values), as they are."""
    for name, tensor in stream:
        cast = tensor.dtype in (torch.float32, torch.float16) and name not in keep
        yield name, tensor.to(torch.bfloat16) if cast else tensor
