"""NeMo-RL's ``logger`` section: the step metrics of ``metrics.jsonl`` also go to TensorBoard and W&B (offline).

What is logged: :func:`step_scalars` turns one ``metrics.jsonl`` record
(:meth:`~megatron_fp8.rl.state.results.StepMetrics.to_json_dict`) into tagged scalars, so both backends carry exactly
the numbers the file has:

* numbers as ``float``; ``bool`` as 0/1; nested mappings flattened with ``/``;
* strings (``arm``, ``engine``, ``sample``, ...) and ``None`` dropped;
* non-finite values dropped, never logged as NaN: ``metrics.jsonl`` writes them as ``null``, so a gap in a curve
  is exactly a ``null`` in the file (and W&B's summary is not poisoned by a NaN);
* ``step`` is the x axis (``step=``), not a scalar;
* each tag is ``<group>/<key>``, the group read from :data:`SCALAR_GROUPS` (``train``, ``rollout``, ``refit``,
  ``mismatch``, ``timing``); a key the table does not name goes to ``other/``.

Where it goes: one TensorBoard event folder per arm (``<log_dir>/tensorboard/<arm>``: the arms overlay in the
TensorBoard UI), one offline W&B run per arm (``<log_dir>/wandb/offline-run-*``, named ``<run name>-<arm>``,
grouped by the run name; ``wandb sync`` uploads them later). :func:`build_loggers` builds what the config enables.

Failures: construction errors (a missing package, a log folder that cannot be created) raise
:class:`~megatron_fp8.errors.ConfigError` before training starts. A backend that fails later (a full disk, a dead
W&B service) must not kill a training run: :class:`MultiLogger` logs one warning, closes that backend and goes
on without it (``metrics.jsonl`` still holds every step). The backends themselves raise.

TensorBoard and W&B are optional: each is imported by its class, so this module imports with torch only.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from megatron_fp8.config.schema import LoggerConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.state.results import LOGS_DIR
from megatron_fp8.vocab import MISMATCH_METRICS, PAYLOAD_CLASSES

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter
    from wandb import Run

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
"""Sub-folder of the log folder holding one TensorBoard event folder per arm."""
OTHER_GROUP = "other"
"""Group of a key :data:`SCALAR_GROUPS` does not name."""
VALIDATION_GROUP = "validation"
"""Group of the scalars :meth:`MetricsLogger.log_validation` writes."""

# the mismatch metrics (megatron_fp8.vocab) and the IS statistics StepMetrics carries beside them
_MISMATCH_KEYS = (
    "gen_kl",
    *MISMATCH_METRICS,
    "is_applied",
    "is_weight_mean",
    "is_truncated_fraction",
    "is_masked_fraction",
    "mismatch",  # the nested StepMetrics field, when a record holds it unflattened
)
_GROUP_KEYS: dict[str, tuple[str, ...]] = {
    "train": (
        "loss",
        "grad_norm",
        "update_successful",
        "learning_rate",
        "ppo_clip_fraction",
        "ppo_approx_kl",
        "kl_penalty",
        "trainer_tokens_real_per_rank",
        "trainer_tokens_computed_per_rank",
        "trainer_padding_share",
    ),
    "rollout": (
        "reward_mean",
        "reward_std",
        "reward_max",
        "exact_match",
        "response_tokens_mean",
        "reward_errors",
        "rollout_prompts_per_rank",
        "reward_mean_per_rank",
        "rollout_age_steps",
        "filtered_reward_mean",
        "dynamic_sampling_num_gen_batches",
        "dynamic_sampling_num_discarded_valid_samples",
        "dynamic_sampling_filtered_share",
    ),
    "refit": (
        "refit_version",
        "refit_max_rel_error",
        *(f"refit_{c}_bytes" for c in (*PAYLOAD_CLASSES, "total")),
        "refit_payload_ratio",
        "refit_bytes",  # the nested StepMetrics field, when a record holds it unflattened
        "refit_host_staged_bytes_per_rank",
        "refit_device_staged_bytes_per_rank",
        "refit_bytes_per_rank",
    ),
    "mismatch": _MISMATCH_KEYS,
    "timing": (
        "rollout_seconds",
        "train_seconds",
        "refit_seconds",
        "step_seconds",
        "rollout_tokens_per_s_per_rank",
        "refit_seconds_per_rank",
        "rollout_busy_seconds",
        "rollout_wait_seconds",
        "rollout_overlap_seconds",
    ),
}
SCALAR_GROUPS: Mapping[str, str] = MappingProxyType({k: g for g, keys in _GROUP_KEYS.items() for k in keys})
"""Record key -> TensorBoard / W&B group: the ``train/...`` of a tag. A nested key (``refit_bytes/fp8``) takes
its own entry when there is one, else its top-level key's."""
PER_RANK_SUFFIX = "_per_rank"
"""A record key ending so holds one number per trainer rank; each is a scalar ``<key>/<rank>`` (other lists are not
scalars)."""
AXIS_KEYS: frozenset[str] = frozenset({"step"})
"""Record keys that are the x axis, not scalars."""


