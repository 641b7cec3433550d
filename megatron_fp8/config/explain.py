"""``megatron-fp8 config --explain``: every key of a loaded config, its value, where it came from, what it does.

:data:`EFFECTS` declares, for every key the schema implements, where its value goes (the longest
matching dotted prefix wins); a test checks that every schema key has one. Keys megatron-fp8 does not
implement are explained by :mod:`megatron_fp8.config.nemo_rl.keys` ("no effect: <reason>").
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_fp8.config.loader import LoadedConfig
from megatron_fp8.config.nemo_rl.inheritance import OVERRIDE_SOURCE, leaf_paths
from megatron_fp8.config.nemo_rl.keys import known_keys
from megatron_fp8.config.schema import JSONValue

_DIMS = "model dimension, for validation only (TP divisibility, BF16 layers)"
_VLLM_ARG = "vLLM engine argument {} (config.wiring.vllm_engine_args)"

EFFECTS: Mapping[str, str] = {
    "model.name_or_path": "the checkpoint trained and served (models.resolve_model)",
    "model.is_moe": "MoE checks: FP8 rollout must be blockwise (config.validate)",
    "model.num_layers": _DIMS,
    "model.hidden_size": _DIMS,
    "model.intermediate_size": _DIMS,
    "model.num_attention_heads": _DIMS,
    "model.num_key_value_heads": _DIMS,
    "model.head_dim": _DIMS,
    "model.moe_intermediate_size": _DIMS,
    "model.num_experts": _DIMS,
    "policy.model_name": "NeMo-RL spelling of model.name_or_path (the checkpoint)",
    "policy.train_global_batch_size": "sequences per optimizer update over all ranks: a step's samples are "
    "that many updates (rl.driver.phases.train_phase)",
    "policy.logprob_batch_size": "sequences per no-grad forward when the trainer scores a rollout "
    "(rl.driver.phases.train_phase)",
    "policy.train_micro_batch_size": "sequences per forward/backward; gradients accumulated into each update "
    "(rl.driver.phases.train_phase -> megatron.step.train_step)",
    "policy.precision": "the trainer's weights and math (rl.driver.runtime.trainer_dtype -> megatron.build: "
    "params_dtype, bf16/fp16; megatron.step.make_optimizer: Megatron-Core's FP16 optimizer and dynamic loss scale, "
    "on CPU float32 math with FP16-rounded weights and the same scaler, megatron.optim.DynamicLossScaler); "
    "sent to the rollout as BF16 / FP8",
    "grpo.async_grpo.enabled": "the rollout ranks generate the next step's samples while the trainers train "
    "(rl.driver.phases.run_step -> RemoteRollout.submit; separate rollout ranks only; ages in metrics.jsonl)",
    "grpo.async_grpo.max_trajectory_age_steps": "0: no overlap (the synchronous run); >= 1: the rollout one step "
    "ahead, every sample at most 1 update old",
    "grpo.reward_scaling.enabled": "rewards clamped to [source_min, source_max] and mapped onto [target_min, "
    "target_max] before the advantages (rl.algorithm.shaping.scale_rewards)",
    "grpo.reward_scaling.source_min": "the scaling's source range, low end",
    "grpo.reward_scaling.source_max": "the scaling's source range, high end",
    "grpo.reward_scaling.target_min": "the scaling's target range, low end",
    "grpo.reward_scaling.target_max": "the scaling's target range, high end",
    "grpo.reward_shaping.enabled": "DAPO's overlong penalty after the scaling (rl.algorithm.shaping.shape_rewards)",
    "grpo.reward_shaping.overlong_buffer_length": "tokens before max_response_length where the penalty grows from 0",
    "grpo.reward_shaping.overlong_buffer_penalty": "the penalty per buffer length of excess (>= 0)",
    "grpo.reward_shaping.max_response_length": "where the overlong buffer ends, tokens",
    "grpo.reward_shaping.stop_properly_penalty_coef": "instead: a truncated response's reward times this (in [0, 1])",
    "grpo.overlong_filtering": "responses cut at max_new_tokens leave the loss (their group's baseline keeps them; "
    "rl.driver.phases.train_phase)",
    "policy.megatron_cfg.optimizer.initial_loss_scale": "FP16 (policy.precision: float16): the dynamic loss scale's "
    "first value (Megatron-Core's DynamicGradScaler; megatron.optim.DynamicLossScaler on CPU)",
    "policy.megatron_cfg.optimizer.min_loss_scale": "FP16: the loss scale never goes below it",
    "policy.megatron_cfg.optimizer.loss_scale_window": "FP16: steps without overflow before the loss scale doubles",
    "policy.megatron_cfg.optimizer.hysteresis": "FP16: overflowing steps before the loss scale halves",
    "grpo.use_dynamic_sampling": "DAPO: a step trains only on groups whose rewards vary, generation rounds repeated "
    "until it has num_prompts_per_step x num_generations_per_prompt such samples (rl.sampling.dynamic)",
    "grpo.batch_multiplier": "prompts of one dynamic-sampling generation round: num_prompts_per_step x this",
    "grpo.dynamic_sampling_max_gen_batches": "generation rounds a step may take; still short after round max + 1: "
    "the run stops naming the keys (as NeMo-RL counts them)",
    "loss_fn.ratio_clip_c": "dual-clip PPO: a negative-advantage token's loss bounded by -A x C "
    "(rl.algorithm.correction.ppo_loss)",
    "loss_fn.force_on_policy_ratio": "the PPO ratio's old policy is the training forward (ratio 1); the IS weights "
    "compare it with the generating policy (rl.driver.phases.train_phase); one update per step",
    "policy.sequence_packing.enabled": "every trainer pass (old-policy and reference scores, training) packs rows into "
    "micro-batches of a token budget, each sequence attending to itself (megatron.microbatch; a MoE model stays padded)",
    "policy.sequence_packing.train_mb_tokens": "tokens per packed training micro-batch at most (megatron.microbatch)",
    "policy.sequence_packing.logprob_mb_tokens": "tokens per packed scoring micro-batch at most (megatron.microbatch)",
    "policy.sequence_packing.algorithm": "NeMo-RL's bin packer (megatron.bins: the same bins on the same lengths)",
    "policy.sequence_packing.microbatch_order": "packer: the packer's order; largest_first: bins longest first",
    "policy.dynamic_batching.enabled": "every trainer pass groups rows of similar length into micro-batches of a token "
    "budget, each padded to its own longest row (megatron.microbatch; one pipeline stage; a MoE model stays padded)",
    "policy.dynamic_batching.train_mb_tokens": "tokens (rows x padded length) per training micro-batch at most",
    "policy.dynamic_batching.logprob_mb_tokens": "tokens (rows x padded length) per scoring micro-batch at most",
    "policy.dynamic_batching.sequence_length_round": "a dynamic micro-batch's length rounded up to this multiple",
    "policy.megatron_cfg.enabled": "must be true: megatron-fp8 always trains through Megatron-Core",
    "policy.megatron_cfg.tensor_model_parallel_size": "Megatron tensor parallel size (config.wiring.megatron_parallel_args)",
    "policy.megatron_cfg.pipeline_model_parallel_size": "Megatron pipeline stages: Megatron-Core's 1F1B schedule "
    "(megatron.schedule; micro-batches of train_micro_batch_size / logprob_batch_size must split a batch evenly)",
    "policy.megatron_cfg.fp8_cfg.enabled": "FP8 training on/off: selects the training recipe (RunConfig.training_recipe)",
    "policy.megatron_cfg.fp8_cfg.fp8": "Megatron-Core FP8 format of the training recipe",
    "policy.megatron_cfg.fp8_cfg.fp8_recipe": "the FP8 training recipe (recipes.registry) written into Megatron-Core",
    "policy.megatron_cfg.fp8_cfg.fp8_param": "FP8 primary weights: with blockwise, the 'fp8_param' recipe",
    "policy.megatron_cfg.fp8_cfg.num_first_layers_in_bf16": "first training layers kept BF16 (build_megatron_model)",
    "policy.megatron_cfg.fp8_cfg.num_last_layers_in_bf16": "last training layers kept BF16 (build_megatron_model)",
    "policy.megatron_cfg.expert_model_parallel_size": "Megatron expert parallel size: a MoE model's routed experts "
    "split over the data-parallel ranks (allgather token dispatcher on CPU)",
    "policy.megatron_cfg.activation_checkpointing": "Megatron-Core activation recompute in the backward pass "
    "(megatron.build.RecomputeSettings; full: uniform, one layer at a time)",
    "policy.megatron_cfg.recompute_granularity": "full (every layer) or selective (recompute_modules) recompute",
    "policy.megatron_cfg.recompute_modules": "Megatron-Core's modules of a selective recompute (null: core_attn)",
    "policy.megatron_cfg.optimizer.lr": "Adam peak learning rate (policy.megatron_cfg.scheduler shapes it)",
    "policy.megatron_cfg.optimizer.min_lr": "the learning rate a decaying schedule ends at",
    "policy.megatron_cfg.scheduler.lr_warmup_iters": "steps of linear learning-rate warm-up (Megatron-Core scheduler)",
    "policy.megatron_cfg.scheduler.lr_warmup_init": "learning rate of step 0 of the warm-up (null: 10% of lr)",
    "policy.megatron_cfg.scheduler.lr_decay_style": "constant, linear, cosine or inverse-square-root after the warm-up",
    "policy.megatron_cfg.scheduler.lr_decay_iters": "step at which the decay reaches min_lr (null: grpo.max_num_steps)",
    "policy.megatron_cfg.optimizer.weight_decay": "decoupled weight decay (not on biases and norms)",
    "policy.megatron_cfg.optimizer.adam_beta1": "Adam beta1",
    "policy.megatron_cfg.optimizer.adam_beta2": "Adam beta2",
    "policy.megatron_cfg.optimizer.adam_eps": "Adam epsilon",
    "policy.generation.max_new_tokens": "generation length limit, tokens (rollout engine, validation)",
    "policy.generation.temperature": "sampling temperature (rollout engine) and the trainer's log-prob temperature",
    "policy.megatron_cfg.optimizer.clip_grad": "global gradient-norm clip of the Adam (megatron.optim)",
    "policy.megatron_cfg.optimizer.use_distributed_optimizer": "FP32 main weights and Adam moments sharded over the "
    "data-parallel ranks: Megatron-Core's DistributedOptimizer on GPU, megatron.dist_optim.ShardedDDPAdam on CPU",
    "policy.megatron_cfg.env_vars": "environment of the run (set for its duration by rl.driver.grpo)",
    "policy.megatron_cfg.optimizer.optimizer_cpu_offload": "Adam state and step in host memory: Megatron-Core's "
    "HybridDeviceOptimizer on GPU (megatron.step); the colocated schedule leaves it there; memory plan (config.memory_plan)",
    "policy.megatron_cfg.optimizer.optimizer_offload_fraction": "the share of the optimizer state in host memory with "
    "optimizer_cpu_offload (Megatron-Core's optimizer_offload_fraction; memory plan)",
    "policy.megatron_cfg.empty_unused_memory_level": "torch.cuda.empty_cache() after forward/backward (1) and after "
    "the optimizer step too (2) (megatron.offload.empty_unused_memory; no effect without CUDA)",
    "policy.offload_optimizer_for_logprob": "colocated: the optimizer state stays in pinned host memory while the "
    "trainer scores, back before the update (megatron.offload, rl.driver.phases); memory plan",
    "policy.generation.backend": "must be 'vllm' (the engine itself is rollout.engine)",
    "policy.generation.vllm_cfg.precision": "FP8 rollout on/off for the FP8 arms; quantization config and manifest",
    "policy.generation.vllm_cfg.use_deep_gemm": "env VLLM_USE_DEEP_GEMM of the vLLM engine (config.wiring.vllm_env)",
    "policy.generation.vllm_cfg.gpu_memory_utilization": _VLLM_ARG.format("gpu_memory_utilization"),
    "policy.generation.vllm_cfg.num_first_layers_in_bf16": "first layers in ignored_layers -> manifest (rl.driver.fp8_rollout)",
    "policy.generation.vllm_cfg.num_last_layers_in_bf16": "last layers in ignored_layers -> manifest (rl.driver.fp8_rollout)",
    "policy.generation.vllm_cfg.pow2_weight_scaling_factors": (
        "UE8M0 weight scales in the refit export (null: the engine's own format)"
    ),
    "policy.generation.vllm_cfg.pow2_activation_scaling_factors": "UE8M0 activation scales (reference engine)",
    "policy.generation.vllm_cfg.kv_cache_dtype": _VLLM_ARG.format("kv_cache_dtype") + "; FP8 KV scales",
    "policy.generation.vllm_cfg.tensor_parallel_size": _VLLM_ARG.format("tensor_parallel_size") + "; export TP",
    "policy.generation.vllm_cfg.max_model_len": _VLLM_ARG.format("max_model_len"),
    "policy.generation.vllm_cfg.quantization_ignored_layer_kws": "modules named so -> ignored_layers -> manifest",
    "policy.generation.vllm_cfg.is_mx": "MXFP8 rollout: refused (needs Blackwell; the refit is blockwise)",
    "policy.generation.vllm_cfg.quantization_config": "the explicit vLLM quantization_config (hf_overrides)",
    "loss_fn.use_importance_sampling_correction": (
        "IS correction on/off for every arm; not given: the arms decide (rl.driver.train_settings)"
    ),
    "loss_fn.is_variant": "IS correction rule (rl.algorithm.correction.RULES)",
    "loss_fn.is_cap": "truncation cap of the IS weight (rl.algorithm.correction)",
    "loss_fn.is_lower": "lower IS ratio bound of the masking variants (rl.driver.phases)",
    "loss_fn.is_upper": "upper IS ratio bound of the masking variants (rl.driver.phases)",
    "loss_fn.ratio_clip_min": "PPO clip epsilon below 1 (rl.driver.phases)",
    "loss_fn.ratio_clip_max": "PPO clip epsilon above 1 (rl.driver.phases)",
    "loss_fn.log_ratio_clamp": "clamp of |log ratio| before exp (rl.driver.phases)",
    "loss_fn.reference_policy_kl_penalty": "weight of the KL penalty to the arm's initial weights (rl.algorithm.kl)",
    "loss_fn.reference_policy_kl_type": "KL estimator k1, k2 or k3 (rl.algorithm.kl)",
    "loss_fn.kl_input_clamp_value": "clamp of |log(pi_ref / pi)| before the KL estimator (rl.algorithm.kl)",
    "loss_fn.kl_output_clamp_value": "clamp of the per-token KL estimate (rl.algorithm.kl)",
    "loss_fn.use_on_policy_kl_approximation": "weight the KL by pi / pi_rollout (rl.algorithm.kl)",
    "loss_fn.token_level_loss": "token mean (true) or sequence mean of token means (false) (rl.algorithm.correction)",
    "grpo.max_num_steps": "training steps per arm (rl.driver.grpo)",
    "grpo.num_prompts_per_step": "prompts per step (rl.driver.phases)",
    "grpo.num_generations_per_prompt": "samples per prompt, the GRPO group (rl.driver.phases)",
    "grpo.seed": "seed of prompts, sampling and init (rl.driver.grpo)",
    "grpo.arms": "the arms run, in order (rl.driver.grpo)",
    "grpo.task": "the verifiable toy task (rl.data.task)",
    "grpo.task_max_digits": "operand length of the task (rl.data.task)",
    "grpo.updates_per_step": "PPO updates per step (rl.driver.phases)",
    "grpo.warm_start_steps": "supervised warm-start steps before the arms (rl.driver.warm_start)",
    "grpo.warm_start_learning_rate": "learning rate of the warm start (rl.driver.warm_start)",
    "grpo.val_period": "validation accuracy every N steps (rl.driver.validation)",
    "grpo.val_at_start": "validation before the first step (rl.driver.validation)",
    "grpo.max_val_samples": "validation problems used (rl.driver.validation)",
    "grpo.normalize_rewards": "divide advantages by the group's reward deviation (rl.algorithm.batch)",
    "grpo.use_leave_one_out_baseline": "baseline of each response over the rest of its group, RLOO (rl.algorithm.batch)",
    "grpo.allow_no_effect": "accept NeMo-RL keys that change the experiment but have no effect here (config.refusals)",
    "grpo.allow_over_memory": "run although the memory plan per phase exceeds the GPU (config.memory_plan, config.refusals)",
    "policy.generation.colocated.enabled": "false: the last ranks only generate; refit over refit.transport "
    "(rl.cluster.remote); true: engine and trainer share each GPU, phase by phase (colocated.sleep_level)",
    "policy.generation.colocated.sleep_level": "the colocated engine sleeps after generating, the trainer's optimizer "
    "and gradients go to pinned host memory; wake, refit, KV scales, verify before the next rollout "
    "(rollout.sleep, megatron.offload); the memory plan per phase (config.memory_plan)",
    "policy.generation.colocated.resources.gpus_per_node": "rollout ranks per node when not colocated (rl.cluster.roles)",
    "policy.generation.colocated.resources.num_nodes": "nodes of rollout ranks when not colocated (rl.cluster.roles)",
    "data.train.data_path": "the training problems: a JSONL/Parquet file (rl.data.problems)",
    "data.train.input_key": "column of the problem text (rl.data.problems)",
    "data.train.output_key": "column of the expected answer (rl.data.problems)",
    "data.train.max_samples": "training rows used (rl.data.problems)",
    "data.train.split_validation_size": "training rows held out for validation, drawn with seed (rl.data.holdout)",
    "data.train.seed": "seed of the validation hold-out (rl.data.holdout)",
    "data.validation": "the validation problems (rl.data.problems, rl.driver.validation)",
    "data.default.prompt_file": "prompt template, then the tokenizer's chat template (rl.data.problems)",
    "data.default.system_prompt_file": "system message of the chat template (rl.data.problems)",
    "data.default.env_name": "the reward: math (math-verify) or module:function (rl.data.rewards)",
    "data.max_input_seq_length": "longer prompts skipped and counted (rl.data.problems)",
    "data.shuffle": "training rows shuffled with grpo.seed, per epoch (rl.data.problems)",
    "checkpointing.enabled": "checkpoints and resume from the latest complete one (rl.state.checkpoint)",
    "checkpointing.checkpoint_dir": "checkpoint folder, one subfolder per arm; null: <out>/checkpoints (rl.state.checkpoint)",
    "checkpointing.save_period": "save every N steps and after the last (rl.state.checkpoint)",
    "checkpointing.keep_top_k": "checkpoints kept per arm (rl.state.checkpoint)",
    "checkpointing.metric_name": "metric ranking checkpoints for keep_top_k (rl.state.checkpoint)",
    "checkpointing.higher_is_better": "direction of checkpointing.metric_name (rl.state.checkpoint)",
    "checkpointing.save_consolidated": "also a Hugging Face checkpoint per save (rl.state.checkpoint)",
    "checkpointing.checkpoint_must_save_by": "save and stop before this DD:HH:MM:SS after the loop starts (rl.driver.stopping)",
    "logger.log_dir": "folder of TensorBoard / W&B files (rl.state.loggers)",
    "logger.tensorboard_enabled": "TensorBoard scalars beside metrics.jsonl (rl.state.loggers)",
    "logger.wandb_enabled": "a W&B run in offline mode (rl.state.loggers)",
    "logger.wandb.project": "W&B project (rl.state.loggers)",
    "logger.wandb.name": "W&B run name (rl.state.loggers)",
    "refit.transport": "refit transport to separate rollout ranks (refit.transport.registry)",
    "rollout.engine": "the rollout engine (rollout.engines.ENGINES)",
    "refit.bucket_size_mb": "refit bucket size (refit.pipeline.ColocatedRefit)",
    "refit.timeout_s": "per-wait refit timeout (refit.pipeline.ColocatedRefit)",
    "refit.verify": "read back and compare after each refit (engine applier)",
    "kv_cache.percentile": "FP8 KV-cache scale calibration percentile (rl.algorithm.kv_calibration)",
    "kv_cache.margin": "FP8 KV-cache scale margin (rl.algorithm.kv_calibration)",
    "logging.level": "log level of `megatron-fp8 grpo` (cli.grpo)",
    "out_dir": "output folder of `megatron-fp8 grpo` without --out (cli.grpo)",
}
"""Dotted key (or prefix) the schema implements -> where its value goes."""

DEFAULT_SOURCE = "(default)"
"""Source shown for a key the config does not give (the schema default)."""

FILLED_SOURCE = "(known model)"
"""Source shown for a model dimension filled in from the known-model table."""


@dataclass(frozen=True)
class ExplainRow:
    """One key of a loaded config.

    Attributes:
        key: dotted path.
        value: the resolved value.
        source: the file that set it, ``<override>``, ``(default)`` or ``(known model)``.
        implemented: whether megatron-fp8 implements the key.
        effect: where the value goes, or ``"no effect: <reason>"``.
    """

    key: str
    value: JSONValue
    source: str
    implemented: bool
    effect: str


def effect_of(key: str) -> str | None:
    """The :data:`EFFECTS` entry of ``key`` (longest matching dotted prefix), ``None`` if there is none."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        effect = EFFECTS.get(".".join(parts[:i]))
        if effect is not None:
            return effect
    return None


