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
from collections.abc import Callable
from dataclasses import dataclass

from megatron_fp8 import vocab
from megatron_fp8.config.algorithm_rules import (
    async_rules,
    batching_rules,
    dynamic_sampling_rules,
    loss_rules,
    loss_scale_rules,
    reward_rules,
    scheduler_rules,
)
from megatron_fp8.config.memory_plan import memory_rules
from megatron_fp8.config.schema import FP8TrainConfig, RunConfig, VllmConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.layout import is_blockable
from megatron_fp8.models.dims import ModelDims
from megatron_fp8.recipes.registry import FP32_BLOCK_SCALES_ENV, RECIPES, fp8_recipe_names


@dataclass(frozen=True)
class _Shard:
    projection: str
    size: int
    explain: str


@dataclass(frozen=True)
class _Widths:
    """The projection widths TP splits (elements); one bundle for every TP rule below."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_intermediate_size: int | None

    @classmethod
    def of(cls, dims: ModelDims) -> _Widths:
        return cls(
            hidden_size=dims.hidden_size,
            intermediate_size=dims.intermediate_size,
            num_heads=dims.num_attention_heads,
            num_kv_heads=dims.num_key_value_heads,
            head_dim=dims.head_dim,
            moe_intermediate_size=dims.moe_intermediate_size,
        )


def _shards(w: _Widths, tp: int) -> tuple[list[str], list[_Shard]]:
    intermediate_size, num_heads, num_kv_heads, head_dim = w.intermediate_size, w.num_heads, w.num_kv_heads, w.head_dim
    moe_intermediate_size = w.moe_intermediate_size
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


def _tp_problems(w: _Widths, *, tp: int, block: int) -> list[str]:
    problems, shards = _shards(w, tp)
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
    block: int = vocab.DEFAULT_BLOCK,
    candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
) -> tuple[int, ...]:
    """TP sizes (from ``candidates``) for which every partition fits the 128x128 blockwise format."""
    w = _Widths(hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, moe_intermediate_size)
    return tuple(tp for tp in candidates if not _tp_problems(w, tp=tp, block=block))


def validate_tp_divisibility(
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tp: int,
    *,
    moe_intermediate_size: int | None = None,
    block: int = vocab.DEFAULT_BLOCK,
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
    widths = _Widths(hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, moe_intermediate_size)
    problems = _tp_problems(widths, tp=tp, block=block)
    if problems:
        ok = tp_sizes_that_work(
            hidden_size,
            intermediate_size,
            num_heads,
            num_kv_heads,
            head_dim,
            moe_intermediate_size=moe_intermediate_size,
            block=block,
        )
        suggestion = f"TP sizes that work for this model: {', '.join(map(str, ok))}" if ok else "no TP size works"
        raise ConfigError(
            f"{key}={tp} breaks {block}x{block} blockwise FP8: " + "; ".join(problems) + f". Set {key} to one of "
            f"the working sizes ({suggestion}) or use BF16 rollout"
        )


def _dims_of(cfg: RunConfig) -> ModelDims | None:
    m = cfg.model
    if (
        m.hidden_size is None
        or m.intermediate_size is None
        or m.num_attention_heads is None
        or m.num_key_value_heads is None
        or m.head_dim is None
    ):
        return None
    return ModelDims(
        num_layers=m.num_layers or 0,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        head_dim=m.head_dim,
        moe_intermediate_size=m.moe_intermediate_size,
        num_experts=m.num_experts or 0,
    )


# --------------------------------------------------------------------------- cross-field rules

_VLLM = "policy.generation.vllm_cfg"
_FP8 = "policy.megatron_cfg.fp8_cfg"

Rule = Callable[[RunConfig], list[str]]
"""One cross-field rule: the run config -> its problems (each naming the dotted key and the fix), ``[]`` if none."""


def _at_least(section: str, obj: object, keys: tuple[str, ...], minimum: int) -> list[str]:
    """``{section}.{key} must be >= {minimum}`` for each of ``keys`` whose value on ``obj`` is below ``minimum``."""
    return [
        f"{section}.{key} must be >= {minimum}, got {getattr(obj, key)}" for key in keys if getattr(obj, key) < minimum
    ]


def quantization_config_rules(cfg: RunConfig) -> list[str]:
    """``vllm_cfg.quantization_config``: blockwise needs all four keys and a 2-D positive block; FP8 only."""
    vllm = cfg.policy.generation.vllm_cfg
    qc = vllm.quantization_config
    if qc is None:
        return []
    problems: list[str] = []
    where = f"{_VLLM}.quantization_config"
    if qc.weight_block_size is not None:
        missing = [k for k in ("quant_method", "fmt", "activation_scheme") if getattr(qc, k) is None]
        if missing:
            problems.append(
                f"{where} has weight_block_size but lacks "
                + ", ".join(f"{where}.{k}" for k in missing)
                + " (set quant_method: fp8, fmt: e4m3, activation_scheme: dynamic)"
            )
        if len(qc.weight_block_size) != 2 or any(b <= 0 for b in qc.weight_block_size):
            problems.append(
                f"{where}.weight_block_size must be two positive ints [block_n, block_k], "
                f"got {list(qc.weight_block_size)}"
            )
    if vllm.precision != "fp8":
        problems.append(f"{where} is set but {_VLLM}.precision is {vllm.precision!r}; set precision: fp8")
    return problems


def generation_rules(cfg: RunConfig) -> list[str]:
    """vLLM rollout: MoE FP8 rollout must be blockwise; memory fraction in (0, 1]; TP >= 1."""
    vllm = cfg.policy.generation.vllm_cfg
    problems: list[str] = []
    if cfg.model.is_moe and vllm.precision == "fp8" and not cfg.rollout_blockwise:
        problems.append(
            f"model {cfg.model.name_or_path!r} is MoE: FP8 rollout must be blockwise, per-tensor is not supported; "
            f"set {_VLLM}.quantization_config.weight_block_size: [128, 128] (or drop quantization_config)"
        )
    if not 0.0 < vllm.gpu_memory_utilization <= 1.0:
        problems.append(f"{_VLLM}.gpu_memory_utilization must be in (0, 1], got {vllm.gpu_memory_utilization}")
    problems += _at_least(_VLLM, vllm, ("tensor_parallel_size",), 1)
    return problems


def kv_cache_rules(cfg: RunConfig) -> list[str]:
    """FP8 KV cache needs FP8 rollout; calibration percentile in (0, 100] and margin >= 1."""
    vllm = cfg.policy.generation.vllm_cfg
    kv = cfg.kv_cache
    problems: list[str] = []
    if vllm.kv_cache_dtype == "fp8" and vllm.precision != "fp8":
        problems.append(f"{_VLLM}.kv_cache_dtype: fp8 needs {_VLLM}.precision: fp8 (got {vllm.precision!r})")
    if not 0.0 < kv.percentile <= 100.0:
        problems.append(f"kv_cache.percentile must be in (0, 100], got {kv.percentile}")
    if kv.margin < 1.0:
        problems.append(f"kv_cache.margin must be >= 1.0, got {kv.margin}")
    return problems


def tp_divisibility_rules(cfg: RunConfig) -> list[str]:
    """Blockwise FP8 rollout: the rollout TP splits every projection into whole blocks (module docstring)."""
    dims = _dims_of(cfg)
    if not cfg.rollout_blockwise or dims is None:
        return []
    vllm = cfg.policy.generation.vllm_cfg
    qc = vllm.quantization_config
    block = qc.weight_block_size[0] if qc is not None and qc.weight_block_size else vocab.DEFAULT_BLOCK
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
            key=f"{_VLLM}.tensor_parallel_size",
        )
    except ConfigError as exc:
        return [str(exc)]
    return []


BLOCKWISE_TRAINING_RECIPES = ("blockwise", "fp8_param")
"""Training recipes with 128x128 weight block scales: each trainer TP partition must hold whole blocks."""


def trainer_tp_rules(cfg: RunConfig) -> list[str]:
    """Trainer TP (``policy.megatron_cfg.tensor_model_parallel_size``) splits the heads, KV heads and MLP evenly;
    with a blockwise FP8 training recipe every partition holds whole 128x128 blocks (module docstring)."""
    dims = _dims_of(cfg)
    tp = cfg.policy.megatron_cfg.tensor_model_parallel_size
    if dims is None or tp <= 1:
        return []
    key = "policy.megatron_cfg.tensor_model_parallel_size"
    split = {
        "attention heads": dims.num_attention_heads,
        "KV heads (query groups)": dims.num_key_value_heads,
        "intermediate_size": dims.intermediate_size,
    }
    if dims.moe_intermediate_size:
        split["moe_intermediate_size"] = dims.moe_intermediate_size
    uneven = [f"{n} {what}" for what, n in split.items() if n % tp]
    working = [
        t
        for t in (1, 2, 4, 8, 16, 32, 64)
        if not any(n % t for n in split.values())
        and (cfg.training_recipe not in BLOCKWISE_TRAINING_RECIPES or _block_ok(dims, t))
    ]
    hint = f"; sizes that work for this model: {', '.join(map(str, working))}"
    if uneven:
        return [f"{key}={tp} does not split the model's {', '.join(uneven)} evenly (Megatron-Core needs it){hint}"]
    if cfg.training_recipe in BLOCKWISE_TRAINING_RECIPES and not _block_ok(dims, tp):
        return [
            f"{key}={tp} leaves trainer partitions that are not whole {vocab.DEFAULT_BLOCK}x{vocab.DEFAULT_BLOCK} "
            f"blocks under the {cfg.training_recipe!r} FP8 recipe{hint}"
        ]
    return []


def _block_ok(dims: ModelDims, tp: int) -> bool:
    """Every TP partition of the projections is a whole number of 128-blocks."""
    return not _tp_problems(_Widths.of(dims), tp=tp, block=vocab.DEFAULT_BLOCK)


def fp8_training_rules(cfg: RunConfig) -> list[str]:
    """``fp8_cfg``: a known FP8 recipe, ``fp8_param`` only with blockwise, no BF16 layers with delayed
    scaling, and float32 block scales in the environment of the blockwise recipes."""
    mcfg = cfg.policy.megatron_cfg
    fp8 = mcfg.fp8_cfg
    if not fp8.enabled:
        return []
    problems: list[str] = []
    valid = fp8_recipe_names()
    if fp8.fp8_recipe not in valid:
        close = difflib.get_close_matches(fp8.fp8_recipe, valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        problems.append(
            f"{_FP8}.fp8_recipe {fp8.fp8_recipe!r} is not an FP8 recipe; {hint}valid: "
            + ", ".join(valid)
            + " (or set fp8_cfg.enabled: false for BF16 training)"
        )
    elif fp8.fp8_param and fp8.fp8_recipe not in ("blockwise", "fp8_param"):
        problems.append(
            f"{_FP8}.fp8_param: true is supported with fp8_recipe: blockwise (the "
            f"'fp8_param' recipe), not {fp8.fp8_recipe!r}; set fp8_param: false or fp8_recipe: blockwise"
        )
    elif fp8.fp8_recipe == "delayed" and (fp8.num_first_layers_in_bf16 or fp8.num_last_layers_in_bf16):
        problems.append(
            f"{_FP8}: delayed scaling cannot keep first/last layers in BF16; set "
            "num_first_layers_in_bf16 and num_last_layers_in_bf16 to 0 or use fp8_recipe: tensorwise/blockwise"
        )
    recipe = RECIPES.get(cfg.training_recipe)
    if recipe is not None and FP32_BLOCK_SCALES_ENV in recipe.env:
        value = mcfg.env_vars.get(FP32_BLOCK_SCALES_ENV)
        if value is not None and value != recipe.env[FP32_BLOCK_SCALES_ENV]:
            problems.append(
                f"policy.megatron_cfg.env_vars.{FP32_BLOCK_SCALES_ENV} is {value!r}; the blockwise recipe "
                "needs '1' (float32 block scales, matching the rollout side); set it to \"1\" or remove it"
            )
    return problems


def bf16_layer_rules(cfg: RunConfig) -> list[str]:
    """First/last BF16 layer counts (training and rollout): >= 0, together at most the model's layers."""
    layers = cfg.model.num_layers
    problems: list[str] = []
    sections: tuple[tuple[str, FP8TrainConfig | VllmConfig], ...] = (
        (_FP8, cfg.policy.megatron_cfg.fp8_cfg),
        (_VLLM, cfg.policy.generation.vllm_cfg),
    )
    for section, obj in sections:
        problems += _at_least(section, obj, ("num_first_layers_in_bf16", "num_last_layers_in_bf16"), 0)
        total = obj.num_first_layers_in_bf16 + obj.num_last_layers_in_bf16
        if layers and total > layers:
            problems.append(
                f"{section}: num_first_layers_in_bf16 + num_last_layers_in_bf16 = {total} exceeds the model's "
                f"{layers} layers; lower them"
            )
    return problems