def _as_scalar(value: object) -> float | None:
    """``value`` as a finite float (``bool`` -> 0/1), ``None`` when it is not a finite number."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        x = float(value)
        return x if math.isfinite(x) else None
    return None


def _flatten(record: Mapping[str, object], prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in record.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, prefix=f"{path}/")
        elif isinstance(value, (list, tuple)) and path.endswith(PER_RANK_SUFFIX):  # one per rank: ``<key>/<rank>``
            for i, item in enumerate(value):
                yield f"{path}/{i}", item
        else:
            yield path, value


def _group(path: str) -> str:
    top = path.split("/", 1)[0]
    return SCALAR_GROUPS.get(path) or SCALAR_GROUPS.get(top) or OTHER_GROUP


def step_scalars(record: Mapping[str, object]) -> dict[str, float]:
    """The scalars of one ``metrics.jsonl`` record, tagged ``<group>/<key>`` (rules in the module docstring).

    Args:
        record: a :meth:`~megatron_fp8.rl.state.results.StepMetrics.to_json_dict` record (plus the driver's extras).

    Returns:
        tag -> finite value, in record order.
    """
    out: dict[str, float] = {}
    for path, value in _flatten(record):
        x = None if path in AXIS_KEYS else _as_scalar(value)
        if x is not None:
            out[f"{_group(path)}/{path}"] = x
    return out


def validation_scalars(accuracy: float, extra: Mapping[str, float] | None = None) -> dict[str, float]:
    """``validation/accuracy`` and ``validation/<key>`` for each finite value of ``extra``.

    Args:
        accuracy: validation accuracy, in [0, 1].
        extra: further validation numbers (e.g. ``reward_mean``).
    """
    values = {"accuracy": accuracy, **(extra or {})}
    return {f"{VALIDATION_GROUP}/{k}": x for k, v in values.items() if (x := _as_scalar(v)) is not None}


class MetricsLogger(Protocol):
    """Where step metrics go besides ``metrics.jsonl``. Only the writer rank holds a real one."""

    def log(self, scalars: Mapping[str, float], *, step: int, arm: str) -> None:
        """Record ``scalars`` (tag -> value, e.g. :func:`step_scalars`) at 0-based ``step`` of ``arm``."""
        ...

    def log_validation(self, accuracy: float, *, step: int, arm: str, extra: Mapping[str, float] | None = None) -> None:
        """Record a validation result (:func:`validation_scalars`) at ``step`` of ``arm``."""
        ...

    def close(self) -> None:
        """Flush and release everything (files, the W&B service process); safe to call twice."""
        ...


class NullLogger:
    """Logs nothing: non-writer ranks, or both backends disabled."""

    def log(self, scalars: Mapping[str, float], *, step: int, arm: str) -> None:
        """Do nothing."""

    def log_validation(self, accuracy: float, *, step: int, arm: str, extra: Mapping[str, float] | None = None) -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""


def _make_dir(path: Path) -> Path:
    """Create ``path`` (and parents) and check it is writable.

    Raises:
        ConfigError: it cannot be created or written (the message names ``logger.log_dir``).
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"logger.log_dir: cannot create {path} ({exc}); set logger.log_dir to a writable folder"
        ) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"logger.log_dir: {path} is not writable; set logger.log_dir to a writable folder")
    return path


def _check_arm(arm: str) -> str:
    if not arm or arm in (".", "..") or Path(arm).name != arm:
        raise ValueError(f"arm name {arm!r} cannot name a log folder")
    return arm


