"""One GRPO step of one arm, as four phases: rollout -> score -> train -> refit.

* the rollout (:mod:`megatron_fp8.rl.sampling.rollout`): this rank's share of the step's problems,
  ``num_generations_per_prompt`` responses each from the arm's engine, with the engine's per-token log-probabilities;
  with ``grpo.use_dynamic_sampling`` as many generation rounds as the step needs (:mod:`megatron_fp8.rl.sampling.dynamic`);
* the scores (:mod:`megatron_fp8.rl.sampling.scores`): verifiable partial-credit rewards and group-normalised
  advantages;
* :func:`train_phase`: the trainer's log-probabilities of the same tokens (no grad, the old
  policy), the mismatch metrics and IS weights, ``grpo.updates_per_step`` PPO updates;
* :func:`refit_phase`: the updated weights to the engine (FP8 + block scales for the manifest's
  weights on the FP8 arms, plus FP8 KV-cache scales when recorded), verified two-phase commit.

:func:`run_step` runs them in order and returns the step's :class:`~megatron_fp8.rl.state.results.StepMetrics`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from bridge_mappings.manifest import Manifest
from bridge_mappings.quantized_export import ExportSettings
from megatron_fp8.config.schema import KVCacheConfig, RunConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron import MegatronModel, StepOptimizer, sequence_logprobs, train_step
from megatron_fp8.megatron.microbatch import BatchLayout, TokenTally
from megatron_fp8.megatron.reference import ReferenceWeights
from megatron_fp8.megatron.schedule import from_last_stage
from megatron_fp8.rl.algorithm.batch import make_batch, pad_to_length
from megatron_fp8.rl.algorithm.correction import ISResult, PPOStats, loss_units, ppo_loss, token_weighted
from megatron_fp8.rl.algorithm.kl import per_token_kl
from megatron_fp8.rl.algorithm.kv_calibration import KVAmaxRecorder
from megatron_fp8.rl.algorithm.metrics import METRIC_KEYS, mismatch_metrics
from megatron_fp8.rl.cluster.distributed import DataParallel, longest_over_replicas, mean_over_replicas
from megatron_fp8.rl.driver.colocated import PhaseMemory, refit_stream
from megatron_fp8.rl.driver.stopping import signal_point
from megatron_fp8.rl.driver.train_settings import (
    batch_layouts,
    correction_weights,
    kl_settings,
    learning_rate_at,
    ratio_inputs,
    update_rows,
)
from megatron_fp8.rl.sampling.context import GRPOContext
from megatron_fp8.rl.sampling.dynamic import DataCursor, DynamicSamplingStats, dynamic_sampling_phase
from megatron_fp8.rl.sampling.rollout import RolloutOutcome, prefetch_phase, rollout_phase
from megatron_fp8.rl.sampling.scores import Scores, score_phase
from megatron_fp8.rl.state.results import RefitDone, StepMetrics, finite_mean
from megatron_fp8.rollout.engines import RolloutEngine
from megatron_fp8.vocab import ArmSpec


class RefitTarget(Protocol):
    """Where an arm's refits go: its colocated engine (:class:`~megatron_fp8.rl.driver.colocated.ColocatedTarget`)
    or separate rollout ranks (:class:`megatron_fp8.rl.cluster.remote.RemoteRollout`)."""

    @property
    def stream_on_device(self) -> bool:
        """Whether the target takes the refit stream on the trainer's device (a GPU trainer then exports and
        quantizes there); ``False``: it wants host tensors (the export copies each weight to the host)."""
        ...

    def refit(self, stream: Iterable[tuple[str, torch.Tensor]]) -> RefitDone:
        """Send one version; return when every engine committed it (raises when one refused)."""
        ...

    def close(self) -> None:
        """Release the transport."""
        ...


class Optimizer(StepOptimizer, Protocol):
    """:func:`megatron_fp8.megatron.make_optimizer`'s optimizer, with the parameter groups the step sets the lr of."""

    @property
    def param_groups(self) -> list[dict[str, object]]:
        """Parameter groups; each has an ``"lr"`` entry the step sets."""
        ...