def training_parallelism_rules(cfg: RunConfig) -> list[str]:
    """Training through Megatron-Core (``enabled``); TP, PP and a given micro-batch size are >= 1."""
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    problems = _at_least("policy.megatron_cfg", cfg.policy.megatron_cfg, keys, 1)
    global_batch = cfg.policy.train_global_batch_size
    for key in ("train_micro_batch_size", "logprob_batch_size"):
        value = getattr(cfg.policy, key)
        if value is not None and value < 1:
            problems.append(f"policy.{key} must be >= 1 (or null: the whole batch at once), got {value}")
    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    update = global_batch if global_batch is not None and global_batch >= 1 else samples
    micro = cfg.policy.train_micro_batch_size
    if micro is not None and micro > update:  # an update's rows over all ranks: no rank's micro-batch can hold more
        problems.append(
            f"policy.train_micro_batch_size={micro} is more than an optimizer update's {update} sequences (over all "
            f"ranks: policy.train_global_batch_size, else the step's grpo.num_prompts_per_step x "
            f"num_generations_per_prompt samples); a micro-batch is part of one rank's share of an update: set it to "
            f"at most {update} (or null: the rank's whole share at once)"
        )
    if global_batch is not None and (global_batch < 1 or samples % global_batch):
        problems.append(
            f"policy.train_global_batch_size={global_batch} must divide the step's {samples} samples "
            "(grpo.num_prompts_per_step x num_generations_per_prompt) into whole optimizer updates"
        )
    if not cfg.policy.megatron_cfg.enabled:
        problems.append(
            "policy.megatron_cfg.enabled: false selects NeMo-RL's DTensor trainer, which megatron-fp8 does not have "
            "(it always trains through Megatron-Core); set policy.megatron_cfg.enabled: true"
        )
    return problems


