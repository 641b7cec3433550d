"""Cross-field rules of the algorithm's settings: the loss (``loss_fn``: IS correction, PPO clip, KL penalty), the
learning-rate schedule (``policy.megatron_cfg.scheduler`` with ``optimizer.{lr, min_lr}``) and how the trainer batches
(``policy.sequence_packing`` / ``policy.dynamic_batching``).

Each rule returns one line per problem, naming the key and the allowed range; :data:`megatron_fp8.config.validate.RULES`
runs them with the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_fp8 import vocab
from megatron_fp8.config.schema import LossConfig, RunConfig
from megatron_fp8.megatron.bins import PACKING_ALGORITHMS

_SWITCH = "loss_fn.use_importance_sampling_correction"


def loss_rules(cfg: RunConfig) -> list[str]:
    """``loss_fn``: positive IS cap, ordered IS bounds, PPO clip epsilons in range, positive log-ratio clamp,
    a non-negative KL penalty with positive clamps; ``grpo.arms`` that agree with the correction switch."""
    loss = cfg.loss_fn
    problems: list[str] = correction_switch_problems(loss, cfg.grpo.arms)
    if loss.is_cap is not None and loss.is_cap <= 0:
        problems.append(f"loss_fn.is_cap must be > 0 (or null: no truncation), got {loss.is_cap}")
    if loss.ratio_clip_c is not None and not loss.ratio_clip_c > 1:
        problems.append(f"loss_fn.ratio_clip_c (dual clip) must be > 1 (or null: off), got {loss.ratio_clip_c}")
    if loss.is_lower is not None and loss.is_lower < 0:
        problems.append(f"loss_fn.is_lower must be >= 0, got {loss.is_lower}")
    if loss.is_lower is not None and loss.is_upper is not None and loss.is_lower >= loss.is_upper:
        problems.append(f"loss_fn.is_lower ({loss.is_lower}) must be below loss_fn.is_upper ({loss.is_upper})")
    if not 0.0 <= loss.ratio_clip_min < 1.0:
        problems.append(
            f"loss_fn.ratio_clip_min is the PPO clip epsilon below 1: must be in [0, 1), got {loss.ratio_clip_min}"
        )
    if loss.ratio_clip_max < 0.0:
        problems.append(
            f"loss_fn.ratio_clip_max is the PPO clip epsilon above 1: must be >= 0, got {loss.ratio_clip_max}"
        )
    if loss.log_ratio_clamp <= 0:
        problems.append(f"loss_fn.log_ratio_clamp must be > 0, got {loss.log_ratio_clamp}")
    if loss.reference_policy_kl_penalty < 0:
        problems.append(
            "loss_fn.reference_policy_kl_penalty is the weight of the KL penalty to the reference policy: must be "
            f">= 0 (0 = none), got {loss.reference_policy_kl_penalty}"
        )
    fp8 = cfg.policy.megatron_cfg.fp8_cfg
    if loss.kl_enabled and fp8.enabled and fp8.fp8_param:
        problems.append(
            "loss_fn.reference_policy_kl_penalty with policy.megatron_cfg.fp8_cfg.fp8_param: the reference policy is "
            "swapped into the trainer by copying parameters, which would requantize FP8 primary weights; set "
            "fp8_param: false or reference_policy_kl_penalty: 0"
        )
    for key in ("kl_input_clamp_value", "kl_output_clamp_value"):
        value = getattr(loss, key)
        if value is not None and value <= 0:
            problems.append(f"loss_fn.{key} must be > 0 (or null for no clamp), got {value}")
    return problems


def scheduler_rules(cfg: RunConfig) -> list[str]:
    """``policy.megatron_cfg.scheduler`` and ``optimizer.min_lr``: what Megatron-Core's ``OptimizerParamScheduler``
    asserts (``0 <= min_lr <= lr``, ``lr_warmup_init <= lr``, warm-up shorter than the decay), said with the keys."""
    opt, sched = cfg.policy.megatron_cfg.optimizer, cfg.policy.megatron_cfg.scheduler
    key = "policy.megatron_cfg.scheduler"
    problems: list[str] = []
    if not 0 <= opt.min_lr <= opt.lr:
        problems.append(f"policy.megatron_cfg.optimizer.min_lr must be in [0, lr={opt.lr}], got {opt.min_lr}")
    if sched.lr_warmup_iters < 0:
        problems.append(f"{key}.lr_warmup_iters must be >= 0, got {sched.lr_warmup_iters}")
    if sched.lr_warmup_init is not None and not 0 <= sched.lr_warmup_init <= opt.lr:
        problems.append(f"{key}.lr_warmup_init must be in [0, lr={opt.lr}], got {sched.lr_warmup_init}")
    decay = sched.lr_decay_iters if sched.lr_decay_iters is not None else cfg.grpo.max_num_steps
    if decay < 1 or sched.lr_warmup_iters >= max(decay, 1) and sched.lr_decay_style != "constant":
        problems.append(
            f"{key}.lr_decay_iters ({decay}{' = grpo.max_num_steps' if sched.lr_decay_iters is None else ''}) must be "
            f">= 1 and above lr_warmup_iters ({sched.lr_warmup_iters}) for lr_decay_style {sched.lr_decay_style!r}"
        )
    return problems


def correction_switch_problems(loss: LossConfig, arms: Sequence[str]) -> list[str]:
    """Arms that contradict ``loss_fn.use_importance_sampling_correction`` when it is given (it decides for every arm).

    ``True`` corrects every arm, so ``fp8`` (named "without correction") contradicts it; ``bf16`` runs corrected,
    as NeMo-RL corrects a BF16 rollout (weights near 1). ``False`` corrects none, so ``fp8_tis`` contradicts it.
    ``True`` with ``is_variant: none`` turns the correction on and off at once. Not given: the arms decide.

    Args:
        loss: the ``loss_fn`` section.
        arms: the arms the run runs (``grpo.arms`` or ``--arms``).

    Returns:
        One line per problem, naming both keys and the fix.
    """
    switch = loss.use_importance_sampling_correction
    if switch is None:
        return []
    unset = f"or remove {_SWITCH} (then the arms decide: fp8_tis corrects, bf16 and fp8 do not)"
    if switch and loss.is_variant == "none":
        return [
            f"{_SWITCH}=true turns the correction on and loss_fn.is_variant='none' turns it off; set is_variant "
            f"(e.g. token_tis) or {_SWITCH}=false"
        ]
    wrong = "fp8" if switch else "fp8_tis"
    if wrong not in arms:
        return []
    right = "fp8_tis" if switch else "fp8"
    says = "corrects every arm" if switch else "turns the correction off for every arm"
    named = "runs without the correction" if switch else "runs with it"
    fixed = list(dict.fromkeys(right if a == wrong else a for a in arms))
    return [
        f"grpo.arms={list(arms)}: {_SWITCH}={str(switch).lower()} {says}, but arm {wrong!r} {named}; use "
        f"grpo.arms={fixed} (the arms the key allows), or set {_SWITCH}={str(not switch).lower()}, {unset}"
    ]


def low_cap_warning(loss: LossConfig, arms: Sequence[str]) -> str | None:
    """The warning for an IS cap below 1 on a correcting arm (``None`` when there is none to give).

    A cap ``C < 1`` truncates every token weight above ``C``, the on-policy weight 1 included, so every corrected
    token's policy gradient is scaled by at most ``C`` and tokens the trainer finds likelier than the rollout lose
    their extra weight: the correction then shrinks the update rather than correcting the mismatch.
    """
    cap = loss.is_cap
    if cap is None or cap >= 1 or loss.is_variant not in vocab.IS_VARIANTS_WITH_CAP:
        return None
    if not any(loss.arm_corrects(a) for a in arms if a in vocab.ARMS):
        return None
    unit = "sequence weight" if loss.is_variant == "seq_is" else "token weight"
    return (
        f"loss_fn.is_cap={cap} (truncated_importance_sampling_ratio) is below 1: every {unit} above {cap} is cut to "
        f"{cap}, the on-policy weight 1 included, so every corrected {unit.split()[0]}'s gradient is scaled by at most "
        f"{cap} (a smaller step), not only the over-weighted ones; NeMo-RL's files use 2"
    )


MICROBATCH_ORDERS = ("packer", "largest_first")
"""``policy.sequence_packing.microbatch_order``: NeMo-RL's two orders of a rank's bins."""


def batching_rules(cfg: RunConfig) -> list[str]:
    """``policy.sequence_packing`` / ``policy.dynamic_batching``: not both; an enabled one has both token budgets
    (>= 1); a known packer and order; dynamic batching rounds to >= 1 and runs on one pipeline stage."""
    pack, dyn = cfg.policy.sequence_packing, cfg.policy.dynamic_batching
    problems: list[str] = []
    if pack.enabled and dyn.enabled:
        problems.append(
            "policy.sequence_packing and policy.dynamic_batching are both enabled; they are exclusive (as in "
            "NeMo-RL): keep sequence_packing (fewer padded tokens) and set policy.dynamic_batching.enabled: false"
        )
    prompt, engine_cap = cfg.data.max_input_seq_length, cfg.policy.generation.vllm_cfg.max_model_len
    longest = (prompt if prompt is not None else 1) + cfg.policy.generation.max_new_tokens
    what = ("data.max_input_seq_length + " if prompt is not None else "a 1-token prompt + ") + "max_new_tokens"
    if engine_cap is not None and engine_cap < longest:  # the engine stops a row at its max_model_len
        longest, what = engine_cap, "policy.generation.vllm_cfg.max_model_len"
    for section, obj in (("policy.sequence_packing", pack), ("policy.dynamic_batching", dyn)):
        if not obj.enabled:
            continue
        for key in ("train_mb_tokens", "logprob_mb_tokens"):
            value = getattr(obj, key)
            if value is None or value < 1:
                problems.append(
                    f"{section}.{key} must be a token budget >= 1 when {section}.enabled (NeMo-RL's files give "
                    f"max_total_sequence_length x the micro-batch size), got {value}"
                )
            elif value < longest:  # a row can be that long: it would fit no micro-batch
                problems.append(
                    f"{section}.{key}={value} is below the longest row a step can hold ({what} = {longest} "
                    f"tokens); raise it to at least {longest}"
                )
    if pack.enabled and pack.algorithm.lower() not in PACKING_ALGORITHMS:
        problems.append(
            f"policy.sequence_packing.algorithm={pack.algorithm!r} is not one of NeMo-RL's packers: "
            f"{', '.join(PACKING_ALGORITHMS)}"
        )
    if pack.enabled and pack.microbatch_order not in MICROBATCH_ORDERS:
        problems.append(
            f"policy.sequence_packing.microbatch_order={pack.microbatch_order!r}: use one of {', '.join(MICROBATCH_ORDERS)}"
        )
    if dyn.enabled and dyn.sequence_length_round < 1:
        problems.append(f"policy.dynamic_batching.sequence_length_round must be >= 1, got {dyn.sequence_length_round}")
    if dyn.enabled and cfg.policy.megatron_cfg.pipeline_model_parallel_size > 1:
        problems.append(
            "policy.dynamic_batching needs one pipeline stage (the stages exchange one activation shape per "
            "micro-batch; NeMo-RL refuses it too): with pipeline parallelism use policy.sequence_packing instead"
        )
    return problems


def async_rules(cfg: RunConfig) -> list[str]:
    """``grpo.async_grpo``: separate rollout ranks (NeMo-RL refuses colocated async with vLLM), an age limit >= 0;
    ``loss_fn.force_on_policy_ratio``: one optimizer update per step (NeMo-RL's condition)."""
    problems: list[str] = []
    a = cfg.grpo.async_grpo
    if a.max_trajectory_age_steps < 0:
        problems.append(f"grpo.async_grpo.max_trajectory_age_steps must be >= 0, got {a.max_trajectory_age_steps}")
    if a.enabled and cfg.policy.generation.colocated.enabled:
        problems.append(
            "grpo.async_grpo.enabled needs separate rollout ranks (the colocated engine sleeps while its GPU trains, "
            "so nothing overlaps; NeMo-RL refuses it with vLLM too): set policy.generation.colocated.enabled: false "
            "with colocated.resources, or ROLLOUT_TASKS=N in slurm/grpo.sbatch"
        )
    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    global_batch = cfg.policy.train_global_batch_size
    if cfg.loss_fn.force_on_policy_ratio and (
        cfg.grpo.updates_per_step != 1 or (global_batch is not None and global_batch != samples)
    ):
        problems.append(
            "loss_fn.force_on_policy_ratio needs one optimizer update per step (the ratio's old policy is the weights "
            f"being trained): set grpo.updates_per_step: 1 and policy.train_global_batch_size: {samples} (or null)"
        )
    return problems


def loss_scale_rules(cfg: RunConfig) -> list[str]:
    """FP16's dynamic loss scale (``policy.megatron_cfg.optimizer``): ``0 < min_loss_scale <= initial_loss_scale``,
    ``loss_scale_window >= 1``, ``hysteresis >= 1`` (checked whatever ``policy.precision`` is: a file is valid or
    not on its own)."""
    o, key = cfg.policy.megatron_cfg.optimizer, "policy.megatron_cfg.optimizer"
    problems = []
    if not 0 < o.min_loss_scale <= o.initial_loss_scale:
        problems.append(
            f"{key}.min_loss_scale={o.min_loss_scale} and initial_loss_scale={o.initial_loss_scale}: need "
            "0 < min_loss_scale <= initial_loss_scale"
        )
    for name in ("loss_scale_window", "hysteresis"):
        if getattr(o, name) < 1:
            problems.append(f"{key}.{name} must be >= 1, got {getattr(o, name)}")
    return problems


def dynamic_sampling_rules(cfg: RunConfig) -> list[str]:
    """``grpo.use_dynamic_sampling``: ``batch_multiplier >= 1`` (``1`` without dynamic sampling, as NeMo-RL asserts),
    ``dynamic_sampling_max_gen_batches >= 1``, a round's prompts split evenly over the data-parallel replicas when
    they are known here, and no rollout ahead of the trainer (``grpo.async_grpo``)."""
    g = cfg.grpo
    problems: list[str] = []
    if not g.use_dynamic_sampling:
        if g.batch_multiplier != 1:
            problems.append(
                f"grpo.batch_multiplier={g.batch_multiplier} oversamples prompts for dynamic sampling only: set "
                "grpo.use_dynamic_sampling: true, or batch_multiplier: 1"
            )
        return problems
    if g.batch_multiplier < 1:
        problems.append(f"grpo.batch_multiplier must be >= 1, got {g.batch_multiplier}")
    if g.dynamic_sampling_max_gen_batches < 1:
        problems.append(f"grpo.dynamic_sampling_max_gen_batches must be >= 1, got {g.dynamic_sampling_max_gen_batches}")
    if g.async_grpo.enabled:
        problems.append(
            "grpo.use_dynamic_sampling with grpo.async_grpo.enabled: a step's generation rounds depend on its rewards, "
            "so the next step's samples cannot be asked for ahead; turn one of them off"
        )
    return problems


def reward_rules(cfg: RunConfig) -> list[str]:
    """``grpo.reward_scaling``: a source range of positive width; ``grpo.reward_shaping``: the three overlong keys (or
    ``stop_properly_penalty_coef`` in ``[0, 1]``), a penalty >= 0 and a buffer within ``max_response_length``."""
    problems: list[str] = []
    scale, shape = cfg.grpo.reward_scaling, cfg.grpo.reward_shaping
    if scale.enabled and not scale.source_max > scale.source_min:
        problems.append(
            f"grpo.reward_scaling: source_max ({scale.source_max}) must exceed source_min ({scale.source_min})"
        )
    if not shape.enabled:
        return problems
    coef = shape.stop_properly_penalty_coef
    if coef is not None:
        if not 0.0 <= coef <= 1.0:
            problems.append(f"grpo.reward_shaping.stop_properly_penalty_coef must be in [0, 1], got {coef}")
        return problems
    keys = ("overlong_buffer_length", "overlong_buffer_penalty", "max_response_length")
    missing = [k for k in keys if getattr(shape, k) is None]
    if missing:
        problems.append(
            f"grpo.reward_shaping.enabled needs {', '.join(missing)} (DAPO's overlong penalty; NeMo-RL refuses it "
            "too), or stop_properly_penalty_coef"
        )
        return problems
    assert shape.overlong_buffer_length is not None and shape.max_response_length is not None
    assert shape.overlong_buffer_penalty is not None
    if shape.overlong_buffer_penalty < 0:
        problems.append(
            f"grpo.reward_shaping.overlong_buffer_penalty must be >= 0, got {shape.overlong_buffer_penalty}"
        )
    if not 0 < shape.overlong_buffer_length <= shape.max_response_length:
        problems.append(
            f"grpo.reward_shaping.overlong_buffer_length ({shape.overlong_buffer_length}) must be in "
            f"(0, max_response_length = {shape.max_response_length}]"
        )
    return problems