@dataclass(frozen=True)
class ArmState:
    """One arm's trainer, engine and refit session, built once per arm.

    Attributes:
        spec: the arm.
        model: the Megatron-Core policy.
        optimizer: its optimizer.
        engine: the arm's rollout engine (or the proxy of separate rollout ranks).
        refit: where the refits go (:class:`~megatron_fp8.rl.driver.colocated.ColocatedTarget` or the remote
            rollout ranks).
        manifest: vLLM's FP8 manifest (``None`` for BF16 arms).
        export_settings: how FP8 weights and scales are produced.
        dp: this process's data-parallel place.
        kv_recorder: q/k/v amax of the training forwards, for FP8 KV-cache scales (``None``: no FP8 KV cache).
        kv_settings: percentile and margin of those scales.
        reference: the reference policy of the KL penalty (``None``: ``loss_fn.reference_policy_kl_penalty`` 0).
        memory: the colocated engine's sleep and the trainer's offload, phase by phase (``None``: neither).
        cursor: the next data batch a dynamic-sampling round draws (``grpo.use_dynamic_sampling``; restored on
            resume).
    """

    spec: ArmSpec
    model: MegatronModel
    optimizer: Optimizer
    engine: RolloutEngine
    refit: RefitTarget
    manifest: Manifest | None
    export_settings: ExportSettings
    dp: DataParallel
    kv_recorder: KVAmaxRecorder | None = None
    kv_settings: KVCacheConfig = KVCacheConfig()
    reference: ReferenceWeights | None = None
    memory: PhaseMemory | None = None
    cursor: DataCursor = field(default_factory=DataCursor)


# ----------------------------------------------------------------------------- train


def reference_logprobs(
    state: ArmState,
    batch_ids: torch.Tensor,
    mask: torch.Tensor,
    config: RunConfig,
    *,
    layout: BatchLayout | None = None,
    tally: TokenTally | None = None,
    pad_id: int = 0,
) -> torch.Tensor:
    """Log-probs of the batch under the reference policy (its weights swapped in; no FP8 KV-scale recording), in the
    scoring passes' micro-batch ``layout``."""
    if state.reference is None:
        raise ConfigError(
            "loss_fn.reference_policy_kl_penalty is set but the arm holds no reference policy (it is captured when "
            "the arm's trainer is built)"
        )
    pause = state.kv_recorder.paused() if state.kv_recorder is not None else contextlib.nullcontext()
    with torch.no_grad(), pause, state.reference.swapped_in(state.model):
        return sequence_logprobs(
            state.model,
            batch_ids,
            temperature=config.policy.generation.temperature,
            attention_mask=mask,
            batch_size=config.policy.logprob_batch_size,
            layout=layout,
            tally=tally,
            pad_id=pad_id,
        )


@dataclass(frozen=True)
class TrainOutcome:
    """The trainer's side of one step.

    Attributes:
        loss: PPO loss, mean over the updates (each before its update).
        grad_norm: gradient norm before clipping, mean over the updates.
        update_successful: every update was applied.
        learning_rate: the learning rate used.
        ppo: :meth:`PPOStats.as_floats` of the last update.
        is_variant: the IS variant whose statistics are in ``mismatch``.
        mismatch: :func:`~megatron_fp8.rl.algorithm.metrics.mismatch_metrics` (with the IS statistics).
        seconds: trainer scoring + updates, seconds.
        tokens: real and computed tokens of every trainer pass of the step on this rank.
    """

    loss: float
    grad_norm: float
    update_successful: bool
    learning_rate: float
    ppo: Mapping[str, float]
    is_variant: str
    mismatch: Mapping[str, float]
    seconds: float
    tokens: TokenTally