def mxfp8_rules(cfg: RunConfig) -> list[str]:
    """``vllm_cfg.is_mx`` (NeMo-RL's MXFP8 rollout) is refused: it needs Blackwell, and the refit is blockwise."""
    vllm = cfg.policy.generation.vllm_cfg
    if not vllm.is_mx:
        return []
    return [
        f"{_VLLM}.is_mx: true asks for an MXFP8 rollout, which needs a Blackwell GPU (compute capability 10.x; "
        "Hopper has no MXFP8 tensor cores) and is not implemented by megatron-fp8, whose refit sends 128x128 "
        f"blockwise FP8; set {_VLLM}.is_mx: false (blockwise FP8 rollout, runs on Hopper and Blackwell)"
    ]


def vllm_engine_rules(cfg: RunConfig) -> list[str]:
    """``vllm_cfg.max_model_len`` >= 1 when given; layer keywords non-empty."""
    vllm = cfg.policy.generation.vllm_cfg
    problems: list[str] = []
    if vllm.max_model_len is not None and vllm.max_model_len < 1:
        problems.append(
            f"{_VLLM}.max_model_len must be >= 1 (or null for the engine default), got {vllm.max_model_len}"
        )
    if any(not kw for kw in vllm.quantization_ignored_layer_kws):
        problems.append(f"{_VLLM}.quantization_ignored_layer_kws has an empty keyword (it would match every layer)")
    return problems


