"""What the train phase takes from the run config: the learning rate of a step, the KL penalty, the IS correction
(and whether an arm applies it), the rows of each optimizer update and the micro-batch layouts of its passes (pure
functions of :class:`~megatron_fp8.config.schema.RunConfig`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import MappingProxyType

import torch

from megatron_fp8.config.schema import RunConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron.microbatch import BatchLayout
from megatron_fp8.rl.algorithm.correction import ISConfig, ISResult, compute_is_weights
from megatron_fp8.rl.algorithm.kl import KLSettings
from megatron_fp8.rl.cluster.distributed import DataParallel

logger = logging.getLogger(__name__)


class _Groups:
    """What Megatron-Core's scheduler writes the rate into: one parameter group (read back by :func:`learning_rate_at`)."""

    def __init__(self) -> None:
        self.param_groups: list[dict[str, float]] = [{}]


def learning_rate_at(step: int, config: RunConfig) -> float:
    """The learning rate of GRPO step ``step`` (0-based): Megatron-Core's ``OptimizerParamScheduler`` after ``step``
    ticks, from ``policy.megatron_cfg.scheduler`` and ``optimizer.{lr, min_lr}`` (NeMo-RL ticks it once per step)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # lazy: Megatron-Core is optional

    opt, sched = config.policy.megatron_cfg.optimizer, config.policy.megatron_cfg.scheduler
    warmup = sched.lr_warmup_iters
    decay = sched.lr_decay_iters if sched.lr_decay_iters is not None else config.grpo.max_num_steps
    init = sched.lr_warmup_init if sched.lr_warmup_init is not None else 0.1 * opt.lr
    groups = _Groups()
    scheduler = OptimizerParamScheduler(
        groups,  # type: ignore[arg-type]  # it only reads and writes param_groups
        init_lr=init if warmup > 0 else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(decay, warmup + 1),  # constant: unused, but Megatron-Core asserts warm-up < decay
        lr_decay_style=sched.lr_decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    scheduler.step(step)
    return float(groups.param_groups[0]["lr"])


def kl_settings(config: RunConfig) -> KLSettings | None:
    """The KL penalty of ``loss_fn`` (``None`` when ``reference_policy_kl_penalty`` is 0)."""
    loss = config.loss_fn
    if not loss.kl_enabled:
        return None
    return KLSettings(
        coef=loss.reference_policy_kl_penalty,
        kind=loss.reference_policy_kl_type,
        input_clamp=loss.kl_input_clamp_value,
        output_clamp=loss.kl_output_clamp_value,
        on_policy_approximation=loss.use_on_policy_kl_approximation,
    )


def is_config(config: RunConfig) -> ISConfig:
    """The IS correction of ``loss_fn`` (band defaults from :class:`ISConfig` where unset)."""
    loss = config.loss_fn
    lo = loss.is_lower if loss.is_lower is not None else ISConfig.lo
    hi = loss.is_upper if loss.is_upper is not None else ISConfig.hi
    return ISConfig(variant=loss.is_variant, cap=loss.is_cap, lo=lo, hi=hi, log_ratio_clamp=loss.log_ratio_clamp)


def correction_weights(
    config: RunConfig, arm: str, logp_old: torch.Tensor, logp_rollout: torch.Tensor, response_mask: torch.Tensor
) -> tuple[ISResult, ISResult | None]:
    """The IS weights of one step: the configured variant's statistics (every arm logs them) and the weights the
    arm's loss multiplies in (``None``: not corrected; :meth:`~megatron_fp8.config.schema.LossConfig.arm_corrects`:
    ``loss_fn.use_importance_sampling_correction`` when given, else the arm).

    Args:
        config: the run config.
        arm: the arm's name (a key of :data:`megatron_fp8.vocab.ARMS`).
        logp_old: ``[B, T]`` the trainer's log-probs of the rollout's tokens (the old policy).
        logp_rollout: ``[B, T]`` the rollout engine's log-probs of them.
        response_mask: ``[B, T]`` real response tokens.

    Returns:
        ``(statistics, weights or None)``; with ``is_variant: none`` the statistics are the raw token ratios.
    """
    is_cfg = is_config(config)
    diag_cfg = is_cfg if is_cfg.variant != "none" else ISConfig(log_ratio_clamp=is_cfg.log_ratio_clamp)
    result = compute_is_weights(logp_old, logp_rollout, response_mask, config=diag_cfg)
    return result, (result if config.loss_fn.arm_corrects(arm) else None)


def ratio_inputs(
    config: RunConfig,
    arm: str,
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    response_mask: torch.Tensor,
    is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The PPO ratio's old log-probabilities and the IS weights of one micro-batch's loss.

    The trainer's scores of the rollout and the step's weights; with ``loss_fn.force_on_policy_ratio`` (NeMo-RL's
    ``ClippedPGLossFn``: ``prev_logprobs = curr_logprobs.detach()``) the training forward itself, ratio 1, and the IS
    weights of the arm recomputed against it.

    Args:
        config: the run config.
        arm: the arm.
        logp_new: ``[n, T]`` the training forward's log-probs (with grad).
        logp_old: ``[n, T]`` the trainer's scores of the rollout.
        logp_rollout: ``[n, T]`` the engine's log-probs.
        response_mask: ``[n, T]`` real response tokens.
        is_weights: ``[n, T]`` the step's IS weights of these rows (``None``: the arm does not correct).

    Returns:
        ``(old log-probs, IS weights or None)``.
    """
    if not config.loss_fn.force_on_policy_ratio:
        return logp_old, is_weights
    old = logp_new.detach()
    _, fresh = correction_weights(config, arm, old, logp_rollout, response_mask)
    return old, fresh.weights if fresh is not None else None


