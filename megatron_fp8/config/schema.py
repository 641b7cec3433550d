"""The run configuration schema: frozen dataclasses, NeMo-RL key names where they exist.

Layout (dotted paths)::

    model.{name_or_path, is_moe, num_layers, hidden_size, intermediate_size, num_attention_heads,
           num_key_value_heads, head_dim, moe_intermediate_size, num_experts}
    policy.{model_name (NeMo-RL's model.name_or_path), train_global_batch_size, train_micro_batch_size, logprob_batch_size}
    policy.sequence_packing.{enabled, train_mb_tokens, logprob_mb_tokens, algorithm, microbatch_order}
    policy.dynamic_batching.{enabled, train_mb_tokens, logprob_mb_tokens, sequence_length_round}
    policy.megatron_cfg.{enabled, tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size,
                         activation_checkpointing, recompute_granularity, recompute_modules}
    policy.megatron_cfg.fp8_cfg.{enabled, fp8, fp8_recipe, fp8_param, num_first_layers_in_bf16, num_last_layers_in_bf16}
    policy.megatron_cfg.optimizer.{lr, min_lr, weight_decay, adam_beta1, adam_beta2, adam_eps, clip_grad,
                                   use_distributed_optimizer}
    policy.megatron_cfg.scheduler.{lr_warmup_iters, lr_warmup_init, lr_decay_style, lr_decay_iters}
    policy.megatron_cfg.env_vars.{NAME: value}                     (null = none)
    policy.generation.vllm_cfg.{precision, use_deep_gemm, gpu_memory_utilization,
                                num_first_layers_in_bf16, num_last_layers_in_bf16,
                                pow2_weight_scaling_factors, pow2_activation_scaling_factors,
                                kv_cache_dtype, tensor_parallel_size, max_model_len,
                                quantization_ignored_layer_kws, is_mx, quantization_config}
    loss_fn.{use_importance_sampling_correction, is_variant, is_cap, is_lower, is_upper,
             ratio_clip_min, ratio_clip_max, log_ratio_clamp, reference_policy_kl_penalty,
             reference_policy_kl_type, kl_input_clamp_value, kl_output_clamp_value,
             use_on_policy_kl_approximation, token_level_loss, force_on_policy_ratio, ratio_clip_c}
    policy.generation.{max_new_tokens, temperature}; policy.generation.colocated.{enabled, sleep_level, resources.{...}}
    policy.{offload_optimizer_for_logprob, precision}; policy.megatron_cfg.{empty_unused_memory_level, optimizer.optimizer_cpu_offload}
    grpo.{max_num_steps, num_prompts_per_step, num_generations_per_prompt, seed, arms, task, task_max_digits, updates_per_step,
          warm_start_steps, warm_start_learning_rate, val_period, val_at_start, max_val_samples,
          normalize_rewards, use_leave_one_out_baseline, async_grpo.{enabled, max_trajectory_age_steps},
          reward_scaling.{...}, reward_shaping.{...}, overlong_filtering,
          use_dynamic_sampling, batch_multiplier, dynamic_sampling_max_gen_batches}
    data.{max_input_seq_length, shuffle, train.{data_path, input_key, output_key, max_samples, split_validation_size, seed},
          validation.{...as train}, default.{prompt_file, system_prompt_file, env_name}}
    checkpointing.{enabled, checkpoint_dir, save_period, keep_top_k, metric_name, higher_is_better, save_consolidated}
    logger.{log_dir, tensorboard_enabled, wandb_enabled, wandb.{project, name}}
    rollout.{engine}; refit.{bucket_size_mb, timeout_s, verify, transport}
    kv_cache.{percentile, margin}; logging.{level}; out_dir
Every other NeMo-RL key is accepted with no effect (listed in a warning at load; the key set is data:
``megatron_fp8/config/nemo_rl/keys.yaml``); a key in neither is rejected with a did-you-mean.

Aliases (older or NeMo-RL spellings, accepted on input, never written out) are declared per section in ``ALIASES``:
``use_weight_pow2_scale`` -> ``pow2_weight_scaling_factors``, ``use_activation_pow2_scale`` ->
``pow2_activation_scaling_factors``. Value aliases (NeMo-RL spellings of a value) are declared per section in ``VALUE_ALIASES``: ``vllm_cfg.precision: bfloat16``
-> ``bf16``, ``vllm_cfg.kv_cache_dtype: fp8_e4m3`` -> ``fp8``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Annotated, ClassVar, Literal, TypeAlias

import yaml

from megatron_fp8 import vocab
from megatron_fp8.config.data_schema import AsyncGRPOConfig as AsyncGRPOConfig
from megatron_fp8.config.data_schema import DataConfig as DataConfig
from megatron_fp8.config.data_schema import DataDefaultsConfig as DataDefaultsConfig
from megatron_fp8.config.data_schema import DatasetConfig as DatasetConfig
from megatron_fp8.config.data_schema import DynamicBatchingConfig as DynamicBatchingConfig
from megatron_fp8.config.data_schema import GRPOConfig as GRPOConfig
from megatron_fp8.config.data_schema import RewardScalingConfig as RewardScalingConfig
from megatron_fp8.config.data_schema import RewardShapingConfig as RewardShapingConfig
from megatron_fp8.config.data_schema import SequencePackingConfig as SequencePackingConfig
from megatron_fp8.config.outputs_schema import CheckpointingConfig, LoggerConfig, LoggingConfig
from megatron_fp8.config.outputs_schema import WandbConfig as WandbConfig
from megatron_fp8.recipes.registry import FP8_FORMATS

JSONValue: TypeAlias = "str | int | float | bool | None | list[JSONValue] | dict[str, JSONValue]"  # YAML / JSON data


@dataclass(frozen=True)
class OneOf:
    """Schema marker on a ``str`` field: the value must be one of ``choices``.

    Used as ``Annotated[str, OneOf(...)]`` for the closed sets declared in :mod:`megatron_fp8.vocab`, so
    the schema names the set instead of spelling it; the loader treats it like a ``Literal``. ``choices``:
    the valid values, in the order messages list them.
    """

    choices: tuple[str, ...]


Fp8Format = Annotated[str, OneOf(tuple(FP8_FORMATS))]
"""Megatron-Core ``TransformerConfig.fp8`` format, a key of :data:`megatron_fp8.recipes.registry.FP8_FORMATS`."""

RolloutPrecision = Annotated[str, OneOf(vocab.ROLLOUT_PRECISIONS)]
"""Rollout weight precision, one of :data:`megatron_fp8.vocab.ROLLOUT_PRECISIONS`."""

ISVariant = Annotated[str, OneOf(tuple(vocab.IS_VARIANTS))]
"""Importance-sampling variant, a key of :data:`megatron_fp8.vocab.IS_VARIANTS`."""

KLEstimator = Annotated[str, OneOf(tuple(vocab.KL_ESTIMATORS))]
"""KL estimator of the reference-policy penalty, a key of :data:`megatron_fp8.vocab.KL_ESTIMATORS`."""

RefitTransport = Annotated[str, OneOf(("auto", *vocab.TRANSPORTS))]
"""Refit transport between separate ranks: ``"auto"`` or a key of :data:`megatron_fp8.vocab.TRANSPORTS`."""

RolloutEngine = Annotated[str, OneOf(tuple(vocab.ROLLOUT_ENGINES))]
"""Rollout engine, a key of :data:`megatron_fp8.vocab.ROLLOUT_ENGINES`."""


@dataclass(frozen=True)
class ModelConfig:
    """Which model, and its dimensions when megatron-fp8 does not know them.

    Attributes:
        name_or_path: ``"tiny"``, ``"tiny-moe"``, a Hugging Face repo id or a local path.
        is_moe: whether the model has routed experts; ``None`` = derive from the known dims.
        num_layers: decoder layers; this and the next fields ``None`` = from the known-model table.
        hidden_size, intermediate_size, head_dim, moe_intermediate_size (MoE only): widths (elements).
        num_attention_heads, num_key_value_heads, num_experts: query / key-value heads, routed experts per layer.
    """

    name_or_path: str = "tiny"
    is_moe: bool | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    moe_intermediate_size: int | None = None
    num_experts: int | None = None


@dataclass(frozen=True)
class FP8TrainConfig:
    """``policy.megatron_cfg.fp8_cfg`` (NeMo-RL names).

    Attributes:
        enabled: train with FP8 at all.
        fp8: Megatron-Core format, ``"e4m3"`` or ``"hybrid"``.
        fp8_recipe: a recipe of :mod:`megatron_fp8.recipes` (tensorwise, blockwise, fp8_param, delayed, mxfp8).
        fp8_param: FP8 primary weights; with ``fp8_recipe: blockwise`` this is the ``fp8_param`` recipe.
        num_first_layers_in_bf16, num_last_layers_in_bf16: training layers at the start / end kept in BF16.
    """

    enabled: bool = False
    fp8: Fp8Format = "e4m3"
    fp8_recipe: str = "blockwise"
    fp8_param: bool = False
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0


@dataclass(frozen=True)
class OptimizerConfig:
    """``policy.megatron_cfg.optimizer``.

    Attributes:
        lr: peak learning rate (``policy.megatron_cfg.scheduler`` warms up to it and decays from it).
        min_lr: the learning rate a decaying schedule ends at.
        weight_decay: decoupled, not on 1-D params.
        adam_beta1, adam_beta2, adam_eps: Adam's coefficients.
        clip_grad: gradient-norm clip (L2).
        use_distributed_optimizer: shard the FP32 main weights and Adam moments over the data-parallel ranks.
        optimizer_cpu_offload: keep the Adam state and step in host memory (Megatron-Core's HybridDeviceOptimizer on
            a GPU; needs ``use_distributed_optimizer``); the colocated schedule leaves it there.
        optimizer_offload_fraction: the share of the optimizer state ``optimizer_cpu_offload`` keeps in host memory,
            in (0, 1] (Megatron-Core's); 0 without ``optimizer_cpu_offload``.
        initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis: ``policy.precision: float16``'s dynamic
            loss scale, Megatron-Core ``OptimizerConfig``'s fields and defaults (NeMo-RL passes this section to it).
    """

    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


@dataclass(frozen=True)
class SchedulerConfig:
    """``policy.megatron_cfg.scheduler``: Megatron-Core's learning-rate schedule, one tick per GRPO step (NeMo-RL's
    meaning: step ``s`` trains at the rate Megatron-Core's ``OptimizerParamScheduler`` gives after ``s`` ticks).

    Attributes:
        lr_warmup_iters: steps of linear warm-up from ``lr_warmup_init`` to ``optimizer.lr`` (0 = none).
        lr_warmup_init: the rate of step 0 of a warm-up (``None``: 10% of ``optimizer.lr``; NeMo-RL's configs set it).
        lr_decay_style: one of :data:`megatron_fp8.vocab.LR_DECAY_STYLES`; after the warm-up, from ``optimizer.lr`` to ``optimizer.min_lr``.
        lr_decay_iters: the step the decay reaches ``min_lr`` (``None``: ``grpo.max_num_steps``).
    """

    lr_warmup_iters: int = 0
    lr_warmup_init: float | None = None
    lr_decay_style: Annotated[str, OneOf(vocab.LR_DECAY_STYLES)] = "constant"
    lr_decay_iters: int | None = None


@dataclass(frozen=True)
class MegatronConfig:
    """``policy.megatron_cfg`` (NeMo-RL names).

    Attributes:
        enabled: train through Megatron-Core.
        tensor_model_parallel_size: training TP.
        pipeline_model_parallel_size: training PP.
        expert_model_parallel_size: training EP (MoE: routed experts split over the data-parallel ranks).
        activation_checkpointing: recompute activations in the backward pass (Megatron-Core's recompute).
        recompute_granularity: ``"full"`` (every layer, uniform, one at a time) or ``"selective"``.
        recompute_modules: the modules of ``"selective"`` (Megatron-Core's names; ``None`` = ``["core_attn"]``).
        fp8_cfg: FP8 training settings.
        optimizer: optimizer settings.
        scheduler: learning-rate schedule.
        env_vars: environment variables set for the training workers (values as strings; ``null`` = none).
        empty_unused_memory_level: Megatron's ``torch.cuda.empty_cache()`` points: 0 none, 1 after each forward /
            backward, 2 also after each optimizer step (0, 1 or 2; no effect without CUDA).
    """

    enabled: bool = True
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    activation_checkpointing: bool = False
    recompute_granularity: Literal["full", "selective"] = "full"
    recompute_modules: tuple[str, ...] | None = None
    fp8_cfg: FP8TrainConfig = field(default_factory=FP8TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    env_vars: dict[str, str] = field(default_factory=dict)
    empty_unused_memory_level: int = 0


@dataclass(frozen=True)
class QuantizationConfig:
    """``policy.generation.vllm_cfg.quantization_config``: the explicit vLLM ``hf_overrides`` entry.

    With ``weight_block_size`` the rollout is blockwise (then ``quant_method``, ``fmt`` and
    ``activation_scheme`` are required); without it, vLLM quantizes per tensor.

    Attributes:
        quant_method: ``"fp8"``.
        fmt: ``"e4m3"``.
        activation_scheme: ``"dynamic"`` (per-token groups) or ``"static"``.
        weight_block_size: ``[block_n, block_k]``, e.g. ``[128, 128]``.
        ignored_layers: module names vLLM keeps in BF16.
    """

    quant_method: Literal["fp8"] | None = None
    fmt: Literal["e4m3"] | None = None
    activation_scheme: Literal["dynamic", "static"] | None = None
    weight_block_size: tuple[int, ...] | None = None
    ignored_layers: tuple[str, ...] = ()


@dataclass(frozen=True)
class VllmConfig:
    """``policy.generation.vllm_cfg`` (NeMo-RL names).

    Attributes:
        precision: rollout weights/activations, ``"bf16"`` or ``"fp8"``.
        use_deep_gemm: DeepGEMM kernels for blockwise FP8 GEMMs.
        gpu_memory_utilization: fraction of GPU memory vLLM may take, in (0, 1].
        num_first_layers_in_bf16: decoder layers at the start vLLM keeps in BF16.
        num_last_layers_in_bf16: decoder layers at the end vLLM keeps in BF16.
        pow2_weight_scaling_factors: round weight scales up to powers of 2 (UE8M0); ``None`` (default) = what
            the rollout engine holds: on when its FP8 kernel path requantizes scales to UE8M0 (vLLM's DeepGEMM
            E8M0), so nothing is requantized, else off.
        pow2_activation_scaling_factors: round activation scales up to powers of 2.
        kv_cache_dtype: ``"auto"`` (model dtype) or ``"fp8"`` (needs ``precision: fp8``).
        tensor_parallel_size: rollout TP.
        max_model_len: the engine's context length (tokens); ``None`` = the engine default.
        quantization_ignored_layer_kws: substrings; every linear module whose name contains one is kept in
            BF16 by vLLM (added to the quantization config's ``ignored_layers``, hence to the manifest).
        is_mx: MXFP8 rollout (NeMo-RL, Blackwell only); refused: megatron-fp8's refit sends 128x128 blockwise.
        quantization_config: explicit vLLM quantization config; ``None`` = blockwise 128x128 dynamic.
    """

    precision: RolloutPrecision = "bf16"
    use_deep_gemm: bool = False
    gpu_memory_utilization: float = 0.5
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0
    pow2_weight_scaling_factors: bool | None = None
    pow2_activation_scaling_factors: bool = False
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    quantization_ignored_layer_kws: tuple[str, ...] = ()
    is_mx: bool = False
    quantization_config: QuantizationConfig | None = None

    ALIASES: ClassVar[dict[str, str]] = {
        "use_weight_pow2_scale": "pow2_weight_scaling_factors",
        "use_activation_pow2_scale": "pow2_activation_scaling_factors",
    }
    VALUE_ALIASES: ClassVar[dict[str, dict[str, str]]] = {
        "precision": {"bfloat16": "bf16"},
        "kv_cache_dtype": {"fp8_e4m3": "fp8"},
    }


@dataclass(frozen=True)
class ColocatedResources:
    """``policy.generation.colocated.resources``: the rollout ranks when generation is not colocated.

    Attributes:
        gpus_per_node: rollout ranks per node (one GPU each; processes on CPU).
        num_nodes: nodes of rollout ranks.
    """

    gpus_per_node: int | None = None
    num_nodes: int | None = None


@dataclass(frozen=True)
class ColocatedConfig:
    """``policy.generation.colocated`` (NeMo-RL names): trainer and engine on the same ranks, or apart.

    Attributes:
        enabled: ``True`` (default): every rank trains and rolls out on its own engine, refit in process.
            ``False``: the last ``num_nodes * gpus_per_node`` ranks only generate; trainer rank 0 sends each
            refit through ``refit.transport`` (what ``ROLLOUT_TASKS=N`` of ``slurm/grpo.sbatch`` sets up).
        resources: the rollout ranks when not colocated.
        sleep_level: the colocated engine's sleep while the trainer scores and trains, a key of
            :data:`megatron_fp8.vocab.SLEEP_LEVELS` (0: never sleeps); ``None``: 2 (every refit rewrites every weight).
    """

    enabled: bool = True
    sleep_level: int | None = None
    resources: ColocatedResources = field(default_factory=ColocatedResources)


@dataclass(frozen=True)
class GenerationConfig:
    """``policy.generation``.

    Attributes:
        backend: the rollout engine (only ``"vllm"``).
        max_new_tokens, temperature: generation length limit (tokens) and sampling temperature (also the
            temperature the trainer's log-probabilities are taken at).
        vllm_cfg: vLLM settings.
        colocated: trainer and rollout on the same ranks (default) or on separate ones.
    """

    backend: Literal["vllm"] = "vllm"
    max_new_tokens: int = 16
    temperature: float = 1.0
    vllm_cfg: VllmConfig = field(default_factory=VllmConfig)
    colocated: ColocatedConfig = field(default_factory=ColocatedConfig)


@dataclass(frozen=True)
class PolicyConfig:
    """``policy``.

    Attributes:
        model_name: NeMo-RL's spelling of ``model.name_or_path`` (either may be given, not both differently).
        train_global_batch_size: sequences per optimizer update over all ranks (``None``: the whole step).
        train_micro_batch_size: sequences per forward/backward on a rank, accumulated (``None``: one).
        logprob_batch_size: sequences per forward when the trainer scores a rollout (``None``: all at once).
        offload_optimizer_for_logprob: keep the optimizer state in host memory while the trainer scores the rollout
            too (colocated; otherwise it comes back before scoring), back before the update.
        sequence_packing: packed micro-batches of a token budget (supersedes the two batch sizes when enabled).
        dynamic_batching: micro-batches of similar-length rows up to a token budget (likewise).
        megatron_cfg: training settings.
        generation: rollout settings.
        precision: the trainer's weights and math, a key of :data:`megatron_fp8.vocab.TRAINING_PRECISIONS`.
    """

    model_name: str | None = None
    train_global_batch_size: int | None = None
    train_micro_batch_size: int | None = None
    logprob_batch_size: int | None = None
    offload_optimizer_for_logprob: bool = False
    sequence_packing: SequencePackingConfig = field(default_factory=SequencePackingConfig)
    dynamic_batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    megatron_cfg: MegatronConfig = field(default_factory=MegatronConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    precision: Annotated[str, OneOf(tuple(vocab.TRAINING_PRECISIONS))] = "bfloat16"


@dataclass(frozen=True)
class LossConfig:
    """``loss_fn``: clipped policy gradient with importance-sampling correction of the rollout mismatch.

    Attributes:
        use_importance_sampling_correction: NeMo-RL's switch of the IS correction. ``True`` / ``False``: the key
            decides, for every arm and rollout precision (a BF16 rollout corrects too, with weights near 1, as
            NeMo-RL); ``grpo.arms`` must agree (``fp8_tis`` needs ``True``, ``fp8`` needs ``False``). ``None``
            (not given): the arms decide (``fp8_tis`` corrects, ``bf16`` and ``fp8`` do not), megatron-fp8's
            side-by-side comparison. The correction never runs with ``is_variant: none``.
        is_variant: a key of :data:`megatron_fp8.vocab.IS_VARIANTS`.
        is_cap: truncation cap C of the IS weight (token TIS default 2.0; ``None``: no truncation, NeMo-RL's
            importance sampling without a truncation type).
        is_lower: lower ratio bound of the masking variants (``None`` = variant default).
        is_upper: upper ratio bound of the masking variants (``None`` = variant default).
        ratio_clip_min: PPO clip epsilon below 1 (ratio >= 1 - eps).
        ratio_clip_max: PPO clip epsilon above 1 (ratio <= 1 + eps).
        log_ratio_clamp: clamp |log ratio| to this before exponentiating (overflow guard).
        reference_policy_kl_penalty: weight beta of the KL penalty to the reference policy (the arm's initial
            weights) added to the loss; 0 = no penalty and no reference forward.
        reference_policy_kl_type: the per-token KL estimator, a key of :data:`megatron_fp8.vocab.KL_ESTIMATORS`.
        kl_input_clamp_value: clamp ``|log(pi_ref / pi)|`` to this before the estimator (``None``: no clamp).
        kl_output_clamp_value: clamp the per-token estimate to ``[-v, v]`` (``None``: no clamp).
        use_on_policy_kl_approximation: weight the per-token KL by ``pi / pi_rollout`` (the samples come from the
            rollout policy), with its gradient; otherwise by ``exp(logp - sg(logp))`` (value 1, the score-function
            gradient of the on-policy estimate).
        force_on_policy_ratio: the PPO ratio's old policy is the training forward itself (ratio 1; NeMo-RL's key):
            the IS weights then compare it with the generating policy; one optimizer update per step.
        ratio_clip_c: dual-clip PPO's ``C > 1``: a token with a negative advantage loses at most ``-A C`` (NeMo-RL's
            key; ``None``: off).
        token_level_loss: average the loss over every response token of the update (``True``), or per sequence
            first, then over sequences (``False``).
    """

    use_importance_sampling_correction: bool | None = None
    is_variant: ISVariant = "token_tis"
    is_cap: float | None = 2.0
    is_lower: float | None = None
    is_upper: float | None = None
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    log_ratio_clamp: float = 20.0
    reference_policy_kl_penalty: float = 0.0
    reference_policy_kl_type: KLEstimator = "k3"
    kl_input_clamp_value: float | None = 20.0
    kl_output_clamp_value: float | None = 10.0
    use_on_policy_kl_approximation: bool = False
    token_level_loss: bool = True
    force_on_policy_ratio: bool = False
    ratio_clip_c: float | None = None

    @property
    def kl_enabled(self) -> bool:
        """Whether the loss has a KL penalty to the reference policy (and the step a reference forward)."""
        return self.reference_policy_kl_penalty != 0

    @property
    def aggregation(self) -> str:
        """The loss aggregation of ``token_level_loss``, a key of :data:`megatron_fp8.rl.algorithm.correction.LOSS_AGGREGATIONS`."""
        return "token-mean" if self.token_level_loss else "seq-mean-token-mean"

    @property
    def correction_enabled(self) -> bool:
        """Whether the key turns the IS correction on for every arm (``False`` also when the arms decide)."""
        return bool(self.use_importance_sampling_correction) and self.is_variant != "none"

    def arm_corrects(self, arm: str) -> bool:
        """Whether the arm ``arm`` (a key of :data:`megatron_fp8.vocab.ARMS`) puts the IS weights in its loss.

        ``use_importance_sampling_correction`` decides when it is given, the arm when it is not; never with
        ``is_variant: none``.
        """
        if self.is_variant == "none":
            return False
        if self.use_importance_sampling_correction is None:
            return vocab.ARMS[arm].correct
        return self.use_importance_sampling_correction


@dataclass(frozen=True)
class RolloutConfig:
    """``rollout``: which engine generates the GRPO samples.

    Attributes:
        engine: a key of :data:`megatron_fp8.vocab.ROLLOUT_ENGINES`.
    """

    engine: RolloutEngine = "auto"


@dataclass(frozen=True)
class RefitConfig:
    """``refit``: moving weights trainer -> vLLM after each step.

    Attributes:
        bucket_size_mb: transfer bucket size in MiB.
        timeout_s: per-bucket peer timeout in seconds.
        verify: read back and compare after every refit.
        transport: how a refit reaches separate rollout ranks (``policy.generation.colocated.enabled: false``):
            ``"auto"`` = NCCL on GPUs, gloo on CPU; colocated refits stay in process.
    """

    bucket_size_mb: int = 512
    timeout_s: float = 120.0
    verify: bool = True
    transport: RefitTransport = "auto"


@dataclass(frozen=True)
class KVCacheConfig:
    """``kv_cache``: FP8 KV-cache scale calibration.

    Attributes:
        percentile: per layer, percentile (0-100] of the per-call amax.
        margin: multiplier (>= 1) on that percentile before dividing by 448.
    """

    percentile: float = 99.9
    margin: float = 1.05


@dataclass(frozen=True)
class RunConfig:
    """The whole run configuration (see the module docstring for the layout)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    loss_fn: LossConfig = field(default_factory=LossConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    out_dir: str | None = None

    @property
    def training_recipe(self) -> str:
        """The :mod:`megatron_fp8.recipes` name the trainer uses (``"bf16"`` when FP8 training is off)."""
        fp8 = self.policy.megatron_cfg.fp8_cfg
        if not fp8.enabled:
            return "bf16"
        if fp8.fp8_param and fp8.fp8_recipe == "blockwise":
            return "fp8_param"
        return fp8.fp8_recipe

    @property
    def rollout_blockwise(self) -> bool:
        """Whether the FP8 rollout uses block scales (``False`` = per tensor or BF16 rollout)."""
        vllm = self.policy.generation.vllm_cfg
        if vllm.precision != "fp8":
            return False
        qc = vllm.quantization_config
        return qc is None or qc.weight_block_size is not None

    def to_dict(self) -> dict[str, JSONValue]:
        """Plain nested dict (tuples as lists) that :func:`megatron_fp8.config.load_config` reads back."""
        return {k: _plain(v) for k, v in asdict(self).items()}

    def dump_yaml(self) -> str:
        """The config as YAML text."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _plain(value: object) -> JSONValue:
    """``value`` with tuples turned into lists, recursively (the leaves of ``asdict`` are JSON scalars)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"config value {value!r} of type {type(value).__name__} is not plain data")  # schema bug