def _value_at(data: Mapping[str, JSONValue], dotted: str) -> JSONValue:
    node: JSONValue = dict(data)
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _source(key: str, sources: Mapping[str, str], *, default: str) -> str:
    if key in sources:
        return sources[key]
    # a value below a leaf the file gave as a whole (e.g. env_vars: {...} given, or an alias renamed)
    below = [s for k, s in sources.items() if k.startswith(key + ".")]
    return below[-1] if below else default


def explain_rows(loaded: LoadedConfig) -> list[ExplainRow]:
    """Every key of ``loaded``: the implemented ones (schema order), then the ones with no effect."""
    data = loaded.config.to_dict()
    rows: list[ExplainRow] = []
    for key in leaf_paths(data):
        default = FILLED_SOURCE if key.startswith("model.") and key != "model.name_or_path" else DEFAULT_SOURCE
        source = _source(key, loaded.sources, default=default)
        if key == "model.name_or_path" and source == DEFAULT_SOURCE:
            source = _source("policy.model_name", loaded.sources, default=DEFAULT_SOURCE)
        rows.append(ExplainRow(key, _value_at(data, key), source, True, effect_of(key) or "(undeclared)"))
    for key, value in loaded.translated.items():
        effect = (
            "read: the staged data_path's columns, split and held-out share (config.nemo_rl.datasets)"
            if key.startswith("data.")
            else "read as loss_fn.is_variant / is_cap / is_lower / is_upper (config.nemo_rl.importance_sampling)"
        )
        rows.append(ExplainRow(key, value, _source(key, loaded.sources, default=DEFAULT_SOURCE), True, effect))
    known = known_keys()
    for top, value in loaded.no_effect.items():
        leaves = [top] if not (isinstance(value, dict) and value) else [f"{top}.{k}" for k in leaf_paths(value)]
        for key in leaves:
            rows.append(
                ExplainRow(
                    key,
                    value if key == top else _value_at(value, key[len(top) + 1 :]),  # type: ignore[arg-type]
                    _source(key, loaded.sources, default=DEFAULT_SOURCE),
                    False,
                    "no effect: " + known.reason(key),
                )
            )
    return rows


