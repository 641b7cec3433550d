"""Cross-field validation of a :class:`~megatron_fp8.config.schema.RunConfig`, and the TP divisibility rule.

TP divisibility (128x128 blockwise FP8 in vLLM): vLLM checks every linear layer
when it builds a blockwise FP8 model. Column-parallel layers are split along the
output dimension N: each TP partition, and each fused shard of a merged layer
(q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj``; merged layers are checked
even at TP 1), must be a multiple of the block N. Row-parallel layers
(``o_proj``, ``down_proj``) are split along the input dimension K: with TP > 1
each partition must be a multiple of the block K. KV heads fewer than TP ranks
are replicated, one head per rank.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from megatron_fp8.config.models import ModelDims
from megatron_fp8.config.schema import RunConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.layout import is_blockable
from megatron_fp8.recipes.registry import FP32_BLOCK_SCALES_ENV, fp8_recipe_names
from megatron_fp8.vocab import ARMS


@dataclass(frozen=True)
class _Shard:
    projection: str
    size: int
    explain: str


def _shards(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tp: int,
    moe_intermediate_size: int | None,
) -> tuple[list[str], list[_Shard]]:
    problems: list[str] = []
    if num_heads % tp:
        problems.append(f"q_proj: {num_heads} attention heads do not split over TP {tp}")
    if num_kv_heads >= tp and num_kv_heads % tp:
        problems.append(f"k_proj/v_proj: {num_kv_heads} KV heads do not split over TP {tp}")
    kv_per_rank = max(num_kv_heads // tp, 1)
    shards = [
        _Shard("q_proj", num_heads * head_dim // tp, f"{num_heads} heads x head_dim {head_dim} / TP {tp}"),
        _Shard(
            "k_proj/v_proj",
            kv_per_rank * head_dim,
            f"{kv_per_rank} KV head(s) per rank x head_dim {head_dim}"
            + (" (KV heads replicated: fewer than TP ranks)" if num_kv_heads < tp else ""),
        ),
        _Shard("gate_proj/up_proj", intermediate_size // tp, f"intermediate_size {intermediate_size} / TP {tp}"),
    ]
    if intermediate_size % tp:
        problems.append(f"gate_proj/up_proj: intermediate_size {intermediate_size} does not split over TP {tp}")
    if tp > 1:
        shards.append(_Shard("o_proj (input)", num_heads * head_dim // tp, f"{num_heads * head_dim} / TP {tp}"))
        shards.append(_Shard("down_proj (input)", intermediate_size // tp, f"{intermediate_size} / TP {tp}"))
    if moe_intermediate_size:
        if moe_intermediate_size % tp:
            problems.append(f"experts: moe_intermediate_size {moe_intermediate_size} does not split over TP {tp}")
        shards.append(
            _Shard(
                "experts gate_proj/up_proj/down_proj",
                moe_intermediate_size // tp,
                f"moe_intermediate_size {moe_intermediate_size} / TP {tp}",
            )
        )
    return problems, shards


def _tp_problems(block: int, **dims: int | None) -> list[str]:
    problems, shards = _shards(**dims)  # type: ignore[arg-type]
    for shard in shards:
        if not is_blockable(0, shard.size, block):
            problems.append(
                f"{shard.projection}: {shard.size} per TP rank ({shard.explain}) is not a multiple of {block}"
            )
    return problems


def tp_sizes_that_work(
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    moe_intermediate_size: int | None = None,
    block: int = 128,
    candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
) -> tuple[int, ...]:
    """TP sizes (from ``candidates``) for which every partition fits the 128x128 blockwise format."""
    return tuple(
        tp
        for tp in candidates
        if not _tp_problems(
            block,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            tp=tp,
            moe_intermediate_size=moe_intermediate_size,
        )
    )


def validate_tp_divisibility(
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tp: int,
    *,
    moe_intermediate_size: int | None = None,
    block: int = 128,
    key: str = "tensor_parallel_size",
) -> None:
    """Check that TP ``tp`` splits every projection into whole ``block``-sized FP8 blocks.

    Args:
        hidden_size: model width (elements).
        intermediate_size: dense MLP width (elements).
        num_heads: query heads.
        num_kv_heads: key/value heads.
        head_dim: elements per head.
        tp: tensor-parallel size (>= 1).
        moe_intermediate_size: expert MLP width for MoE models.
        block: FP8 block edge (elements), 128 for the DeepSeek format.
        key: config key named in the error message.

    Raises:
        ConfigError: naming each projection that breaks and the TP sizes that work for this model.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"{key} must be an integer >= 1, got {tp!r}")
    dims = dict(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        moe_intermediate_size=moe_intermediate_size,
    )
    problems = _tp_problems(block, tp=tp, **dims)
    if problems:
        ok = tp_sizes_that_work(block=block, **dims)  # type: ignore[arg-type]
        suggestion = f"TP sizes that work for this model: {', '.join(map(str, ok))}" if ok else "no TP size works"
        raise ConfigError(
            f"{key}={tp} breaks {block}x{block} blockwise FP8: " + "; ".join(problems) + f". Set {key} to one of "
            f"the working sizes ({suggestion}) or use BF16 rollout"
        )