def grpo_rules(cfg: RunConfig) -> list[str]:
    """``grpo``: positive counts and rates, known distinct arms, groups of at least 2 generations,
    ``max_val_samples`` >= 1 or null (``val_period`` <= 0 never validates, as in NeMo-RL, whose files use -1)."""
    g = cfg.grpo
    counts = (
        "max_num_steps",
        "num_prompts_per_step",
        "num_generations_per_prompt",
        "task_max_digits",
        "updates_per_step",
    )
    problems = _at_least("grpo", g, counts, 1)
    gen, opt = cfg.policy.generation, cfg.policy.megatron_cfg.optimizer
    if gen.temperature <= 0:
        problems.append(f"policy.generation.temperature must be > 0, got {gen.temperature}")
    if gen.max_new_tokens < 1:
        problems.append(f"policy.generation.max_new_tokens must be >= 1, got {gen.max_new_tokens}")
    if opt.lr <= 0:
        problems.append(f"policy.megatron_cfg.optimizer.lr must be > 0, got {opt.lr}")
    if opt.weight_decay < 0 or opt.adam_eps <= 0 or not (0 <= opt.adam_beta1 < 1 and 0 <= opt.adam_beta2 < 1):
        problems.append(
            "policy.megatron_cfg.optimizer: weight_decay >= 0, adam_eps > 0 and adam_beta1, adam_beta2 in [0, 1) "
            f"(got {opt.weight_decay}, {opt.adam_eps}, {opt.adam_beta1}, {opt.adam_beta2})"
        )
    arms = ", ".join(vocab.ARMS)
    if not g.arms:
        problems.append(f"grpo.arms is empty; choose from {arms}")
    unknown = [a for a in g.arms if a not in vocab.ARMS]
    if unknown:
        problems.append(f"grpo.arms has unknown arm(s) {unknown}; valid arms: {arms}")
    if len(set(g.arms)) != len(g.arms):
        problems.append(f"grpo.arms lists an arm twice: {list(g.arms)}")
    problems += _at_least("grpo", g, ("warm_start_steps",), 0)
    if g.max_val_samples is not None and g.max_val_samples < 1:
        problems.append(
            f"grpo.max_val_samples must be >= 1 (or null: every validation problem), got {g.max_val_samples}"
        )
    if g.warm_start_learning_rate <= 0:
        problems.append(f"grpo.warm_start_learning_rate must be > 0, got {g.warm_start_learning_rate}")
    if g.num_generations_per_prompt < 2:
        problems.append(
            f"grpo.num_generations_per_prompt is {g.num_generations_per_prompt}: GRPO normalises rewards within a "
            "group, which needs at least 2 generations per prompt"
        )
    return problems


