"""The output folder of a GRPO run: claimed before anything is written, never mixed with another run's.

:func:`claim_out_dir` runs before a model is built. It refuses an ``--out`` that is a file, lies under a
file, cannot be written, or already holds another run's outputs (:data:`RUN_OUTPUTS`) unless
``overwrite=True``, in which case those outputs are removed first, so a folder never holds a new
``metrics.jsonl`` beside an old summary or plot. :func:`rebuild_outputs`
rebuilds ``summary.md`` and ``metrics.png`` from ``metrics.jsonl`` (``megatron-fp8 report DIR``, and
the driver after Ctrl-C). Without ``--out`` or ``out_dir`` a run gets a new folder (:func:`new_run_dir`), and a run
resumed from checkpoints continues in the folder its checkpoint names (:func:`resumed_run_dir`).
:func:`claim_checkpoint_dir` checks a ``checkpointing.checkpoint_dir`` outside it as early.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from megatron_fp8.config import RunConfig, load_config
from megatron_fp8.errors import ConfigError, UsageError
from megatron_fp8.files import unwritable_dir
from megatron_fp8.launch_env import launch_place
from megatron_fp8.rl.state import report
from megatron_fp8.rl.state.results import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    METRICS_FILE,
    PLOT_FILE,
    SUMMARY_FILE,
    VALIDATION_FILE,
    WARM_START_DIR,
    ArmResult,
    arms_from_records,
)

logger = logging.getLogger(__name__)

RUN_OUTPUTS: tuple[str, ...] = (
    METRICS_FILE,
    VALIDATION_FILE,
    SUMMARY_FILE,
    PLOT_FILE,
    CONFIG_FILE,
    WARM_START_DIR,
    CHECKPOINTS_DIR,
)
"""What a run writes into its folder (``checkpoints/``: its checkpoints when ``checkpointing.checkpoint_dir`` is
unset)."""

RUNS_ROOT = Path("out")
"""Where :func:`new_run_dir` puts a run's folder (relative to the working directory)."""

OUT_FULL_FIX = "free space, or give an --out on a larger filesystem"
"""What to do when a run's output folder fills its filesystem (the driver adds how to rerun: resume or start over)."""

OUT_DIR_KEY = "out_dir"
"""The key of ``checkpoint.json``'s ``extra`` that names the run's output folder (absolute)."""


def new_run_dir(env: Mapping[str, str] | None = None, *, root: Path = RUNS_ROOT) -> Path:
    """A new output folder for a run given no ``--out`` / ``out_dir``, the same on every rank.

    ``out/grpo-slurm-<job>.<step>`` under Slurm (a requeued job continues in its folder), ``out/grpo-<run id>``
    under torchrun (its ``TORCHELASTIC_RUN_ID``), else ``out/grpo-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... when taken).

    Raises:
        UsageError: several processes launched without Slurm or torchrun (nothing tells them one common name).
    """
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID", "").strip()
    if job:
        return root / f"grpo-slurm-{job}.{env.get('SLURM_STEP_ID', '').strip() or 'batch'}"
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id != "none":
        return root / f"grpo-{run_id[:16]}"
    if launch_place(env).world_size > 1:
        raise UsageError(
            "several processes (WORLD_SIZE > 1) without Slurm or torchrun have no common run name: give --out (or "
            "out_dir) so that every rank writes to the same folder"
        )
    base = root / f"grpo-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def resumed_run_dir(resumed: Iterable[object]) -> Path | None:
    """The output folder the newest of the checkpoints a run resumes from names (``None``: none names one)."""
    best: tuple[int, str] | None = None
    for info in resumed:
        extra = getattr(info, "extra", None) or {}
        out = extra.get(OUT_DIR_KEY) if isinstance(extra, Mapping) else None
        if isinstance(out, str) and out:
            key = (int(getattr(info, "step", -1)), out)
            best = key if best is None or key > best else best
    return Path(best[1]) if best is not None else None


def checkpoints_inside(out: Path, checkpoint_dir: Path) -> Path | None:
    """``checkpoint_dir`` relative to ``out`` when it lies inside it (the run's own checkpoints), else ``None``."""
    try:
        return checkpoint_dir.resolve().relative_to(out.resolve())
    except ValueError:
        return None


