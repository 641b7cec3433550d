"""The GRPO driver: BF16 vs FP8 vs FP8+TIS rollout on one model, one seed, one task.

:func:`run_grpo` runs each arm of ``config.grpo.arms`` (:data:`megatron_fp8.vocab.ARMS`) from the same
initial weights, the same prompts and the same sampling seeds. One step of one arm:

1. take the step's ``num_prompts_per_step`` problems (:mod:`megatron_fp8.rl.data.problems`: the rows of
   ``data.train`` in a seeded order, or the built-in toy task ``grpo.task``), the same for every arm;
2. roll out ``num_generations_per_prompt`` responses per prompt with the arm's engine
   (:mod:`megatron_fp8.rollout.engines`; BF16 or FP8 weights) and keep the engine's per-token
   log-probabilities ``logp_rollout``;
3. score the responses (:mod:`megatron_fp8.rl.data.rewards`: ``math`` via math-verify, a user's
   ``module:function``, or the task's partial credit) and normalise within each group:
   ``A = (r - mean_group) / (std_group + 1e-6)``;
4. score the same tokens with the Megatron-Core trainer (no grad): ``logp_train_old``;
   log :func:`~megatron_fp8.rl.algorithm.metrics.mismatch_metrics` between the two;
5. importance weights: none for ``bf16`` and ``fp8``; ``loss_fn.is_variant`` (token TIS,
   C = ``loss_fn.is_cap``) for ``fp8_tis``; the token-TIS statistics are logged for every
   arm (``is_applied`` says whether they entered the loss);
6. ``grpo.updates_per_step`` optimizer steps on the PPO clipped loss
   (:func:`~megatron_fp8.rl.algorithm.correction.ppo_loss`, old policy = ``logp_train_old``);
7. refit: the trainer's HF-named weights (Megatron-Bridge export) go to the engine, for the
   FP8 arms quantized to FP8 + 128x128 block scales exactly for the weights in vLLM's FP8
   manifest (asked of vLLM once per run, before the arms), through the bucketed refit
   pipeline with a verified two-phase commit. The payload bytes (fp8 / scales / bf16) and
   the time are logged.

Every step appends one JSON line per arm to ``metrics.jsonl`` (and the same scalars to TensorBoard / W&B
offline, :mod:`megatron_fp8.rl.state.loggers`); validations go to ``validation.jsonl``; at the end ``summary.md``
and ``metrics.png`` are written (:mod:`megatron_fp8.rl.state.report`). With ``checkpointing.enabled`` each arm
saves to ``checkpoint_dir/<arm>/step_N`` (:mod:`megatron_fp8.rl.state.checkpoint`) and a rerun resumes every arm
from its latest complete checkpoint, keeping the metrics of the steps it does not redo.

Placement (:mod:`megatron_fp8.rl.cluster.roles`): colocated by default (every rank trains and rolls out on its
own engine, refit in process); with ``policy.generation.colocated.enabled: false`` (or ``ROLLOUT_TASKS``
in ``slurm/grpo.sbatch``) the last ranks only generate (:func:`megatron_fp8.rl.cluster.remote.serve_rollout`)
and trainer rank 0 sends each refit through ``refit.transport``.

This module is the driver (arguments -> arms -> outputs); the pieces live beside it:
:mod:`~megatron_fp8.rl.driver.arm` (one arm: engine, trainer, resume, steps, validation, checkpoints),
:mod:`~megatron_fp8.rl.driver.phases` (steps 1-7 as rollout / score / train / refit phases),
:mod:`~megatron_fp8.rl.driver.runtime` (phase lines, the bar, ``metrics.jsonl``, ``validation.jsonl``, loggers),
:mod:`~megatron_fp8.rl.algorithm.batch` (token batches, advantages), :mod:`~megatron_fp8.rl.state.results`
(metrics and result types, file names), :mod:`~megatron_fp8.rl.cluster.distributed` (data-parallel
ranks), :mod:`~megatron_fp8.rl.driver.fp8_rollout` (quantization config and manifest) and
:mod:`~megatron_fp8.rl.driver.warm_start`.

On CPU machines all arms default to the reference engine (an emulator of vLLM's FP8
numerics, BF16 for the ``bf16`` arm) and the FP8 *training* recipe is validated and
recorded while the training math runs in float32 (``fp32-emulated``: :mod:`megatron_fp8.recipes.precision`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_fp8.config.schema import RunConfig
from megatron_fp8.errors import ConfigError, DiskFullError, UsageError
from megatron_fp8.files import disk_error_kind, write_atomically
from megatron_fp8.rl.algorithm.batch import Tokenizer, eos_and_pad
from megatron_fp8.rl.cluster.distributed import (
    DataParallel,
    data_parallel_from_env,
    share_from_writer,
    trainer_data_parallel,
)
from megatron_fp8.rl.cluster.remote import serve_rollout
from megatron_fp8.rl.cluster.roles import Groups, Placement, join_groups, placement_from
from megatron_fp8.rl.data.problems import ProblemSource, problem_source
from megatron_fp8.rl.data.rewards import RewardFn, reward_function
from megatron_fp8.rl.data.task import get_task
from megatron_fp8.rl.driver.arm import ArmHooks, build_engine, run_arm
from megatron_fp8.rl.driver.fp8_rollout import fp8_manifest, rollout_quantization_config
from megatron_fp8.rl.driver.preflight import preflight
from megatron_fp8.rl.driver.runtime import (
    MetricsSink,
    bar_callback,
    environment,
    ignore_resume,
    kept_records,
    phase,
    progress_bar,
    step_recorder,
    validation_recorder,
)
from megatron_fp8.rl.driver.stopping import RunStopped, StopRequests
from megatron_fp8.rl.driver.validation import validates
from megatron_fp8.rl.driver.warm_start import warm_start
from megatron_fp8.rl.sampling.context import GRPOContext
from megatron_fp8.rl.state import report
from megatron_fp8.rl.state.checkpoint import CheckpointManager
from megatron_fp8.rl.state.fingerprint import config_fingerprint
from megatron_fp8.rl.state.loggers import MetricsLogger, build_loggers
from megatron_fp8.rl.state.outputs import (
    OUT_DIR_KEY,
    checkpoints_inside,
    claim_checkpoint_dir,
    claim_out_dir,
    new_run_dir,
    rebuild_outputs,
    resumed_run_dir,
)
from megatron_fp8.rl.state.results import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    METRICS_FILE,
    PLOT_FILE,
    SUMMARY_FILE,
    VALIDATION_FILE,
    WARM_START_DIR,
    ArmResult,
    GRPOResult,
    StepMetrics,
)
from megatron_fp8.vocab import ARMS

__all__ = ["run_grpo"]

logger = logging.getLogger(__name__)


def run_grpo(
    config: RunConfig,
    *,
    out_dir: str | Path | None = None,
    steps: int | None = None,
    arms: Sequence[str] | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> GRPOResult:
    """Run GRPO for each arm and write ``metrics.jsonl``, ``summary.md``, ``metrics.png`` and ``config.yaml``.

    Args:
        config: the run configuration (:func:`megatron_fp8.config.load_config`).
        out_dir: output folder (created); one that holds another run's outputs is refused unless
            ``overwrite`` (:func:`megatron_fp8.rl.state.outputs.claim_out_dir`), or unless this run resumes from
            ``checkpointing.checkpoint_dir`` (then its metrics are kept up to each arm's checkpoint). ``None``: the
            folder the resumed checkpoint names, else a new one (:func:`megatron_fp8.rl.state.outputs.new_run_dir`).
        steps: steps per arm; ``None`` = ``config.grpo.max_num_steps``.
        arms: arm names (keys of :data:`megatron_fp8.vocab.ARMS`); ``None`` = ``config.grpo.arms``.
        progress: show a progress bar on stderr.
        overwrite: replace another run's outputs in ``out_dir``, the checkpoints inside it included (the run starts
            over); checkpoints in a ``checkpointing.checkpoint_dir`` outside it are never deleted: refused.

    Returns:
        The :class:`GRPOResult` (on rollout-only ranks: an empty one, the trainer rank 0 writes).

    Raises:
        ConfigError: any pre-flight problem (:func:`megatron_fp8.rl.driver.preflight.preflight`: arms, steps, task, FP8
            rollout settings, processes, the model, its dimensions vs TP, its tokenizer, a NaN/Inf weight named;
            the dataset and the reward; a checkpoint of another config), found before ``out_dir`` is touched;
            an unusable ``out_dir``.
        KeyboardInterrupt: after the summary and plot were rebuilt from the completed steps (every complete
            checkpoint is kept).
        RunStopped: a first SIGTERM / SIGUSR1 / Ctrl-C or ``checkpoint_must_save_by`` stopped the run at a safe
            point, after the last completed step was saved (:mod:`megatron_fp8.rl.driver.stopping`); the summary and plot
            are rebuilt as for ``KeyboardInterrupt``.
        ManifestError: vLLM could not be asked for the FP8 manifest.
    """
    t_run = time.perf_counter()
    # every check before any model is built or --out is touched (the same checks as `megatron-fp8 config`)
    logger.info("preflight: checking the config, the model %r and its tokenizer", config.model.name_or_path)
    placement = placement_from(config)
    checked = preflight(config, arms=arms, steps=steps, scan_weights=True, world_size=len(placement.trainer_ranks))
    config, n_steps, arm_names = checked.config, checked.steps, checked.arms
    out = Path(out_dir) if out_dir is not None else None
    if placement.role == "rollout":
        out = out if out is not None else new_run_dir()
        with join_groups(placement, timeout_s=_link_timeout(config), transport=config.refit.transport) as groups:
            serve_rollout(config, placement, groups, build_engine=lambda setup: build_engine(setup, config))
        return GRPOResult(
            arms=(),
            out_dir=out,
            metrics_path=out / METRICS_FILE,
            summary_path=None,
            plot_path=None,
            manifest_source="",
            seconds=time.perf_counter() - t_run,
        )
    tokenizer = _tokenizer(checked.model_path)
    problems = problem_source(config, tokenizer, log=False)  # the preflight logged what it reads
    task = None if config.data.train.data_path else get_task(config.grpo.task, max_digits=config.grpo.task_max_digits)
    reward = reward_function(config, task)
    if out is None and config.checkpointing.enabled and config.checkpointing.checkpoint_dir is None:
        out = new_run_dir()  # the default checkpoint folder lives in the run's folder: known before resuming
    checkpoints = _checkpoints(config, arm_names, out=out, is_writer=placement.trainer_rank == 0)
    if overwrite:  # start over: the checkpoints in --out go with its outputs; others would be resumed, not replaced
        _refuse_overwrite_outside(checkpoints, out)
    resumed = {arm: None if overwrite else c.latest() for arm, c in checkpoints.items()}
    resuming = any(info is not None for info in resumed.values())
    if out is None:  # no --out / out_dir: a resumed run continues in its checkpoint's folder, else a new one
        out = resumed_run_dir(info for info in resumed.values() if info is not None) if resuming else None
        out = out if out is not None else new_run_dir()
        logger.info(
            "outputs go to %s (no --out given%s)", out, ": the folder of the checkpoint resumed" if resuming else ""
        )
    elif resuming and placement.trainer_rank == 0:
        before = resumed_run_dir(info for info in resumed.values() if info is not None)
        if before is not None and before.resolve() != out.resolve():
            logger.warning(
                "resuming the run of %s into another folder, %s: its earlier steps' metrics stay in %s, the steps "
                "from here on go to %s (rerun with --out %s to keep the run in one folder)",
                before, out, before, out, before,
            )  # fmt: skip
    for manager in checkpoints.values():
        manager.run_extra[OUT_DIR_KEY] = str(out.resolve())
    if placement.trainer_rank == 0:  # the writer claims the folder before any model is built
        root = _checkpoint_root(checkpoints) if checkpoints else None
        claim_out_dir(out, overwrite=overwrite, resume=resuming, checkpoint_dir=root)
        if root is not None and checkpoints_inside(out, root) is None:  # one inside --out: claimed with it
            claim_checkpoint_dir(root)
    kept = kept_records(out, resumed) if resuming else {}
    # signals are handled until the outputs are written: one after the last step lets the run finish normally
    stop = StopRequests(config.checkpointing.checkpoint_must_save_by)
    with stop, _trainer_ranks(placement, config) as (dp, groups):
        if config.grpo.num_prompts_per_step % dp.dp_size or config.grpo.round_prompts % dp.dp_size:
            raise ConfigError(
                f"grpo.num_prompts_per_step={config.grpo.num_prompts_per_step} (a generation round: "
                f"{config.grpo.round_prompts}) is not divisible by the {dp.dp_size} data-parallel model replicas; "
                "each replica rolls out whole prompt groups"
            )
        ctx_parts = _RunParts(
            tokenizer=tokenizer, problems=problems, reward=reward, checkpoints=checkpoints, kept=kept, groups=groups
        )
        loggers = build_loggers(
            config.logger,
            out_dir=out,
            run_config=config.to_dict(),
            is_writer=dp.is_writer,
            # a resumed arm's later points (after its checkpoint) are dropped; an arm without one starts over
            resume_step={arm: info.step for arm, info in resumed.items() if info is not None} if resuming else None,
        )
        try:
            results, manifest_source = _run_arms(
                config,
                dp=dp,
                n_steps=n_steps,
                arm_names=arm_names,
                out=out,
                progress=progress,
                model_path=checked.model_path,
                parts=ctx_parts,
                loggers=loggers,
                resuming=resuming,
                stop=stop,
            )
        except (KeyboardInterrupt, RunStopped) as exc:
            if dp.is_writer and (out / METRICS_FILE).is_file() and (out / METRICS_FILE).stat().st_size:
                why = f"stopped by {exc.reason}" if isinstance(exc, RunStopped) else "interrupted"
                rebuild_outputs(out, arm_order=arm_names, partial=why)
                logger.warning("stopped early: %s, %s rebuilt from the completed steps", SUMMARY_FILE, PLOT_FILE)
            if isinstance(exc, RunStopped):
                exc.out_dir = out  # the advice names the folder: a rerun without --out would start a new one
                if torch.distributed.is_initialized():
                    torch.distributed.barrier()  # every rank stopped at the same point: none exits before the writer
            raise
        except Exception as exc:  # a full disk: what this run kept, and how to rerun (resume, or start over)
            if disk_error_kind(exc, out) is None:
                raise
            raise DiskFullError(f"{exc}; {_rerun_after_full_disk(out, checkpoints)}") from exc
        finally:
            loggers.close()
        summary_path = plot_path = None
        if dp.is_writer:
            summary_path = report.write_summary(
                results, out / SUMMARY_FILE, config=config, manifest_source=manifest_source
            )
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


def _link_timeout(config: RunConfig) -> float:
    """How long a rollout rank waits for the trainer's next request (a whole training step, or the warm start and
    the FP8 manifest before the first arm), seconds: 30 min, or 10 refit timeouts when longer."""
    return max(1800.0, 10 * config.refit.timeout_s)


@dataclass(frozen=True, kw_only=True)
class _RunParts:
    """What the arms of one run share besides the config (built once by :func:`run_grpo`).

    Attributes:
        tokenizer: the model's tokenizer.
        problems: the run's problem source.
        reward: the reward function.
        checkpoints: arm -> its checkpoint manager (empty: checkpointing off).
        kept: arm -> the metrics of the steps a resumed run does not redo.
        groups: the separate rollout ranks' groups (``None``: colocated).
    """

    tokenizer: Tokenizer
    problems: ProblemSource
    reward: RewardFn
    checkpoints: dict[str, CheckpointManager]
    kept: dict[str, tuple[StepMetrics, ...]]
    groups: Groups | None


def _tokenizer(model_path: Path) -> Tokenizer:
    from transformers import AutoTokenizer  # lazy: transformers is optional (not a core dependency)

    return AutoTokenizer.from_pretrained(str(model_path))


def _checkpoints(
    config: RunConfig, arm_names: Sequence[str], *, out: Path | None, is_writer: bool
) -> dict[str, CheckpointManager]:
    """One checkpoint manager per arm (none when checkpointing is off), under ``checkpointing.checkpoint_dir``, else
    ``<out>/checkpoints``."""
    ck = config.checkpointing
    if not ck.enabled:
        return {}
    if ck.checkpoint_dir is None:
        if out is None:  # run_grpo names the folder first
            raise ConfigError("checkpointing.checkpoint_dir is unset and the run has no output folder yet")
        ck = dataclasses.replace(ck, checkpoint_dir=str(out / CHECKPOINTS_DIR))
    fingerprint = config_fingerprint(config)
    return {arm: CheckpointManager(cfg=ck, arm=arm, fingerprint=fingerprint, is_writer=is_writer) for arm in arm_names}


def _refuse_overwrite_outside(checkpoints: dict[str, CheckpointManager], out: Path | None) -> None:
    """``--overwrite`` replaces the run's outputs; checkpoints outside ``out`` it would not remove are refused.

    Raises:
        UsageError: naming the checkpoint folder, what it holds and the two ways on.
    """
    if not checkpoints:
        return
    root = _checkpoint_root(checkpoints)
    if out is not None and checkpoints_inside(out, root) is not None:
        return  # removed with the outputs of --out
    held = [f"{arm} step {done[-1].step + 1}" for arm, m in checkpoints.items() if (done := m.checkpoints())]
    if held:
        where = f"outside --out {out}" if out is not None else "outside the run's folder"
        raise UsageError(
            f"--overwrite: checkpointing.checkpoint_dir={root} holds checkpoints ({', '.join(held)}) {where}, which "
            "--overwrite does not remove; drop --overwrite to continue from them, or remove that folder (or set "
            "checkpointing.checkpoint_dir to another one) to start over"
        )


def _rerun_after_full_disk(out: Path, checkpoints: dict[str, CheckpointManager]) -> str:
    """What a run stopped by a full disk keeps in ``out`` and which rerun works: resume from a checkpoint, or
    ``--overwrite`` (the folder holds this run's outputs, which a plain rerun refuses)."""
    saved = {arm: done[-1] for arm, m in checkpoints.items() if (done := m.checkpoints())}
    steps = sum(1 for r in report.read_metrics(out / METRICS_FILE)) if (out / METRICS_FILE).is_file() else 0
    kept = f"{out} keeps the {steps} completed step record(s) in {METRICS_FILE}"
    if saved:
        where = ", ".join(f"{info.path} (arm {arm}, step {info.step + 1})" for arm, info in saved.items())
        return f"{kept} and the checkpoints {where}; then run the same command again: it resumes from them"
    return f"{kept} and no checkpoint; then rerun with --overwrite (it starts over in {out}) or with another --out"


def _checkpoint_root(checkpoints: dict[str, CheckpointManager]) -> Path:
    """The ``checkpoint_dir`` every arm's folder lies in."""
    return next(iter(checkpoints.values())).arm_dir.parent


@contextlib.contextmanager
def _trainer_ranks(placement: Placement, config: RunConfig) -> Iterator[tuple[DataParallel, Groups | None]]:
    """This trainer rank's data-parallel place, and the rollout ranks' groups when not colocated."""
    mcfg = config.policy.megatron_cfg
    sizes = {
        "tensor_parallel_size": mcfg.tensor_model_parallel_size,
        "pipeline_parallel_size": mcfg.pipeline_model_parallel_size,
    }
    if placement.role == "colocated":
        with data_parallel_from_env() as dp:
            yield dataclasses.replace(dp, **sizes), None
        return
    with join_groups(placement, timeout_s=_link_timeout(config), transport=config.refit.transport) as groups:
        yield dataclasses.replace(trainer_data_parallel(placement), **sizes), groups


def _run_arms(
    config: RunConfig,
    *,
    dp: DataParallel,
    n_steps: int,
    arm_names: tuple[str, ...],
    out: Path,
    progress: bool,
    model_path: Path,
    parts: _RunParts,
    loggers: MetricsLogger,
    resuming: bool,
    stop: StopRequests | None = None,
) -> tuple[list[ArmResult], str]:
    """Every arm in turn, on this rank; rank 0 writes ``config.yaml``, ``metrics.jsonl`` and (when the run validates)
    ``validation.jsonl``.

    Returns:
        ``(arm results, how the FP8 manifest was obtained)`` (``""`` without FP8 arms).
    """
    if dp.is_writer:
        planned = config.grpo.max_num_steps
        note = (  # --steps ends this invocation; the config's step count stays the plan (the LR schedule's length)
            f"# --steps {n_steps}: this run goes to step {n_steps} of each arm; grpo.max_num_steps ({planned}) below "
            "is the plan (the learning-rate schedule's length; a rerun with more --steps resumes)\n"
            if n_steps != planned
            else ""
        )
        write_atomically(out / CONFIG_FILE, note + config.dump_yaml())
    eos_id, pad_id = eos_and_pad(parts.tokenizer, where=model_path)
    ctx = GRPOContext(
        config=config,
        problems=parts.problems,
        reward=parts.reward,
        tokenizer=parts.tokenizer,
        eos_id=eos_id,
        pad_id=pad_id,
    )
    results: list[ArmResult] = []
    manifest, qcfg = None, None
    mode = "a" if resuming else "w"
    sink_cm = MetricsSink(out / METRICS_FILE, mode=mode) if dp.is_writer else contextlib.nullcontext(None)
    val_cm = (out / VALIDATION_FILE).open(mode) if dp.is_writer and validates(config) else contextlib.nullcontext(None)
    with (
        environment(config.policy.megatron_cfg.env_vars),
        sink_cm as sink,
        val_cm as val_sink,
        progress_bar(progress and dp.is_writer) as bar,
    ):
        if any(ARMS[a].rollout_precision == "fp8" for a in arm_names):
            with phase("FP8 manifest (asked of vLLM once per setup, then reused)"):
                qcfg = rollout_quantization_config(config, model_path)
                # asked of vLLM once, on rank 0, and shared
                manifest = share_from_writer(fp8_manifest(config, model_path, qcfg) if dp.is_writer else None, dp)
            logger.info("FP8 manifest: %d weights in FP8 (%s)", len(manifest.fp8_params), manifest.source)
        if config.grpo.warm_start_steps > 0:
            # Same architecture and names as the base checkpoint: the manifest above applies unchanged.
            done = out / WARM_START_DIR / "model.safetensors"
            if resuming and done.is_file():
                logger.info("warm start: reusing %s (resumed run)", done.parent)
                model_path = done.parent
            else:
                with phase(f"warm start ({config.grpo.warm_start_steps} supervised steps, shared by the arms)"):
                    model_path, _ = warm_start(
                        config,
                        model_path,
                        problems=parts.problems,
                        tokenizer=parts.tokenizer,
                        out_dir=out,
                        on_step=bar_callback(bar),
                    )
        total = n_steps * len(arm_names) - sum(len(v) for v in parts.kept.values())
        hooks = ArmHooks(
            on_step=step_recorder(dp, sink=sink, bar=bar, total_steps=total, n_steps=n_steps, loggers=loggers),
            on_validation=validation_recorder(dp, sink=val_sink, loggers=loggers),
            on_resume=sink.drop_from if sink is not None else ignore_resume,
            stop=stop,
        )
        for i, name in enumerate(arm_names):
            reason = stop.agreed_reason() if stop is not None and i > 0 else None
            if reason is not None:  # between arms: the previous arm is complete (and saved after its last step)
                prev = arm_names[i - 1]
                info = parts.checkpoints[prev].latest() if prev in parts.checkpoints else None
                raise RunStopped(
                    f"stopped before arm {name} ({reason})",
                    reason=reason,
                    arm=prev,
                    completed_steps=n_steps,
                    total_steps=n_steps,
                    checkpoint=info.path if info is not None else None,
                )
            logger.info("GRPO arm %s: %s", name, ARMS[name].description)
            result = run_arm(
                ARMS[name],
                ctx,
                steps=n_steps,
                model_path=model_path,
                manifest=manifest,
                qcfg=qcfg,
                dp=dp,
                hooks=hooks,
                checkpoints=parts.checkpoints.get(name),
                groups=parts.groups,
                resumed_steps=parts.kept.get(name, ()),
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
