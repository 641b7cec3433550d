"""One GRPO arm: its engine (or the separate rollout ranks), its trainer, resume, steps, validation, checkpoints.

:func:`run_arm` builds the arm's rollout engine (colocated) or starts it on the rollout ranks
(:class:`~megatron_fp8.rl.cluster.remote.RemoteRollout`), builds the Megatron-Core trainer, resumes from the latest
complete checkpoint of the arm when checkpointing is on (then refits the engine from the restored weights),
and runs the steps (:func:`~megatron_fp8.rl.driver.phases.run_step`), validating every ``grpo.val_period`` steps and
saving every ``checkpointing.save_period`` steps and after the last.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bridge_mappings.manifest import Manifest
from bridge_mappings.quantized_export import ExportSettings
from megatron_fp8.config.schema import RunConfig
from megatron_fp8.config.wiring import megatron_parallel_args, vllm_engine_args, vllm_env
from megatron_fp8.megatron import build_megatron_model, make_optimizer, megatron_parallel
from megatron_fp8.megatron.build import RecomputeSettings
from megatron_fp8.megatron.optim import LossScaleConfig
from megatron_fp8.megatron.reference import ReferenceWeights
from megatron_fp8.rl.algorithm.kv_calibration import KVAmaxRecorder, attach_kv_amax_hooks
from megatron_fp8.rl.cluster.distributed import DataParallel, check_against_megatron
from megatron_fp8.rl.cluster.remote import ArmSetup, RemoteRollout
from megatron_fp8.rl.cluster.roles import Groups
from megatron_fp8.rl.driver.colocated import ColocatedTarget, colocated_memory, refit_route
from megatron_fp8.rl.driver.phases import ArmState, RefitTarget, refit_phase, run_step
from megatron_fp8.rl.driver.runtime import (
    environment,
    phase,
    quiet_stdout,
    trainer_dtype,
    trainer_rounding,
    training_math_label,
)
from megatron_fp8.rl.driver.stopping import RunStopped, StopRequests, signal_point
from megatron_fp8.rl.driver.validation import ValidationResult, validate, validation_due
from megatron_fp8.rl.sampling.context import GRPOContext
from megatron_fp8.rl.sampling.dynamic import CHECKPOINT_KEY as DATA_BATCHES_KEY
from megatron_fp8.rl.state.checkpoint import CheckpointManager
from megatron_fp8.rl.state.results import ArmResult, StepMetrics
from megatron_fp8.rollout.engines import RolloutEngine, build_rollout_engine, resolve_engine_name
from megatron_fp8.vocab import ARMS, ArmSpec

__all__ = ["ArmHooks", "build_engine", "export_settings", "run_arm"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArmHooks:
    """What the driver does around an arm's steps.

    Attributes:
        on_step: called with each step's local metrics and the training labels; returns the metrics averaged
            over data-parallel ranks (the writer appends them to ``metrics.jsonl`` and the loggers).
        on_validation: called with each validation result (the writer records it).
        on_resume: called with ``(arm, first step to run)`` once the arm knows where it resumes (the writer drops
            recorded steps that are redone).
        stop: the run's stop requests (signals, ``checkpoint_must_save_by``), checked after each step and its
            checkpoint; ``None``: never stop early.
    """

    on_step: Callable[..., StepMetrics]
    on_validation: Callable[[ValidationResult], None]
    on_resume: Callable[[str, int], None]
    stop: StopRequests | None = None


def build_engine(setup: ArmSetup, config: RunConfig) -> RolloutEngine:
    """The arm's rollout engine: BF16, or FP8 for exactly the manifest's weights.

    Args:
        setup: the arm, the model folder, vLLM's FP8 manifest and quantization config (FP8 arms).
        config: the run configuration (engine choice and vLLM arguments, unchanged from the config).
    """
    spec = ARMS[setup.arm]
    vllm_cfg = config.policy.generation.vllm_cfg
    engine_name = resolve_engine_name(config.rollout.engine, precision=spec.rollout_precision)
    fp8 = spec.rollout_precision == "fp8"
    args = vllm_engine_args(config, rollout_precision=spec.rollout_precision)
    engine_kwargs: dict[str, object] = {
        "quantization_config": setup.quantization_config if fp8 else None,
        "fp8_names": list(setup.manifest.fp8_params) if fp8 and setup.manifest is not None else None,
        "kv_cache_dtype": args["kv_cache_dtype"],
        "verify": config.refit.verify,
    }
    if engine_name == "reference":
        engine_kwargs["activation_scale_format"] = "ue8m0" if vllm_cfg.pow2_activation_scaling_factors else "fp32"
    else:  # the rest of what the config sets for vLLM, unchanged (megatron_fp8.config.wiring)
        if "max_model_len" in args:
            engine_kwargs["max_model_len"] = args["max_model_len"]
        engine_kwargs["engine_kwargs"] = {k: v for k, v in args.items() if k not in ("kv_cache_dtype", "max_model_len")}
    # vLLM reads its switches (DeepGEMM, ...) from the environment while it builds
    with environment(vllm_env(config, rollout_precision=spec.rollout_precision)), quiet_stdout():
        return build_rollout_engine(engine_name, setup.model_path, **engine_kwargs)


def export_settings(config: RunConfig, engine: RolloutEngine) -> ExportSettings:
    """FP8 weight-scale format and rollout TP size of the refit export.

    ``pow2_weight_scaling_factors`` true / false forces the format; left null, the refit sends what the
    engine holds (UE8M0 where vLLM's DeepGEMM E8M0 path would otherwise requantize fp32 scales, adding
    ~2.5% relative weight error), so no scale is requantized.
    """
    vllm_cfg = config.policy.generation.vllm_cfg
    pow2 = vllm_cfg.pow2_weight_scaling_factors
    scale_format = engine.weight_scale_format() if pow2 is None else ("ue8m0" if pow2 else "fp32")
    return ExportSettings(scale_format=scale_format, tp_size=vllm_cfg.tensor_parallel_size)


def _start_engine(
    setup: ArmSetup, config: RunConfig, *, groups: Groups | None
) -> tuple[RolloutEngine, Callable[[RolloutEngine], RefitTarget]]:
    """The arm's engine and how to build its refit target: colocated, or on the rollout ranks."""
    if groups is not None:
        remote = RemoteRollout.start(setup, config=config, groups=groups)
        return remote, lambda _engine: remote
    engine = build_engine(setup, config)

    def colocated(engine: RolloutEngine) -> RefitTarget:
        return ColocatedTarget(engine, bucket_bytes=config.refit.bucket_size_mb << 20, timeout=config.refit.timeout_s)

    return engine, colocated