def claim_out_dir(
    out: str | Path, *, overwrite: bool = False, resume: bool = False, checkpoint_dir: Path | None = None
) -> Path:
    """Make ``out`` ready for a new run before anything else happens.

    Args:
        out: the output folder (created with its parents when missing).
        overwrite: replace another run's outputs found there (they are deleted first), the checkpoints inside it
            included.
        resume: this run continues the one whose outputs are there (from its checkpoints): they are kept.
        checkpoint_dir: the run's ``checkpointing.checkpoint_dir``; one inside ``out`` counts as the run's outputs
            (refused without ``overwrite``, removed with it) besides :data:`RUN_OUTPUTS`.

    Returns:
        ``out`` as a :class:`~pathlib.Path`.

    Raises:
        UsageError: ``out`` is a file or lies under one, cannot be created or written, or holds
            another run's outputs and ``overwrite`` is false (the message lists them and the fix).
    """
    path = Path(out)
    for parent in (path, *path.parents):
        if parent.exists() and not parent.is_dir():
            what = "is a file" if parent == path else f"lies under {parent}, which is a file"
            raise UsageError(f"--out {path} {what}; choose a folder, e.g. --out {path.with_suffix('')}_run")
    names = list(RUN_OUTPUTS)
    inside = checkpoints_inside(path, checkpoint_dir) if checkpoint_dir is not None else None
    if inside is not None and inside.parts and str(inside) not in names:
        names.append(str(inside))
    found = [] if resume else [name for name in names if (path / name).exists()]
    if found and not overwrite:
        raise UsageError(
            f"--out {path} already holds another run's outputs ({', '.join(found)}); nothing was changed. "
            "Choose another --out, or pass --overwrite to replace them (a run with checkpointing.enabled resumes "
            "from its checkpoints instead)"
        )
    reason = unwritable_dir(path)
    if reason is not None:
        raise UsageError(f"--out {path} cannot be written ({reason}); choose a writable folder")
    for name in found:
        target = path / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        logger.info("--overwrite: removed %s", target)
    return path


def claim_checkpoint_dir(path: str | Path) -> Path:
    """Make ``checkpointing.checkpoint_dir`` ready before any model is built: created with its parents and written to
    once, so a folder that cannot hold checkpoints is refused now, not after the warm start and the first steps.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ConfigError: it lies under a file, cannot be created or cannot be written (the message names the key).
    """
    folder = Path(path)
    reason = unwritable_dir(folder)
    if reason is not None:
        raise ConfigError(
            f"checkpointing.checkpoint_dir={folder} cannot be written ({reason}); set checkpointing.checkpoint_dir to "
            "a writable folder (or leave it unset: checkpoints/ inside --out)"
        )
    return folder


def rebuild_outputs(
    out: str | Path, *, arm_order: Sequence[str] | None = None, partial: str | None = None
) -> tuple[Path, Path, list[ArmResult]]:
    """Rebuild ``summary.md`` and ``metrics.png`` from ``metrics.jsonl`` (and ``config.yaml`` when present and readable).

    Args:
        out: a run's output folder.
        arm_order: order of the arms in the table (default: first appearance in the file).
        partial: why the run stopped early (said at the top of the summary and in the plot's title).

    Returns:
        ``(summary path, plot path, arm results)``.

    Raises:
        ConfigError: no ``metrics.jsonl`` there, a line that is not JSON, or a record missing a field
            (the message names the file and line).
    """
    path = Path(out)
    records = report.read_metrics(path / METRICS_FILE)
    if not records:
        raise ConfigError(f"{path / METRICS_FILE} holds no step yet; nothing to report")
    arms = arms_from_records(records, arm_order=arm_order, where=str(path / METRICS_FILE))
    config = _run_config(path / CONFIG_FILE)
    manifest = report.manifest_line(path / SUMMARY_FILE)  # the run asked vLLM; the rebuilt summary keeps it
    summary = report.write_summary(arms, path / SUMMARY_FILE, config=config, partial=partial, manifest_source=manifest)
    is_cap = config.loss_fn.is_cap if config is not None else 2.0
    plot = report.plot_metrics(arms, path / PLOT_FILE, is_cap=is_cap, partial=partial)
    return summary, plot, arms


def _run_config(path: Path) -> RunConfig | None:
    """The run's ``config.yaml`` for the summary's settings lines; ``None`` when it is missing or unreadable (a crash or
    a full disk may leave it truncated: the summary is rebuilt from ``metrics.jsonl`` alone, with a warning)."""
    if not path.is_file():
        return None
    try:
        return load_config(path)
    except ConfigError as exc:
        logger.warning("%s is unreadable (%s); the summary is rebuilt without the run's settings", path, exc)
        return None
