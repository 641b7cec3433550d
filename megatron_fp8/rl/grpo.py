"""The GRPO driver: BF16 vs FP8 vs FP8+TIS rollout on one model, one seed, one task.

:func:`run_grpo` runs each arm of ``config.grpo.arms`` (:data:`megatron_fp8.vocab.ARMS`) from the same
initial weights, the same prompts and the same sampling seeds. One step of one arm:

1. sample ``num_prompts_per_step`` problems of the toy task (:mod:`megatron_fp8.rl.task`),
   the same for every arm;
2. roll out ``num_generations_per_prompt`` responses per prompt with the arm's engine
   (:mod:`megatron_fp8.rollout.engines`; BF16 or FP8 weights) and keep the engine's per-token
   log-probabilities ``logp_rollout``;
3. score the responses (verifiable partial-credit reward) and normalise within each
   group: ``A = (r - mean_group) / (std_group + 1e-6)``;
4. score the same tokens with the Megatron-Core trainer (no grad): ``logp_train_old``;
   log :func:`~megatron_fp8.rl.metrics.mismatch_metrics` between the two;
5. importance weights: none for ``bf16`` and ``fp8``; ``loss_fn.is_variant`` (token TIS,
   C = ``loss_fn.is_cap``) for ``fp8_tis``; the token-TIS statistics are logged for every
   arm (``is_applied`` says whether they entered the loss);
6. ``grpo.updates_per_step`` optimizer steps on the PPO clipped loss
   (:func:`~megatron_fp8.rl.correction.ppo_loss`, old policy = ``logp_train_old``);
7. refit: the trainer's HF-named weights (Megatron-Bridge export) go to the engine, for the
   FP8 arms quantized to FP8 + 128x128 block scales exactly for the weights in vLLM's FP8
   manifest (asked of vLLM once per run, before the arms), through the bucketed refit
   pipeline with a verified two-phase commit. The payload bytes (fp8 / scales / bf16) and
   the time are logged.

Every step appends one JSON line per arm to ``metrics.jsonl``; at the end
``summary.md`` and ``metrics.png`` are written (:mod:`megatron_fp8.rl.report`).

This module is the driver (arguments -> arms -> outputs); the pieces live beside it:
:mod:`~megatron_fp8.rl.phases` (steps 1-7 as rollout / score / train / refit phases),
:mod:`~megatron_fp8.rl.batch` (token batches, advantages), :mod:`~megatron_fp8.rl.results`
(metrics and result types, file names), :mod:`~megatron_fp8.rl.distributed` (data-parallel
ranks), :mod:`~megatron_fp8.rl.fp8_rollout` (quantization config and manifest) and
:mod:`~megatron_fp8.rl.warm_start`.

On CPU machines all arms default to the reference engine (an emulator of vLLM's FP8
numerics, BF16 for the ``bf16`` arm) and the FP8 *training* recipe is validated and
recorded while the training math runs in BF16 (see :mod:`megatron_fp8.megatron.build`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from bridge_mappings.manifest import Manifest
from bridge_mappings.quantized_export import ExportSettings
from megatron_fp8.config.schema import RunConfig
from megatron_fp8.config.wiring import vllm_engine_args, vllm_env
from megatron_fp8.errors import ConfigError
from megatron_fp8.files import write_atomically
from megatron_fp8.megatron import build_megatron_model, make_optimizer, megatron_parallel
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.rl import report
from megatron_fp8.rl.batch import Tokenizer, eos_and_pad
from megatron_fp8.rl.distributed import DataParallel, average_over_ranks, data_parallel_from_env, share_from_writer
from megatron_fp8.rl.fp8_rollout import fp8_manifest, rollout_quantization_config
from megatron_fp8.rl.kv_calibration import KVAmaxRecorder, attach_kv_amax_hooks
from megatron_fp8.rl.outputs import claim_out_dir, rebuild_outputs
from megatron_fp8.rl.phases import (
    ArmState,
    GRPOContext,
    quiet_stdout,
    run_step,
    trainer_dtype,
    training_math_label,
)
from megatron_fp8.rl.preflight import preflight
from megatron_fp8.rl.results import (
    CONFIG_FILE,
    METRICS_FILE,
    PLOT_FILE,
    SUMMARY_FILE,
    ArmResult,
    GRPOResult,
    StepMetrics,
)
from megatron_fp8.rl.task import ToyTask, get_task
from megatron_fp8.rl.warm_start import warm_start
from megatron_fp8.rollout.engines import RolloutEngine, build_rollout_engine, resolve_engine_name
from megatron_fp8.vocab import ARMS, ArmSpec

__all__ = ["run_grpo"]

logger = logging.getLogger(__name__)


def run_grpo(
    config: RunConfig,
    *,
    out_dir: str | Path,
    steps: int | None = None,
    arms: Sequence[str] | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> GRPOResult:
    """Run GRPO for each arm and write ``metrics.jsonl``, ``summary.md``, ``metrics.png`` and ``config.yaml``.

    Args:
        config: the run configuration (:func:`megatron_fp8.config.load_config`).
        out_dir: output folder (created); one that holds another run's outputs is refused unless
            ``overwrite`` (:func:`megatron_fp8.rl.outputs.claim_out_dir`).
        steps: steps per arm; ``None`` = ``config.grpo.num_steps``.
        arms: arm names (keys of :data:`megatron_fp8.vocab.ARMS`); ``None`` = ``config.grpo.arms``.
        progress: show a progress bar on stderr.
        overwrite: replace another run's outputs in ``out_dir``.

    Returns:
        The :class:`GRPOResult`.

    Raises:
        ConfigError: any pre-flight problem (:func:`megatron_fp8.rl.preflight.preflight`: arms, steps, task, FP8
            rollout settings, processes, the model, its dimensions vs TP, its tokenizer, a NaN/Inf weight named),
            found before ``out_dir`` is touched; an unusable ``out_dir``.
        KeyboardInterrupt: after the summary and plot were rebuilt from the completed steps.
        ManifestError: vLLM could not be asked for the FP8 manifest.
    """
    t_run = time.perf_counter()
    # every check before any model is built or --out is touched (the same checks as `megatron-fp8 config`)
    logger.info("preflight: checking the config, the model %r and its tokenizer", config.model.name_or_path)
    checked = preflight(config, arms=arms, steps=steps, scan_weights=True)
    config, n_steps, arm_names = checked.config, checked.steps, checked.arms
    task = get_task(config.grpo.task, max_digits=config.grpo.task_max_digits)
    out = Path(out_dir)
    if int(os.environ.get("RANK", "0")) == 0:  # the writer claims the folder before any model is built
        claim_out_dir(out, overwrite=overwrite)
    with data_parallel_from_env() as dp:
        if config.grpo.num_prompts_per_step % dp.world_size:
            raise ConfigError(
                f"grpo.num_prompts_per_step={config.grpo.num_prompts_per_step} is not divisible by the "
                f"{dp.world_size} GRPO processes (WORLD_SIZE); each rank rolls out whole prompt groups"
            )
        try:
            results, manifest_source = _run_arms(
                config,
                dp=dp,
                task=task,
                n_steps=n_steps,
                arm_names=arm_names,
                out=out,
                progress=progress,
                model_path=checked.model_path,
            )
        except KeyboardInterrupt:
            if dp.is_writer and (out / METRICS_FILE).is_file() and (out / METRICS_FILE).stat().st_size:
                rebuild_outputs(out, arm_order=arm_names)
                logger.warning("interrupted: %s, %s rebuilt from the completed steps", SUMMARY_FILE, PLOT_FILE)
            raise
    summary_path = plot_path = None
    if dp.is_writer:
        summary_path = report.write_summary(results, out / SUMMARY_FILE, config=config, manifest_source=manifest_source)
        plot_path = report.plot_metrics(results, out / PLOT_FILE, is_cap=config.loss_fn.is_cap)
    return GRPOResult(
        arms=tuple(results),
        out_dir=out,
        metrics_path=out / METRICS_FILE,
        summary_path=summary_path,
        plot_path=plot_path,
        manifest_source=manifest_source,
        seconds=time.perf_counter() - t_run,
    )


def _run_arms(
    config: RunConfig,
    *,
    dp: DataParallel,
    task: ToyTask,
    n_steps: int,
    arm_names: tuple[str, ...],
    out: Path,
    progress: bool,
    model_path: Path,
) -> tuple[list[ArmResult], str]:
    """Every arm in turn, on this rank; rank 0 writes ``config.yaml`` and ``metrics.jsonl``.

    Returns:
        ``(arm results, how the FP8 manifest was obtained)`` (``""`` without FP8 arms).
    """
    from transformers import AutoTokenizer  # lazy: transformers is optional (not a core dependency)

    if dp.is_writer:
        write_atomically(out / CONFIG_FILE, config.dump_yaml())
    tokenizer: Tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    eos_id, pad_id = eos_and_pad(tokenizer, where=model_path)
    ctx = GRPOContext(config=config, task=task, tokenizer=tokenizer, eos_id=eos_id, pad_id=pad_id)

    results: list[ArmResult] = []
    manifest, qcfg = None, None
    sink_cm = (out / METRICS_FILE).open("w") if dp.is_writer else contextlib.nullcontext(None)
    with (
        _environment(config.policy.megatron_cfg.env_vars),
        sink_cm as sink,
        _progress(progress and dp.is_writer) as bar,
    ):
        if any(ARMS[a].rollout_precision == "fp8" for a in arm_names):
            with _phase("FP8 manifest (asked of vLLM once per setup, then reused)"):
                qcfg = rollout_quantization_config(config, model_path)
                # asked of vLLM once, on rank 0, and shared
                manifest = share_from_writer(fp8_manifest(config, model_path, qcfg) if dp.is_writer else None, dp)
            logger.info("FP8 manifest: %d weights in FP8 (%s)", len(manifest.fp8_params), manifest.source)
        if config.grpo.warm_start_steps > 0:
            # Same architecture and names as the base checkpoint: the manifest above applies unchanged.
            with _phase(f"warm start ({config.grpo.warm_start_steps} supervised steps, shared by the arms)"):
                model_path, _ = warm_start(
                    config, model_path, task=task, tokenizer=tokenizer, out_dir=out, on_step=_bar_callback(bar)
                )
        on_step = _step_recorder(dp, sink=sink, bar=bar, total_steps=n_steps * len(arm_names), n_steps=n_steps)
        for name in arm_names:
            logger.info("GRPO arm %s: %s", name, ARMS[name].description)
            result = _run_arm(
                ARMS[name],
                ctx,
                steps=n_steps,
                model_path=model_path,
                manifest=manifest,
                qcfg=qcfg,
                on_step=on_step,
                dp=dp,
            )
            results.append(result)
            logger.info(
                "GRPO arm %s done in %.0f s: reward %.3f -> %.3f, mean gen_kl %.2e",
                name,
                result.seconds,
                result.first_reward,
                result.last_reward,
                result.mean_gen_kl,
            )
    return results, manifest.source if manifest is not None else ""


def _bar_callback(bar: Progress | None) -> Callable[[int, int, float], None] | None:
    """A warm-start progress task on ``bar`` (``None`` without a bar: the warm start logs its own lines)."""
    if bar is None:
        return None
    task_id: list[TaskID] = []

    def on_step(step: int, total: int, loss: float) -> None:
        if not task_id:
            task_id.append(bar.add_task("warm start", total=total, info=""))
        bar.update(task_id[0], completed=step + 1, info=f"step {step + 1}/{total} NLL {loss:.3f}")

    return on_step


@contextlib.contextmanager
def _phase(what: str) -> Iterator[None]:
    """One INFO line when a phase starts and one with its time when it ends."""
    logger.info("%s ...", what)
    t0 = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what.split(" (")[0], time.perf_counter() - t0)


def _step_recorder(
    dp: DataParallel, *, sink: IO[str] | None, bar: Progress | None, total_steps: int, n_steps: int
) -> Callable[[StepMetrics], StepMetrics]:
    """What happens after every step: average over ranks, append to ``metrics.jsonl``, advance the bar."""
    bar_task: TaskID | None = bar.add_task("GRPO", total=total_steps, info="") if bar is not None else None

    def on_step(local: StepMetrics, *, training: tuple[str, str] = ("n/a", "n/a")) -> StepMetrics:
        m = average_over_ranks(local, dp)
        if sink is not None:  # appended and flushed per step: a crash keeps every completed step
            record = m.to_json_dict() | {"training_recipe": training[0], "training_math": training[1]}
            sink.write(json.dumps(record, sort_keys=False) + "\n")
            sink.flush()
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


def _run_arm(
    spec: ArmSpec,
    ctx: GRPOContext,
    *,
    steps: int,
    model_path: Path,
    manifest: Manifest | None,
    qcfg: dict | None,
    on_step: Callable[..., StepMetrics],
    dp: DataParallel,
) -> ArmResult:
    """One arm from the initial weights: build its engine and trainer, run ``steps`` steps, close both."""
    config = ctx.config
    mcfg = config.policy.megatron_cfg
    t_arm = time.perf_counter()
    # The engine is built before the trainer's process group: an in-process vLLM sets up its own;
    # vLLM reads its switches (DeepGEMM, ...) from the environment while it builds.
    with (
        _phase(f"arm {spec.name}: building its {spec.rollout_precision.upper()} rollout engine"),
        _environment(vllm_env(config, rollout_precision=spec.rollout_precision)),
        quiet_stdout(),
    ):
        engine = _build_engine(spec, config, model_path=model_path, manifest=manifest, qcfg=qcfg)
    bf16_first = mcfg.fp8_cfg.num_first_layers_in_bf16 if spec.fp8_training_recipe else 0
    bf16_last = mcfg.fp8_cfg.num_last_layers_in_bf16 if spec.fp8_training_recipe else 0
    try:
        torch.manual_seed(config.grpo.seed)
        with megatron_parallel(
            tensor_parallel_size=mcfg.tensor_model_parallel_size,
            pipeline_parallel_size=mcfg.pipeline_model_parallel_size,
            seed=config.grpo.seed,
        ):
            dtype = trainer_dtype()
            with _phase(f"arm {spec.name}: building its Megatron-Core trainer ({dtype})"), quiet_stdout():
                model = build_megatron_model(
                    model_path,
                    recipe=config.training_recipe if spec.fp8_training_recipe else "bf16",
                    num_first_layers_in_bf16=bf16_first,
                    num_last_layers_in_bf16=bf16_last,
                    fp8_format=mcfg.fp8_cfg.fp8 if spec.fp8_training_recipe else None,
                    dtype=dtype,
                )
            fp8_kv = spec.rollout_precision == "fp8" and config.policy.generation.vllm_cfg.kv_cache_dtype == "fp8"
            state = ArmState(
                spec=spec,
                model=model,
                optimizer=make_optimizer(model, lr=config.grpo.learning_rate, clip_grad=mcfg.optimizer.clip_grad),
                engine=engine,
                refit=ColocatedRefit(
                    engine.applier, bucket_bytes=config.refit.bucket_size_mb << 20, timeout=config.refit.timeout_s
                ),
                manifest=manifest,
                export_settings=_export_settings(config, engine),
                dp=dp,
                # FP8 KV cache: q/k/v amax of every training forward -> per-layer scales sent with each refit
                kv_recorder=KVAmaxRecorder() if fp8_kv else None,
                kv_settings=config.kv_cache,
            )
            kv_hooks = (
                attach_kv_amax_hooks(model.model[0], state.kv_recorder, kind="megatron")
                if state.kv_recorder is not None
                else None
            )
            try:
                math = training_math_label(model.recipe_application.math, dtype)
                training = (model.recipe_application.recipe, math)
                results = tuple(on_step(run_step(state, ctx, step=step), training=training) for step in range(steps))
            finally:
                state.refit.close()
                if kv_hooks is not None:
                    kv_hooks.remove()
            recipe = model.recipe_application.recipe
    finally:
        engine.close()
    return ArmResult(
        arm=spec.name,
        engine=engine.name,
        training_recipe=str(recipe),
        training_math=math,
        steps=results,
        seconds=time.perf_counter() - t_arm,
    )


def _build_engine(
    spec: ArmSpec, config: RunConfig, *, model_path: Path, manifest: Manifest | None, qcfg: dict | None
) -> RolloutEngine:
    """The arm's rollout engine: BF16, or FP8 for exactly the manifest's weights."""
    vllm_cfg = config.policy.generation.vllm_cfg
    engine_name = resolve_engine_name(config.rollout.engine, precision=spec.rollout_precision)
    fp8 = spec.rollout_precision == "fp8"
    args = vllm_engine_args(config, rollout_precision=spec.rollout_precision)
    engine_kwargs: dict[str, object] = {
        "quantization_config": qcfg if fp8 else None,
        "fp8_names": list(manifest.fp8_params) if fp8 and manifest is not None else None,
        "kv_cache_dtype": args["kv_cache_dtype"],
        "verify": config.refit.verify,
    }
    if engine_name == "reference":
        engine_kwargs["activation_scale_format"] = "ue8m0" if vllm_cfg.pow2_activation_scaling_factors else "fp32"
    else:  # the rest of what the config sets for vLLM, unchanged (megatron_fp8.config.wiring)
        if "max_model_len" in args:
            engine_kwargs["max_model_len"] = args["max_model_len"]
        engine_kwargs["engine_kwargs"] = {k: v for k, v in args.items() if k not in ("kv_cache_dtype", "max_model_len")}
    return build_rollout_engine(engine_name, model_path, **engine_kwargs)


def _export_settings(config: RunConfig, engine: RolloutEngine) -> ExportSettings:
    """FP8 weight-scale format and rollout TP size of the refit export.

    ``pow2_weight_scaling_factors`` true / false forces the format; left null, the refit sends what the
    engine holds (UE8M0 where vLLM's DeepGEMM E8M0 path would otherwise requantize fp32 scales, adding
    ~2.5% relative weight error), so no scale is requantized.
    """
    vllm_cfg = config.policy.generation.vllm_cfg
    pow2 = vllm_cfg.pow2_weight_scaling_factors
    scale_format = engine.weight_scale_format() if pow2 is None else ("ue8m0" if pow2 else "fp32")
    return ExportSettings(scale_format=scale_format, tp_size=vllm_cfg.tensor_parallel_size)


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
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
def _progress(enabled: bool) -> Iterator[Progress | None]:
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