def run_arm(
    spec: ArmSpec,
    ctx: GRPOContext,
    *,
    steps: int,
    model_path: Path,
    manifest: Manifest | None,
    qcfg: dict | None,
    dp: DataParallel,
    hooks: ArmHooks,
    checkpoints: CheckpointManager | None = None,
    groups: Groups | None = None,
    resumed_steps: tuple[StepMetrics, ...] = (),
) -> ArmResult:
    """One arm from the initial weights (or its latest checkpoint): engine, trainer, steps; closes both.

    Args:
        spec: the arm.
        ctx: what every step shares (config, problems, reward, tokenizer).
        steps: total steps of the arm (resumed runs do the remaining ones).
        model_path: the initial HF checkpoint (base or warm start).
        manifest: vLLM's FP8 manifest (FP8 arms).
        qcfg: vLLM's quantization config (FP8 arms).
        dp: this rank's data-parallel place (trainer ranks).
        hooks: the driver's per-step and per-validation callbacks.
        checkpoints: the arm's checkpoints (``None``: checkpointing off).
        groups: the process groups of separate rollout ranks (``None``: colocated engine).
        resumed_steps: metrics of the steps a resumed run does not redo (from ``metrics.jsonl``).

    Returns:
        The arm's :class:`ArmResult` (resumed steps included).
    """
    config = ctx.config
    mcfg = config.policy.megatron_cfg
    t_arm = time.perf_counter()
    setup = ArmSetup(arm=spec.name, model_path=str(model_path), manifest=manifest, quantization_config=qcfg)
    # The engine is built before the trainer's process group: an in-process vLLM sets up its own.
    where = "on the rollout ranks" if groups is not None else ""
    with phase(f"arm {spec.name}: building its {spec.rollout_precision.upper()} rollout engine {where}".rstrip()):
        engine, make_target = _start_engine(setup, config, groups=groups)
    bf16_first = mcfg.fp8_cfg.num_first_layers_in_bf16 if spec.fp8_training_recipe else 0
    bf16_last = mcfg.fp8_cfg.num_last_layers_in_bf16 if spec.fp8_training_recipe else 0
    try:
        torch.manual_seed(config.grpo.seed)
        with megatron_parallel(**megatron_parallel_args(config), seed=config.grpo.seed):
            check_against_megatron(dp)
            logger.info(
                "arm %s: trainer layout TP %d x PP %d x DP %d, EP %d; rank %d is pipeline stage %d of data-parallel "
                "replica %d",
                spec.name,
                dp.tensor_parallel_size,
                dp.pipeline_parallel_size,
                dp.dp_size,
                mcfg.expert_model_parallel_size,
                dp.rank,
                dp.pp_rank,
                dp.dp_rank,
            )
            dtype, rounded = trainer_dtype(config.policy.precision), trainer_rounding(config.policy.precision)
            held = f", weights rounded to {rounded}: FP16 emulated" if rounded is not None else ""
            with phase(f"arm {spec.name}: building its Megatron-Core trainer ({dtype}{held})"), quiet_stdout():
                model = build_megatron_model(
                    model_path,
                    recipe=config.training_recipe if spec.fp8_training_recipe else "bf16",
                    num_first_layers_in_bf16=bf16_first,
                    num_last_layers_in_bf16=bf16_last,
                    fp8_format=mcfg.fp8_cfg.fp8 if spec.fp8_training_recipe else None,
                    dtype=dtype,
                    use_distributed_optimizer=mcfg.optimizer.use_distributed_optimizer,
                    recompute=recompute_settings(config),
                    round_to=rounded,
                )
            fp8_kv = spec.rollout_precision == "fp8" and config.policy.generation.vllm_cfg.kv_cache_dtype == "fp8"
            optimizer = make_optimizer(
                model,
                lr=mcfg.optimizer.lr,
                weight_decay=mcfg.optimizer.weight_decay,
                betas=(mcfg.optimizer.adam_beta1, mcfg.optimizer.adam_beta2),
                adam_eps=mcfg.optimizer.adam_eps,
                clip_grad=mcfg.optimizer.clip_grad,
                distributed=mcfg.optimizer.use_distributed_optimizer,
                cpu_offload=mcfg.optimizer.optimizer_cpu_offload,
                cpu_offload_fraction=mcfg.optimizer.optimizer_offload_fraction,
                loss_scale=LossScaleConfig(  # FP16 only (policy.precision: float16); Megatron-Core's field names
                    initial_scale=mcfg.optimizer.initial_loss_scale,
                    min_scale=mcfg.optimizer.min_loss_scale,
                    growth_interval=mcfg.optimizer.loss_scale_window,
                    hysteresis=mcfg.optimizer.hysteresis,
                ),
            )
            # colocated: the engine sleeps while the trainer trains (its applier wrapped before the refit target)
            memory = colocated_memory(engine, model, optimizer, config) if groups is None else None
            state = ArmState(
                spec=spec,
                model=model,
                optimizer=optimizer,
                engine=engine,
                refit=make_target(engine),
                memory=memory,
                manifest=manifest,
                export_settings=export_settings(config, engine),
                dp=dp,
                # FP8 KV cache: q/k/v amax of every training forward -> per-layer scales sent with each refit
                kv_recorder=KVAmaxRecorder() if fp8_kv else None,
                kv_settings=config.kv_cache,
                # the KL penalty's reference: the weights the arm starts from, captured before any resume
                reference=ReferenceWeights.capture(model) if config.loss_fn.kl_enabled else None,
            )
            logger.info(
                "arm %s: refit: %s",
                spec.name,
                refit_route(
                    model,
                    stream_on_device=state.refit.stream_on_device,
                    staging=getattr(state.refit, "staging", "host"),
                ),
            )
            kv_hooks = (
                attach_kv_amax_hooks(model.model[0], state.kv_recorder, kind="megatron")
                if state.kv_recorder is not None
                else None
            )
            try:
                math = training_math_label(model.recipe_application.math, dtype, rounded)
                training = (model.recipe_application.recipe, math)
                first = _resume(state, checkpoints, steps=steps)
                hooks.on_resume(spec.name, first)
                done = tuple(m for m in resumed_steps if m.step < first)
                results = list(done)
                val_metrics: dict[str, float] = {}
                if first == 0 and validation_due(config, completed_steps=0):  # grpo.val_at_start
                    val_metrics = _validate(state, ctx, hooks, completed_steps=0)
                stop = hooks.stop
                if stop is not None:
                    stop.start_loop()
                for step in range(first, steps):
                    t_step = time.monotonic()
                    ahead = config.grpo.async_grpo.ahead > 0 and step + 1 < steps  # the next step's samples now
                    m = hooks.on_step(run_step(state, ctx, step=step, prefetch=ahead), training=training)
                    results.append(m)
                    if validation_due(config, completed_steps=step + 1):
                        val_metrics = _validate(state, ctx, hooks, completed_steps=step + 1)
                    if stop is not None:
                        stop.timed_step(time.monotonic() - t_step)
                    scalars = {k: float(v) for k, v in m.to_json_dict().items() if _is_number(v)} | val_metrics
                    saved = None
                    if checkpoints is not None and checkpoints.should_save(step, last=step == steps - 1):
                        saved = _save(checkpoints, state, step=step, metrics=scalars, stop=stop)
                    reason = stop.agreed_reason() if stop is not None and step < steps - 1 else None
                    if reason is not None:  # every trainer rank agreed: save the step if it is not on disk, stop
                        if checkpoints is not None and saved is None:
                            saved = _save(checkpoints, state, step=step, metrics=scalars, stop=stop)
                        raise RunStopped(
                            f"arm {spec.name} stopped after step {step + 1} of {steps} ({reason})",
                            reason=reason,
                            arm=spec.name,
                            completed_steps=step + 1,
                            total_steps=steps,
                            checkpoint=saved,
                        )
            finally:
                state.refit.close()
                if kv_hooks is not None:
                    kv_hooks.remove()
            recipe = model.recipe_application.recipe
    finally:
        engine.close()
    return ArmResult(
        arm=spec.name,
        engine=results[-1].engine if results else engine.name,
        training_recipe=str(recipe),
        training_math=math,
        steps=tuple(results),
        seconds=time.perf_counter() - t_arm,
    )