def refit_rules(cfg: RunConfig) -> list[str]:
    """``refit``: bucket of at least 1 MiB, positive timeout."""
    problems = _at_least("refit", cfg.refit, ("bucket_size_mb",), 1)
    if cfg.refit.timeout_s <= 0:
        problems.append(f"refit.timeout_s must be > 0, got {cfg.refit.timeout_s}")
    return problems


def checkpointing_rules(cfg: RunConfig) -> list[str]:
    """``checkpointing``: a save period of at least 1 step, ``keep_top_k`` of at least 1 (or null: keep all); checked
    whether or not checkpointing is on, so a value that a later ``checkpointing.enabled=true`` would refuse is
    named now (the checkpoint manager refuses the same values)."""
    ck = cfg.checkpointing
    problems = _at_least("checkpointing", ck, ("save_period",), 1)
    if ck.keep_top_k is not None and ck.keep_top_k < 1:
        problems.append(f"checkpointing.keep_top_k must be >= 1 (or null: keep every checkpoint), got {ck.keep_top_k}")
    return problems


RULES: tuple[Rule, ...] = (
    quantization_config_rules,
    generation_rules,
    kv_cache_rules,
    tp_divisibility_rules,
    trainer_tp_rules,
    fp8_training_rules,
    bf16_layer_rules,
    training_parallelism_rules,
    mxfp8_rules,
    vllm_engine_rules,
    loss_rules,
    scheduler_rules,
    batching_rules,
    async_rules,
    dynamic_sampling_rules,
    loss_scale_rules,
    reward_rules,
    grpo_rules,
    checkpointing_rules,
    refit_rules,
    memory_rules,
)
"""Every cross-field rule, run in this order by :func:`validate_config`."""


def validate_config(cfg: RunConfig, *, rules: tuple[Rule, ...] = RULES) -> None:
    """Run every rule; raise one :class:`ConfigError` listing every problem and its fix.

    Args:
        cfg: the run config (model dimensions already filled in).
        rules: the rules to run (default :data:`RULES`).

    Raises:
        ConfigError: ``"invalid run config:"`` followed by one ``  - problem`` line per problem.
    """
    problems = [problem for rule in rules for problem in rule(cfg)]
    if problems:
        raise ConfigError("invalid run config:\n  - " + "\n  - ".join(problems))