def train_phase(state: ArmState, ctx: GRPOContext, out: RolloutOutcome, scores: Scores, *, step: int) -> TrainOutcome:
    """Score the rollout with the trainer (old policy), compare with the engine, run the PPO updates."""
    config, g = ctx.config, ctx.config.grpo
    t0 = time.perf_counter()
    batch = make_batch(out.prompt_ids, out.rollout, ctx.pad_id)
    if state.model.is_moe:  # one shape over the replicas: expert parallelism all-gathers equal token counts, and
        # the router's load-balancing loss sees the same padding at every expert-parallel size
        batch = pad_to_length(batch, longest_over_replicas(batch.input_ids.shape[1], state.dp), ctx.pad_id)
    model_inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    layouts, tokens = batch_layouts(config, moe=state.model.is_moe), TokenTally()
    with torch.no_grad():  # the old policy's scores, in policy.logprob_batch_size rows or the scoring token budget
        logp_old = sequence_logprobs(
            state.model,
            batch.input_ids,
            temperature=config.policy.generation.temperature,
            attention_mask=batch.attention_mask,
            batch_size=config.policy.logprob_batch_size,
            layout=layouts.score,
            tally=tokens,
            pad_id=ctx.pad_id,
        )
    kl = kl_settings(config)
    logp_ref = None
    if kl is not None:
        logp_ref = reference_logprobs(
            state, batch.input_ids, batch.attention_mask, config, layout=layouts.score, tally=tokens, pad_id=ctx.pad_id
        )
    # statistics of the configured variant for every arm; the weights enter the loss where the arm corrects
    # (loss_fn.use_importance_sampling_correction when given: every arm, any rollout precision; else the arm)
    is_result, weights = correction_weights(config, state.spec.name, logp_old, batch.logp_rollout, batch.response_mask)
    mismatch = mismatch_metrics(
        logp_old,
        batch.logp_rollout,
        batch.response_mask,
        is_result=is_result,
        log_ratio_clamp=config.loss_fn.log_ratio_clamp,
    )

    if state.memory is not None:  # the optimizer state back (offload_optimizer_for_logprob kept it out for scoring)
        state.memory.before_update()
    lr = learning_rate_at(step, config)
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    update_stats: list[PPOStats] = []  # the last update's, one per micro-batch

    aggregation = config.loss_fn.aggregation
    loss_mask = batch.response_mask  # grpo.overlong_filtering: responses cut at the length limit leave the loss
    if g.overlong_filtering:
        loss_mask = loss_mask & torch.tensor(out.rollout.finished, dtype=torch.bool)[:, None]

    def update_loss(update: slice) -> Callable[..., torch.Tensor]:
        """The loss over one update's rows (token mean, or sequence mean of token means); a micro-batch (``rows``
        within them), or this replica's rows of a data-parallel update, returns its share: its own mean times its
        fraction of the update's tokens (sequences), counted over every replica."""
        # NeMo-RL's normalization: the whole update's count over every replica (DDP then means the gradients)
        units = torch.tensor(mean_over_replicas(float(loss_units(loss_mask[update], aggregation)), state.dp))
        units = units.clamp(min=1.0)
        update_stats.clear()

        def loss_fn(logp_new: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
            part = update if rows is None else rows + update.start
            penalty = None
            if kl is not None and logp_ref is not None:
                penalty = kl.coef * per_token_kl(
                    logp_new, logp_ref[part], kl, mask=loss_mask[part], logp_rollout=batch.logp_rollout[part]
                )
            old, is_w = ratio_inputs(
                config,
                state.spec.name,
                logp_new,
                logp_old[part],
                batch.logp_rollout[part],
                loss_mask[part],
                weights.weights[part] if isinstance(weights, ISResult) else None,
            )
            loss, stats = ppo_loss(
                logp_new,
                old,
                scores.advantages[part],
                loss_mask[part],
                clip_low=config.loss_fn.ratio_clip_min,
                clip_high=config.loss_fn.ratio_clip_max,
                is_weights=is_w,
                aggregation=aggregation,
                log_ratio_clamp=config.loss_fn.log_ratio_clamp,
                penalty=penalty,
                dual_clip=config.loss_fn.ratio_clip_c,
            )
            update_stats.append(stats)
            if rows is None and state.dp.dp_size == 1:
                return loss
            return loss * (loss_units(loss_mask[part], aggregation) / units)

        return loss_fn

    losses, norms, ok = [], [], True
    for _ in range(g.updates_per_step):
        for update in update_rows(batch.input_ids.shape[0], config, state.dp):
            result = train_step(
                state.model,
                state.optimizer,
                update_loss(update),
                {k: v[update] for k, v in model_inputs.items()},
                temperature=config.policy.generation.temperature,
                micro_batch_size=config.policy.train_micro_batch_size,
                layout=layouts.train,
                tally=tokens,
                pad_id=ctx.pad_id,
                empty_unused_memory_level=config.policy.megatron_cfg.empty_unused_memory_level,
            )
            losses.append(result.loss)
            norms.append(result.grad_norm)
            ok = ok and result.update_successful
    return TrainOutcome(
        loss=finite_mean(losses),
        grad_norm=finite_mean(norms),
        update_successful=ok,
        learning_rate=lr,
        ppo=from_last_stage(token_weighted(update_stats) if update_stats else None),  # the loss runs there
        is_variant=is_result.variant,
        mismatch=mismatch,
        seconds=time.perf_counter() - t0,
        tokens=tokens,
    )


# ----------------------------------------------------------------------------- refit


def refit_phase(state: ArmState) -> RefitDone:
    """Send the trainer's weights to the arm's engine(s) through the verified refit."""
    return state.refit.refit(refit_stream(state))


# ----------------------------------------------------------------------------- the step


def run_step(state: ArmState, ctx: GRPOContext, *, step: int, prefetch: bool = False) -> StepMetrics:
    """Rollout -> score -> train -> refit for one step of one arm; this rank's metrics. With ``prefetch``
    (``grpo.async_grpo``) the next step's samples are asked for right after this step's arrive, so the separate
    rollout ranks generate them while this step scores and trains (they come one version behind)."""
    t_step = time.perf_counter()
    memory = state.memory  # colocated: generate -> sleep -> train -> wake_up(weights) -> refit -> wake_up(kv_cache)
    signal_point("rollout", step)
    if memory is not None:
        memory.before_generation()
    g = ctx.config.grpo
    dynamic: DynamicSamplingStats | None = None
    if g.use_dynamic_sampling:  # rounds until the step has its samples with varying group rewards
        out, scores, dynamic = dynamic_sampling_phase(state, ctx, cursor=state.cursor, step=step)
    else:
        out = rollout_phase(state, ctx, batch=step, count=g.num_prompts_per_step)
        state.cursor.next_batch = step + 1  # one data batch per step
    if memory is not None:
        memory.after_generation()
    if prefetch:
        prefetch_phase(state, ctx, batch=step + 1, count=g.num_prompts_per_step)
    if dynamic is None:
        scores = score_phase(out, ctx)
    signal_point("train", step)
    train = train_phase(state, ctx, out, scores, step=step)
    signal_point("refit", step)
    if memory is not None:
        memory.after_train()
    refit = memory.refit(lambda: refit_phase(state)) if memory is not None else refit_phase(state)
    rewards, token_ids = scores.rewards, out.rollout.token_ids
    best = int(torch.argmax(rewards))
    return StepMetrics(
        arm=state.spec.name,
        step=step,
        engine=out.rollout.engine,
        reward_mean=float(rewards.mean()) if dynamic is None else dynamic.reward_mean,
        reward_std=float(rewards.std(unbiased=False)),
        reward_max=float(rewards.max()),
        exact_match=sum(s.exact for s in scores.breakdowns) / len(scores.breakdowns)
        if dynamic is None
        else dynamic.exact_match,
        response_tokens_mean=sum(len(t) for t in token_ids) / len(token_ids),
        loss=train.loss,
        grad_norm=train.grad_norm,
        update_successful=train.update_successful,
        learning_rate=train.learning_rate,
        ppo_clip_fraction=train.ppo["clip_fraction"],
        ppo_approx_kl=train.ppo["approx_kl"],
        is_applied=ctx.config.loss_fn.arm_corrects(state.spec.name),
        is_variant=train.is_variant,
        is_weight_mean=train.mismatch["is_weight_mean"],
        is_truncated_fraction=train.mismatch["is_truncated_fraction"],
        is_masked_fraction=train.mismatch["is_masked_fraction"],
        mismatch={k: train.mismatch[k] for k in METRIC_KEYS},
        refit_bytes=refit.payload_bytes,
        refit_seconds=refit.seconds,
        refit_version=refit.version,
        refit_max_rel_error=refit.max_rel_error,
        refit_prefix_cache=refit.prefix_cache,
        rollout_seconds=out.seconds,
        rollout_age_steps=out.age,
        rollout_busy_seconds=out.busy_seconds,
        rollout_wait_seconds=out.wait_seconds,
        rollout_prompts_per_rank=(out.generated_samples,),
        rollout_tokens_per_s_per_rank=(out.generated_tokens / out.seconds if out.seconds > 0 else 0.0,),
        refit_host_staged_bytes_per_rank=(refit.host_staged_bytes,),
        refit_device_staged_bytes_per_rank=(refit.device_staged_bytes,),
        reward_mean_per_rank=(float(rewards.float().mean()),),
        refit_bytes_per_rank=(int(sum(refit.payload_bytes.values())),),
        refit_seconds_per_rank=(refit.seconds,),
        trainer_tokens_real_per_rank=(train.tokens.real,),
        trainer_tokens_computed_per_rank=(train.tokens.computed,),
        train_seconds=train.seconds,
        step_seconds=time.perf_counter() - t_step,
        sample=f"{out.problems[best].prompt}{scores.texts[best]!r} (answer {out.problems[best].answer})",
        reward_errors=sum(1 for s in scores.breakdowns if s.error is not None),
        kl_penalty=train.ppo.get("kl_penalty", 0.0),
        **_dynamic_metrics(dynamic, rewards),
    )


def _dynamic_metrics(dynamic: DynamicSamplingStats | None, trained: torch.Tensor) -> dict[str, float | int]:
    """NeMo-RL's dynamic-sampling metrics of the step (none without it)."""
    if dynamic is None:
        return {}
    return {
        "filtered_reward_mean": float(trained.mean()),
        "dynamic_sampling_num_gen_batches": dynamic.rounds,
        "dynamic_sampling_num_discarded_valid_samples": dynamic.discarded,
        "dynamic_sampling_filtered_share": dynamic.filtered_share,
    }