def recompute_settings(config: RunConfig) -> RecomputeSettings | None:
    """``policy.megatron_cfg.activation_checkpointing`` (with its granularity and modules) for Megatron-Core."""
    mcfg = config.policy.megatron_cfg
    if not mcfg.activation_checkpointing:
        return None
    return RecomputeSettings(granularity=mcfg.recompute_granularity, modules=mcfg.recompute_modules)


def _save(
    checkpoints: CheckpointManager, state: ArmState, *, step: int, metrics: dict[str, float], stop: StopRequests | None
) -> Path:
    """Save the state after ``step`` (timed for ``checkpoint_must_save_by``); returns the checkpoint folder."""
    t_save = time.monotonic()
    signal_point("save", step)
    if state.memory is not None:  # the optimizer state on its device for the checkpoint (offloaded before the refit)
        state.memory.before_update()
    extra = {DATA_BATCHES_KEY: state.cursor.next_batch}  # dynamic sampling's data position (rounds per step vary)
    path = checkpoints.save(step=step, model=state.model, optimizer=state.optimizer, metrics=metrics, extra=extra)
    if stop is not None:
        stop.timed_save(time.monotonic() - t_save)
    return path


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _resume(state: ArmState, checkpoints: CheckpointManager | None, *, steps: int) -> int:
    """Restore the arm's latest complete checkpoint (model, optimizer, RNG) and refit the engine from it.

    Returns:
        The first step to run (0 without a checkpoint).
    """
    if checkpoints is None:
        return 0
    resumed = checkpoints.load_latest(model=state.model, optimizer=state.optimizer)
    if resumed is None:
        return 0
    first = resumed.step + 1
    # the data batches drawn before (one per step; dynamic sampling: one per generation round)
    state.cursor.next_batch = int(resumed.extra.get(DATA_BATCHES_KEY, first))  # type: ignore[arg-type]
    logger.info(  # step_N folders count from 0 (step_1 holds 2 steps), as the checkpoint format has them
        "arm %s: resumed from step %d (%s: folder names count steps from 0); continuing at step %d",
        state.spec.name,
        first,
        resumed.path,
        first + 1,
    )
    if first < steps:  # the engine still holds the initial weights: send it the restored policy
        with phase(f"arm {state.spec.name}: refit of the restored weights"):
            refit_phase(state)
    else:
        logger.info("arm %s: all %d steps were done before; nothing to run", state.spec.name, steps)
    return first


def _validate(state: ArmState, ctx: GRPOContext, hooks: ArmHooks, *, completed_steps: int) -> dict[str, float]:
    """Run one validation and hand it to the driver; returns the checkpoint-ranking metrics it gives."""
    result = validate(
        state.engine,
        config=ctx.config,
        problems=ctx.problems,
        reward=ctx.reward,
        tokenizer=ctx.tokenizer,
        eos_id=ctx.eos_id,
        dp=state.dp,
        arm=state.spec.name,
        completed_steps=completed_steps,
    )
    hooks.on_validation(result)
    return {"val_accuracy": result.accuracy, "val_reward_mean": result.reward_mean}