def _short_source(source: str, base: Path | None) -> str:
    if source.startswith("(") or source == OVERRIDE_SOURCE or base is None:
        return source
    try:
        return os.path.relpath(source, base)
    except ValueError:
        return source


def _short_value(value: JSONValue, width: int) -> str:
    text = json.dumps(value, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 3] + "..."


def render_text(loaded: LoadedConfig, rows: list[ExplainRow], *, width: int = 80) -> str:
    """The table as text that reads in ``width`` columns: ``key = value`` then ``  [source] effect``."""
    base = loaded.files[-1].parent if loaded.files else None
    implemented = [r for r in rows if r.implemented]
    ignored = [r for r in rows if not r.implemented]
    lines = [
        f"config: {loaded.files[-1].name if loaded.files else 'embedded default'}"
        + (f" (+{len(loaded.files) - 1} parent files)" if len(loaded.files) > 1 else ""),
        f"{len(implemented)} keys implemented, {len(ignored)} with no effect in megatron-fp8",
    ]
    for title, group in (("implemented", implemented), ("no effect in megatron-fp8", ignored)):
        if not group:
            continue
        lines += ["", f"== {title} =="]
        for row in group:
            head = f"{row.key} = "
            if len(head) > width - 16:  # a long key: the value goes on its own line
                lines += [row.key, "  = " + _short_value(row.value, width - 4)]
            else:
                lines.append(head + _short_value(row.value, width - len(head)))
            detail = f"[{_short_source(row.source, base)}] {row.effect}"
            lines += textwrap.wrap(detail, width=width, initial_indent="    ", subsequent_indent="      ")
    return "\n".join(lines) + "\n"


def render_json(loaded: LoadedConfig, rows: list[ExplainRow]) -> str:
    """The full table as JSON: ``{"files": [...], "keys": [{key, value, source, implemented, effect}, ...]}``."""
    return json.dumps({"files": [str(f) for f in loaded.files], "keys": [asdict(r) for r in rows]}, indent=1)