class TensorBoardLogger:
    """TensorBoard event files, one folder per arm: ``<log_dir>/tensorboard/<arm>``.

    Values are stored as TensorBoard's classic ``simple_value`` (float32: byte counts above 2**24 are rounded;
    ``metrics.jsonl`` and W&B keep them exact). Every call is flushed, like ``metrics.jsonl``.

    Resuming: a writer opened for an arm on a resumed run first writes TensorBoard's purge marker, which hides
    that folder's points at or after the marker's step (what a crashed run logged past its checkpoint):

    * ``resume_step=N``: every arm this run logs continues after step ``N``: purge from ``N + 1``;
    * ``resume_step={arm: N, ...}``: the arms named continue after their ``N``; any other arm this run logs
      starts over: purge from step 0;
    * ``None``: a fresh run, nothing purged.

    An arm this run never logs keeps its folder untouched.

    Args:
        log_dir: the log folder (``logger.log_dir``).
        resume_step: last completed step of a resumed run, per arm or for all (see above).

    Raises:
        ConfigError: TensorBoard is not installed, or the folder cannot be created.
    """

    def __init__(self, log_dir: Path, *, resume_step: int | Mapping[str, int] | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is optional (logger section)
        except ImportError as exc:
            raise ConfigError(
                f"logger.tensorboard_enabled: TensorBoard cannot be imported ({exc}): pip install tensorboard, "
                "or set logger.tensorboard_enabled: false"
            ) from exc
        self._writer_type = SummaryWriter
        self.root = _make_dir(Path(log_dir) / TENSORBOARD_DIR)
        self._resume_step = resume_step
        self._writers: dict[str, SummaryWriter] = {}
        self._closed = False
        logger.info("TensorBoard: tensorboard --logdir %s", self.root)

    def _purge_step(self, arm: str) -> int | None:
        if self._resume_step is None:
            return None
        if isinstance(self._resume_step, Mapping):
            last = self._resume_step.get(arm)
            return 0 if last is None else int(last) + 1
        return int(self._resume_step) + 1

    def _writer(self, arm: str) -> SummaryWriter:
        if self._closed:
            raise RuntimeError("TensorBoardLogger is closed")
        writer = self._writers.get(arm)
        if writer is None:
            purge = self._purge_step(arm)
            writer = self._writer_type(log_dir=str(self.root / _check_arm(arm)), purge_step=purge)
            self._writers[arm] = writer
            if purge is not None:
                logger.info("TensorBoard arm %s: points from step %d on hidden (resumed run)", arm, purge)
        return writer

    def log(self, scalars: Mapping[str, float], *, step: int, arm: str) -> None:
        """Write each scalar at ``step`` into ``arm``'s event folder, then flush."""
        writer = self._writer(arm)
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, global_step=step)
        writer.flush()

    def log_validation(self, accuracy: float, *, step: int, arm: str, extra: Mapping[str, float] | None = None) -> None:
        """Write :func:`validation_scalars` at ``step``."""
        self.log(validation_scalars(accuracy, extra), step=step, arm=arm)

    def close(self) -> None:
        """Flush and close every arm's writer."""
        self._closed = True
        writers, self._writers = list(self._writers.values()), {}
        for writer in writers:
            writer.close()


class WandbLogger:
    """Offline W&B runs, one per arm: ``<log_dir>/wandb/offline-run-*``; ``wandb sync`` uploads them later.

    Offline is forced (``WANDB_MODE`` and ``wandb login`` do not matter: no key, no prompt, no network); W&B
    prints nothing and does not capture the console; system metrics and machine-info probes (cloud metadata
    requests) are off. Each run is named ``<run_name>-<arm>``, grouped by ``run_name``, tagged with the arm, and
    holds ``run_config`` as its config. A resumed run starts new W&B runs (same names and group).

    The W&B service process starts here (so a broken install fails before training) and ends in
    :meth:`close`, which tears down the process's W&B state: keep one ``WandbLogger`` per process.

    Args:
        log_dir: the log folder (``logger.log_dir``).
        project: W&B project (``logger.wandb.project``).
        run_name: run name (``logger.wandb.name``, else the output folder's name).
        run_config: the run configuration, stored with each W&B run.

    Raises:
        ConfigError: W&B is not installed, its service cannot start, or the folder cannot be created.
    """

    def __init__(self, log_dir: Path, *, project: str, run_name: str, run_config: Mapping[str, object]) -> None:
        try:
            import wandb  # lazy: wandb is optional (logger section) and slow to import
        except ImportError as exc:
            raise ConfigError(
                f"logger.wandb_enabled: W&B cannot be imported ({exc}): pip install wandb, "
                "or set logger.wandb_enabled: false"
            ) from exc
        self._wandb = wandb
        self.root = _make_dir(Path(log_dir))
        self.project = project
        self.run_name = run_name
        self._config = dict(run_config)
        self._settings = wandb.Settings(
            mode="offline",
            silent=True,
            console="off",
            x_disable_stats=True,
            x_disable_machine_info=True,
        )
        try:
            wandb.setup(settings=self._settings)
        except Exception as exc:  # wandb raises its own types (UsageError, ServiceStartProcessError, ...)
            raise ConfigError(
                f"logger.wandb_enabled: W&B could not start offline ({type(exc).__name__}: {exc}); "
                "fix the W&B install or set logger.wandb_enabled: false"
            ) from exc
        self._runs: dict[str, Run] = {}
        self._closed = False
        logger.info("W&B offline runs in %s; upload them with: wandb sync %s", self.root / "wandb", self.root / "wandb")

    def _run(self, arm: str) -> Run:
        if self._closed:
            raise RuntimeError("WandbLogger is closed")
        run = self._runs.get(arm)
        if run is None:
            run = self._wandb.init(
                project=self.project,
                name=f"{self.run_name}-{arm}",
                group=self.run_name,
                tags=[arm],
                config=self._config,
                dir=str(self.root),
                mode="offline",
                reinit="create_new",
                settings=self._settings,
            )
            self._runs[arm] = run
        return run

    def log(self, scalars: Mapping[str, float], *, step: int, arm: str) -> None:
        """Append ``scalars`` to ``arm``'s run at ``step`` (W&B's ``_step``; a step below the last is dropped)."""
        self._run(arm).log(dict(scalars), step=step)

    def log_validation(self, accuracy: float, *, step: int, arm: str, extra: Mapping[str, float] | None = None) -> None:
        """Append :func:`validation_scalars` at ``step``."""
        self.log(validation_scalars(accuracy, extra), step=step, arm=arm)

    def close(self) -> None:
        """Finish every arm's run, then stop the W&B service process."""
        if self._closed:
            return
        self._closed = True
        runs, self._runs = list(self._runs.values()), {}
        try:
            for run in runs:
                run.finish()
        finally:
            self._wandb.teardown()