def _dims_of(cfg: RunConfig) -> ModelDims | None:
    m = cfg.model
    needed = (m.hidden_size, m.intermediate_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim)
    if any(v is None for v in needed):
        return None
    return ModelDims(
        num_layers=m.num_layers or 0,
        hidden_size=m.hidden_size,  # type: ignore[arg-type]
        intermediate_size=m.intermediate_size,  # type: ignore[arg-type]
        num_attention_heads=m.num_attention_heads,  # type: ignore[arg-type]
        num_key_value_heads=m.num_key_value_heads,  # type: ignore[arg-type]
        head_dim=m.head_dim,  # type: ignore[arg-type]
        moe_intermediate_size=m.moe_intermediate_size,
        num_experts=m.num_experts or 0,
    )


def validate_config(cfg: RunConfig) -> None:
    """Check the cross-field rules; raise one :class:`ConfigError` listing every problem and its fix."""
    errors: list[str] = []
    vllm = cfg.policy.generation.vllm_cfg
    mcfg = cfg.policy.megatron_cfg
    fp8 = mcfg.fp8_cfg
    v = "policy.generation.vllm_cfg"

    qc = vllm.quantization_config
    if qc is not None and qc.weight_block_size is not None:
        missing = [k for k in ("quant_method", "fmt", "activation_scheme") if getattr(qc, k) is None]
        if missing:
            errors.append(
                f"{v}.quantization_config has weight_block_size but lacks "
                + ", ".join(f"{v}.quantization_config.{k}" for k in missing)
                + " (set quant_method: fp8, fmt: e4m3, activation_scheme: dynamic)"
            )
        if len(qc.weight_block_size) != 2 or any(b <= 0 for b in qc.weight_block_size):
            errors.append(
                f"{v}.quantization_config.weight_block_size must be two positive ints [block_n, block_k], "
                f"got {list(qc.weight_block_size)}"
            )
    if qc is not None and vllm.precision != "fp8":
        errors.append(f"{v}.quantization_config is set but {v}.precision is {vllm.precision!r}; set precision: fp8")

    if cfg.model.is_moe and vllm.precision == "fp8" and not cfg.rollout_blockwise:
        errors.append(
            f"model {cfg.model.name_or_path!r} is MoE: FP8 rollout must be blockwise, per-tensor is not supported; "
            f"set {v}.quantization_config.weight_block_size: [128, 128] (or drop quantization_config)"
        )
    if vllm.kv_cache_dtype == "fp8" and vllm.precision != "fp8":
        errors.append(f"{v}.kv_cache_dtype: fp8 needs {v}.precision: fp8 (got {vllm.precision!r})")
    if not 0.0 < vllm.gpu_memory_utilization <= 1.0:
        errors.append(f"{v}.gpu_memory_utilization must be in (0, 1], got {vllm.gpu_memory_utilization}")

    dims = _dims_of(cfg)
    if cfg.rollout_blockwise and dims is not None:
        block = qc.weight_block_size[0] if qc is not None and qc.weight_block_size else 128
        try:
            validate_tp_divisibility(
                dims.hidden_size,
                dims.intermediate_size,
                dims.num_attention_heads,
                dims.num_key_value_heads,
                dims.head_dim,
                vllm.tensor_parallel_size,
                moe_intermediate_size=dims.moe_intermediate_size,
                block=block,
                key=f"{v}.tensor_parallel_size",
            )
        except ConfigError as exc:
            errors.append(str(exc))

    if fp8.enabled:
        valid = fp8_recipe_names()
        if fp8.fp8_recipe not in valid:
            close = difflib.get_close_matches(fp8.fp8_recipe, valid, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            errors.append(
                f"policy.megatron_cfg.fp8_cfg.fp8_recipe {fp8.fp8_recipe!r} is not an FP8 recipe; {hint}valid: "
                + ", ".join(valid)
                + " (or set fp8_cfg.enabled: false for BF16 training)"
            )
        elif fp8.fp8_param and fp8.fp8_recipe not in ("blockwise", "fp8_param"):
            errors.append(
                f"policy.megatron_cfg.fp8_cfg.fp8_param: true is supported with fp8_recipe: blockwise (the "
                f"'fp8_param' recipe), not {fp8.fp8_recipe!r}; set fp8_param: false or fp8_recipe: blockwise"
            )
        elif fp8.fp8_recipe == "delayed" and (fp8.num_first_layers_in_bf16 or fp8.num_last_layers_in_bf16):
            errors.append(
                "policy.megatron_cfg.fp8_cfg: delayed scaling cannot keep first/last layers in BF16; set "
                "num_first_layers_in_bf16 and num_last_layers_in_bf16 to 0 or use fp8_recipe: tensorwise/blockwise"
            )
        if cfg.training_recipe in ("blockwise", "fp8_param"):
            value = mcfg.env_vars.get(FP32_BLOCK_SCALES_ENV)
            if value is not None and value != "1":
                errors.append(
                    f"policy.megatron_cfg.env_vars.{FP32_BLOCK_SCALES_ENV} is {value!r}; the blockwise recipe "
                    "needs '1' (float32 block scales, matching the rollout side); set it to \"1\" or remove it"
                )

    layers = cfg.model.num_layers
    for section, obj in (("policy.megatron_cfg.fp8_cfg", fp8), (v, vllm)):
        for key in ("num_first_layers_in_bf16", "num_last_layers_in_bf16"):
            value = getattr(obj, key)
            if value < 0:
                errors.append(f"{section}.{key} must be >= 0, got {value}")
        total = obj.num_first_layers_in_bf16 + obj.num_last_layers_in_bf16
        if layers and total > layers:
            errors.append(
                f"{section}: num_first_layers_in_bf16 + num_last_layers_in_bf16 = {total} exceeds the model's "
                f"{layers} layers; lower them"
            )

    for key in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
    ):
        if getattr(mcfg, key) < 1:
            errors.append(f"policy.megatron_cfg.{key} must be >= 1, got {getattr(mcfg, key)}")
    if vllm.tensor_parallel_size < 1:
        errors.append(f"{v}.tensor_parallel_size must be >= 1, got {vllm.tensor_parallel_size}")

    loss = cfg.loss_fn
    if loss.is_cap <= 0:
        errors.append(f"loss_fn.is_cap must be > 0, got {loss.is_cap}")
    if loss.is_lower is not None and loss.is_lower < 0:
        errors.append(f"loss_fn.is_lower must be >= 0, got {loss.is_lower}")
    if loss.is_lower is not None and loss.is_upper is not None and loss.is_lower >= loss.is_upper:
        errors.append(f"loss_fn.is_lower ({loss.is_lower}) must be below loss_fn.is_upper ({loss.is_upper})")
    if not 0.0 <= loss.ratio_clip_min < 1.0:
        errors.append(
            f"loss_fn.ratio_clip_min is the PPO clip epsilon below 1: must be in [0, 1), got {loss.ratio_clip_min}"
        )
    if loss.ratio_clip_max < 0.0:
        errors.append(
            f"loss_fn.ratio_clip_max is the PPO clip epsilon above 1: must be >= 0, got {loss.ratio_clip_max}"
        )
    if loss.log_ratio_clamp <= 0:
        errors.append(f"loss_fn.log_ratio_clamp must be > 0, got {loss.log_ratio_clamp}")

    g = cfg.grpo
    for key in (
        "num_steps",
        "num_prompts_per_step",
        "num_generations_per_prompt",
        "max_new_tokens",
        "task_max_digits",
        "updates_per_step",
    ):
        if getattr(g, key) < 1:
            errors.append(f"grpo.{key} must be >= 1, got {getattr(g, key)}")
    if g.temperature <= 0:
        errors.append(f"grpo.temperature must be > 0, got {g.temperature}")
    if g.learning_rate <= 0:
        errors.append(f"grpo.learning_rate must be > 0, got {g.learning_rate}")
    if not g.arms:
        errors.append(f"grpo.arms is empty; choose from {', '.join(ARMS)}")
    unknown = [a for a in g.arms if a not in ARMS]
    if unknown:
        errors.append(f"grpo.arms has unknown arm(s) {unknown}; valid arms: {', '.join(ARMS)}")
    if len(set(g.arms)) != len(g.arms):
        errors.append(f"grpo.arms lists an arm twice: {list(g.arms)}")
    if g.warmup_steps < 0:
        errors.append(f"grpo.warmup_steps must be >= 0, got {g.warmup_steps}")
    if g.warm_start_steps < 0:
        errors.append(f"grpo.warm_start_steps must be >= 0, got {g.warm_start_steps}")
    if g.warm_start_learning_rate <= 0:
        errors.append(f"grpo.warm_start_learning_rate must be > 0, got {g.warm_start_learning_rate}")
    if g.num_generations_per_prompt < 2:
        errors.append(
            f"grpo.num_generations_per_prompt is {g.num_generations_per_prompt}: GRPO normalises rewards within a "
            "group, which needs at least 2 generations per prompt"
        )

    if cfg.refit.bucket_size_mb < 1:
        errors.append(f"refit.bucket_size_mb must be >= 1, got {cfg.refit.bucket_size_mb}")
    if cfg.refit.timeout_s <= 0:
        errors.append(f"refit.timeout_s must be > 0, got {cfg.refit.timeout_s}")
    if not 0.0 < cfg.kv_cache.percentile <= 100.0:
        errors.append(f"kv_cache.percentile must be in (0, 100], got {cfg.kv_cache.percentile}")
    if cfg.kv_cache.margin < 1.0:
        errors.append(f"kv_cache.margin must be >= 1.0, got {cfg.kv_cache.margin}")
    if cfg.logging.log_every < 1:
        errors.append(f"logging.log_every must be >= 1, got {cfg.logging.log_every}")

    if errors:
        raise ConfigError("invalid run config:\n  - " + "\n  - ".join(errors))
