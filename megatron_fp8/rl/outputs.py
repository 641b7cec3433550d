"""The output folder of a GRPO run: claimed before anything is written, never mixed with another run's.

:func:`claim_out_dir` runs before a model is built. It refuses an ``--out`` that is a file, lies under a
file, cannot be written, or already holds another run's outputs (:data:`RUN_OUTPUTS`) unless
``overwrite=True``, in which case those outputs are removed first, so a folder never holds a new
``metrics.jsonl`` beside an old summary or plot. :func:`rebuild_outputs`
rebuilds ``summary.md`` and ``metrics.png`` from ``metrics.jsonl`` (``megatron-fp8 report DIR``, and
the driver after Ctrl-C).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from megatron_fp8.config import load_config
from megatron_fp8.errors import ConfigError, UsageError
from megatron_fp8.rl import report
from megatron_fp8.rl.results import (
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

RUN_OUTPUTS: tuple[str, ...] = (METRICS_FILE, VALIDATION_FILE, SUMMARY_FILE, PLOT_FILE, CONFIG_FILE, WARM_START_DIR)
"""What a run writes into its folder."""


def claim_out_dir(out: str | Path, *, overwrite: bool = False, resume: bool = False) -> Path:
    """Make ``out`` ready for a new run before anything else happens.

    Args:
        out: the output folder (created with its parents when missing).
        overwrite: replace another run's outputs found there (they are deleted first).
        resume: this run continues the one whose outputs are there (from its checkpoints): they are kept.

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
    found = [] if resume else [name for name in RUN_OUTPUTS if (path / name).exists()]
    if found and not overwrite:
        raise UsageError(
            f"--out {path} already holds another run's outputs ({', '.join(found)}); nothing was changed. "
            "Choose another --out, or pass --overwrite to replace them (a run with checkpointing.enabled resumes "
            "from its checkpoints instead)"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise UsageError(f"--out {path} cannot be written ({exc.strerror or exc}); choose a writable folder") from None
    for name in found:
        target = path / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        logger.info("--overwrite: removed %s", target)
    return path


def rebuild_outputs(
    out: str | Path, *, arm_order: Sequence[str] | None = None, partial: str | None = None
) -> tuple[Path, Path, list[ArmResult]]:
    """Rebuild ``summary.md`` and ``metrics.png`` from ``metrics.jsonl`` (and ``config.yaml`` when present).

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
    config = load_config(path / CONFIG_FILE) if (path / CONFIG_FILE).is_file() else None
    summary = report.write_summary(arms, path / SUMMARY_FILE, config=config, partial=partial)
    is_cap = config.loss_fn.is_cap if config is not None else 2.0
    plot = report.plot_metrics(arms, path / PLOT_FILE, is_cap=is_cap, partial=partial)
    return summary, plot, arms