class MultiLogger:
    """Fan-out to several backends; a backend that raises is warned about once, closed, and dropped.

    Args:
        loggers: the backends, in call order.
    """

    def __init__(self, loggers: Sequence[MetricsLogger]) -> None:
        self.loggers: list[MetricsLogger] = list(loggers)

    def _drop(self, backend: MetricsLogger, what: str, exc: Exception) -> None:
        self.loggers.remove(backend)
        logger.warning(
            "%s failed to %s (%s: %s): disabled for the rest of the run (metrics.jsonl still has every step)",
            type(backend).__name__,
            what,
            type(exc).__name__,
            exc,
        )
        try:
            backend.close()
        except Exception as close_exc:  # already failing: its close may fail too
            logger.debug("closing %s after its failure: %s", type(backend).__name__, close_exc)

    def log(self, scalars: Mapping[str, float], *, step: int, arm: str) -> None:
        """Every live backend's :meth:`MetricsLogger.log`."""
        for backend in list(self.loggers):
            try:
                backend.log(scalars, step=step, arm=arm)
            except Exception as exc:  # a logging backend must not stop training
                self._drop(backend, f"log step {step} of arm {arm}", exc)

    def log_validation(self, accuracy: float, *, step: int, arm: str, extra: Mapping[str, float] | None = None) -> None:
        """Every live backend's :meth:`MetricsLogger.log_validation`."""
        for backend in list(self.loggers):
            try:
                backend.log_validation(accuracy, step=step, arm=arm, extra=extra)
            except Exception as exc:  # a logging backend must not stop training
                self._drop(backend, f"log validation at step {step} of arm {arm}", exc)

    def close(self) -> None:
        """Close every backend (a failing close is a warning; the others still close)."""
        backends, self.loggers = self.loggers, []
        for backend in backends:
            try:
                backend.close()
            except Exception as exc:  # a logging backend must not turn a finished run into a failure
                logger.warning("%s failed to close (%s: %s)", type(backend).__name__, type(exc).__name__, exc)


def build_loggers(
    cfg: LoggerConfig,
    *,
    out_dir: Path,
    run_config: Mapping[str, object],
    is_writer: bool,
    resume_step: int | Mapping[str, int] | None = None,
) -> MetricsLogger:
    """The backends ``logger`` enables, behind one :class:`MultiLogger`; a :class:`NullLogger` when none is.

    Args:
        cfg: the ``logger`` section.
        out_dir: the run's output folder (the log folder defaults to ``<out_dir>/logs``; the W&B run name to
            its name).
        run_config: the run configuration as a plain dict, stored with each W&B run.
        is_writer: this rank writes the run's files (other ranks get a :class:`NullLogger`).
        resume_step: last completed step of a resumed run, for all arms or per arm (:class:`TensorBoardLogger`).

    Raises:
        ConfigError: an enabled backend is not installed or the log folder cannot be created (before
            training starts; a backend already built is closed first).
    """
    if not is_writer or not (cfg.tensorboard_enabled or cfg.wandb_enabled):
        return NullLogger()
    log_dir = Path(cfg.log_dir) if cfg.log_dir is not None else Path(out_dir) / LOGS_DIR
    backends: list[MetricsLogger] = []
    try:
        if cfg.tensorboard_enabled:
            backends.append(TensorBoardLogger(log_dir, resume_step=resume_step))
        if cfg.wandb_enabled:
            name = cfg.wandb.name or Path(out_dir).resolve().name
            backends.append(WandbLogger(log_dir, project=cfg.wandb.project, run_name=name, run_config=run_config))
    except BaseException:
        MultiLogger(backends).close()
        raise
    return MultiLogger(backends)