def update_rows(rows: int, config: RunConfig, dp: DataParallel) -> list[slice]:
    """This rank's rows of each optimizer update of a step (``policy.train_global_batch_size`` over all ranks).

    Raises:
        ConfigError: the rank's rows do not split into whole updates of ``global / DP`` rows.
    """
    global_batch = config.policy.train_global_batch_size
    if global_batch is None:
        return [slice(0, rows)]
    if global_batch % dp.dp_size or rows % (global_batch // dp.dp_size):
        raise ConfigError(
            f"policy.train_global_batch_size={global_batch} over {dp.dp_size} data-parallel replica(s) does not "
            f"split this rank's {rows} samples into whole updates; make it a multiple of {dp.dp_size} that divides "
            "grpo.num_prompts_per_step x num_generations_per_prompt"
        )
    per_rank = global_batch // dp.dp_size
    return [slice(start, start + per_rank) for start in range(0, rows, per_rank)]


FP8_PACKED_MULTIPLE = MappingProxyType({"blockwise": 128, "fp8_param": 128, "mxfp8": 32})
"""Tokens a packed micro-batch is padded to a multiple of under an FP8 training recipe (the FP8 GEMMs' token
dimension: cuBLAS's 128 blocks, MXFP8's 32; 16 for the other recipes), as NeMo-RL's Megatron path pads it
(``_get_pack_sequence_parameters_for_megatron``); 1 without FP8 training."""


@dataclass(frozen=True)
class BatchLayouts:
    """The micro-batch layouts of a step's trainer passes: ``score`` (old policy and reference), ``train``; ``None``:
    rows of ``policy.logprob_batch_size`` / ``policy.train_micro_batch_size``."""

    score: BatchLayout | None
    train: BatchLayout | None


def batch_layouts(config: RunConfig, *, moe: bool) -> BatchLayouts:
    """The layouts ``policy.sequence_packing`` / ``policy.dynamic_batching`` ask for.

    A mixture-of-experts model keeps padded rows (expert parallelism all-gathers one token count per micro-batch over
    the replicas, which different packings would break); this is logged once per run.
    """
    pack, dyn = config.policy.sequence_packing, config.policy.dynamic_batching
    if not (pack.enabled or dyn.enabled):
        return BatchLayouts(None, None)
    if moe:
        section = "policy.sequence_packing" if pack.enabled else "policy.dynamic_batching"
        _warn_once(
            f"{section} is enabled but a mixture-of-experts model trains on padded rows (expert parallelism needs one "
            "token count per micro-batch on every replica); policy.train_micro_batch_size / logprob_batch_size apply"
        )
        return BatchLayouts(None, None)
    if pack.enabled:
        fp8 = config.policy.megatron_cfg.fp8_cfg
        multiple = FP8_PACKED_MULTIPLE.get(config.training_recipe, 16) if fp8.enabled else 1
        kwargs = {
            "kind": "packed",
            "round_to": multiple,
            "algorithm": pack.algorithm.lower(),
            "largest_first": pack.microbatch_order == "largest_first",
        }
        tokens = (pack.logprob_mb_tokens, pack.train_mb_tokens)
        section = "policy.sequence_packing"
    else:
        kwargs = {"kind": "dynamic", "round_to": dyn.sequence_length_round}
        tokens = (dyn.logprob_mb_tokens, dyn.train_mb_tokens)
        section = "policy.dynamic_batching"
    return BatchLayouts(
        score=BatchLayout(tokens=tokens[0], key=f"{section}.logprob_mb_tokens", **kwargs),
        train=BatchLayout(tokens=tokens[1], key=f"{section}.train_mb_tokens", **kwargs),
    )


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
