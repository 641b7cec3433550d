"""The run configuration's output and run-state sections (``checkpointing``, ``logger``, ``logging``), re-exported by
:mod:`megatron_fp8.config.schema`, which composes them into :class:`~megatron_fp8.config.schema.RunConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class CheckpointingConfig:
    """``checkpointing`` (NeMo-RL names).

    Attributes:
        enabled: write checkpoints, and resume from the latest complete one in ``checkpoint_dir``.
        checkpoint_dir: the folder (one subfolder per arm, ``step_N`` in each); ``None`` = ``checkpoints/`` inside
            the run's output folder (``--out``), so each run keeps its own and ``--overwrite`` replaces them.
        save_period: save every this many steps (and after the last).
        keep_top_k: checkpoints kept per arm (``None`` = all): the best by ``metric_name``, else the latest;
            the latest is always kept.
        metric_name: a key of the step's metrics (``reward_mean``, ``val_accuracy``, ...) ranking checkpoints
            for ``keep_top_k``; ``None`` = keep the latest.
        higher_is_better: direction of ``metric_name``.
        save_consolidated: also write the policy as a Hugging Face checkpoint (``hf/``, via Megatron-Bridge).
        checkpoint_must_save_by: NeMo-RL's ``DD:HH:MM:SS`` after the training loop starts by which the last
            checkpoint must be on disk (``None`` = no limit): once the next step plus a save could cross it (as
            timed so far), the run saves and stops, as on SIGTERM (:mod:`megatron_fp8.rl.driver.stopping`).
    """

    enabled: bool = False
    checkpoint_dir: str | None = None
    save_period: int = 10
    keep_top_k: int | None = None
    metric_name: str | None = None
    higher_is_better: bool = True
    save_consolidated: bool = False
    checkpoint_must_save_by: str | None = None


@dataclass(frozen=True)
class WandbConfig:
    """``logger.wandb``.

    Attributes:
        project: W&B project.
        name: run name (``None`` = W&B's own).
    """

    project: str = "megatron-fp8"
    name: str | None = None


@dataclass(frozen=True)
class LoggerConfig:
    """``logger`` (NeMo-RL names): where the step metrics go besides ``metrics.jsonl``.

    Attributes:
        log_dir: folder of the TensorBoard / W&B files (``None`` = ``<out_dir>/logs``).
        tensorboard_enabled: write TensorBoard event files.
        wandb_enabled: write a W&B run in offline mode (``wandb sync`` uploads it later).
        wandb: W&B project and run name.
    """

    log_dir: str | None = None
    tensorboard_enabled: bool = False
    wandb_enabled: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(frozen=True)
class LoggingConfig:
    """``logging``.

    Attributes:
        level: Python logging level name.
    """

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
