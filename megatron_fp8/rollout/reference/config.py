"""Model, quantization and parameter layout of the reference FP8 engine.

This module belongs to :mod:`megatron_fp8.rollout.reference`, an emulator
and oracle of vLLM's FP8 W8A8 blockwise numerics for CPU machines. It is NOT a
serving engine; on GPU use vLLM.

It turns a Hugging Face config (Qwen3 dense or Qwen3-MoE) and an FP8
quantization config into

* :class:`ReferenceModelConfig`: the dimensions the forward pass needs;
* :class:`ReferenceQuantConfig`: the vLLM ``quantization_config`` (``fp8``,
  ``e4m3``, dynamic activations, ``weight_block_size``, ``ignored_layers``);
* :func:`param_specs`: every weight the engine holds, keyed by its unfused HF
  name, with shape and whether it may be held in FP8;
* :func:`default_fp8_names` / :func:`check_fp8_names`: the FP8 manifest vLLM
  would derive from ``ignored_layers``, and the consistency rules vLLM enforces
  (one quantization scheme per fused module: q/k/v, gate/up, all experts of a
  layer; shard sizes divisible by the block).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_fp8.errors import ConfigError, ManifestError
from megatron_fp8.layout import ceil_div
from megatron_fp8.vocab import KV_SCALE_KINDS, kv_scale_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # typing only: transformers is optional at runtime

SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "qwen3": "Qwen3ForCausalLM (dense)",
    "qwen3_moe": "Qwen3MoeForCausalLM (sparse MoE, top-k softmax routing)",
}
"""Registry: HF ``model_type`` -> description of what the reference engine runs."""

JsonMapping = Mapping[str, Any]
"""A parsed JSON object (``config.json``, a ``quantization_config``). ``Any``: JSON values are untyped."""


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ReferenceModelConfig:
    """Dimensions of a Qwen3 / Qwen3-MoE model as the reference engine reads them.

    Part of the reference FP8 engine, an emulator and oracle of vLLM's FP8 W8A8
    blockwise numerics for CPU machines; NOT a serving engine (on GPU use vLLM).

    Attributes:
        model_type: ``"qwen3"`` or ``"qwen3_moe"`` (see :data:`SUPPORTED_MODEL_TYPES`).
        vocab_size: embedding rows.
        hidden_size: model width H (elements).
        intermediate_size: dense MLP width.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention).
        head_dim: elements per head.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: rotary base (default RoPE only).
        max_position_embeddings: longest sequence in tokens.
        tie_word_embeddings: ``lm_head`` shares ``embed_tokens.weight``.
        attention_bias: q/k/v/o projections carry biases.
        num_experts: routed experts per MoE layer (0 for dense).
        num_experts_per_tok: top-k.
        moe_intermediate_size: expert MLP width.
        norm_topk_prob: renormalize the top-k routing weights to sum to 1.
        decoder_sparse_step: every ``decoder_sparse_step``-th layer is MoE.
        mlp_only_layers: layers that stay dense in an MoE model.
        raw: the config as a plain dict (written back by ``save_fp8_checkpoint``).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    raw: JsonMapping

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a sparse MoE block (HF Qwen3-MoE rule)."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )


def _config_dict(hf_config: JsonMapping | PretrainedConfig) -> JsonMapping:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    to_dict = getattr(hf_config, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise ConfigError(f"hf_config must be a transformers config or a config.json dict, got {type(hf_config).__name__}")


def _rope_theta(cfg: JsonMapping) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ConfigError(
            f"rope_type {rope_type!r} is not supported by the reference engine; only 'default' RoPE "
            "(rope_theta) is emulated"
        )
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ConfigError("config has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


def model_config_from_hf(hf_config: JsonMapping | PretrainedConfig) -> ReferenceModelConfig:
    """Read a Qwen3 / Qwen3-MoE HF config (object or ``config.json`` dict).

    Raises:
        ConfigError: unknown ``model_type`` (lists the valid ones), sliding-window
            attention, non-default RoPE, or inconsistent head counts.
    """
    cfg = _config_dict(hf_config)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported by the reference engine; valid names: "
            f"{sorted(SUPPORTED_MODEL_TYPES)}"
        )
    if cfg.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=True is not emulated by the reference engine; set it to False")
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    hidden = int(cfg["hidden_size"])
    num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0) if model_type == "qwen3_moe" else 0
    return ReferenceModelConfig(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        num_experts=num_experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
        mlp_only_layers=tuple(int(i) for i in (cfg.get("mlp_only_layers") or ())),
        raw=cfg,
    )


@dataclass(frozen=True)
class ReferenceQuantConfig:
    """vLLM's blockwise FP8 ``quantization_config`` (dynamic W8A8).

    Part of the reference FP8 engine, an emulator and oracle of vLLM's FP8 W8A8
    blockwise numerics for CPU machines; NOT a serving engine (on GPU use vLLM).

    Attributes:
        block_size: ``(block_n, block_k)`` of the weight blocks (elements).
        ignored_layers: module prefixes vLLM keeps in BF16
            (``model.layers.0.self_attn.q_proj``, fused ``...qkv_proj``, ``...mlp.experts``).
        activation_scale_format: ``"fp32"`` (``amax/448``, Hopper) or ``"ue8m0"``
            (power-of-two activation scales, DeepGEMM on Blackwell).
    """

    block_size: tuple[int, int] = (128, 128)
    ignored_layers: tuple[str, ...] = ()
    activation_scale_format: str = "fp32"

    def to_hf(self) -> dict[str, object]:
        """The ``quantization_config`` dict vLLM and HF checkpoints carry."""
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block_size),
            "ignored_layers": list(self.ignored_layers),
        }


_EXPECTED_QUANT_VALUES = {"quant_method": ("fp8",), "fmt": ("e4m3",), "activation_scheme": ("dynamic",)}


def quant_config_from_hf(quantization: JsonMapping, *, activation_scale_format: str = "fp32") -> ReferenceQuantConfig:
    """Validate a vLLM / HF FP8 ``quantization_config`` dict.

    Raises:
        ConfigError: a method other than blockwise dynamic ``fp8`` / ``e4m3``
            (per-tensor FP8 and static activation scales are not emulated).
    """
    if not isinstance(quantization, Mapping):
        raise ConfigError(f"quantization must be a quantization_config dict or None, got {type(quantization).__name__}")
    for key, allowed in _EXPECTED_QUANT_VALUES.items():
        value = quantization.get(key, allowed[0] if key == "fmt" else None)
        if value not in allowed:
            raise ConfigError(
                f"quantization_config[{key!r}] = {value!r}; the reference engine emulates only {allowed} "
                "(vLLM's dynamic blockwise W8A8 path)"
            )
    block = quantization.get("weight_block_size")
    if block is None or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ConfigError(
            f"quantization_config['weight_block_size'] = {block!r}; expected two positive ints such as [128, 128] "
            "(per-tensor FP8 is not emulated)"
        )
    if activation_scale_format not in ("fp32", "ue8m0"):
        raise ConfigError(
            f"unknown activation_scale_format {activation_scale_format!r}; valid names: ['fp32', 'ue8m0']"
        )
    return ReferenceQuantConfig(
        block_size=(int(block[0]), int(block[1])),
        ignored_layers=tuple(quantization.get("ignored_layers") or ()),
        activation_scale_format=activation_scale_format,
    )


@dataclass(frozen=True)
class ParamSpec:
    """One weight held by the reference engine.

    Part of the reference FP8 engine, an emulator and oracle of vLLM's FP8 W8A8
    blockwise numerics for CPU machines; NOT a serving engine (on GPU use vLLM).

    Attributes:
        name: unfused HF name (``model.layers.0.self_attn.q_proj.weight``).
        shape: tensor shape (``[N_out, K_in]`` for linears).
        linear: a GEMM weight that vLLM may hold in FP8 (projections, experts).
        module: vLLM's quantization unit for ``ignored_layers`` matching
            (``model.layers.0.self_attn.q_proj``; experts: ``model.layers.0.mlp.experts``).
        fused_module: vLLM's fused module prefix (``...qkv_proj``, ``...gate_up_proj``,
            ``...mlp.experts``) whose shards must share one scheme, else ``None``.
    """

    name: str
    shape: tuple[int, ...]
    linear: bool = False
    module: str | None = None
    fused_module: str | None = None


def _linear(name: str, shape: tuple[int, int], *, fused: str | None = None, module: str | None = None) -> ParamSpec:
    mod = module if module is not None else name.rsplit(".", 1)[0]
    return ParamSpec(name=name, shape=shape, linear=True, module=mod, fused_module=fused)


def param_specs(cfg: ReferenceModelConfig) -> dict[str, ParamSpec]:
    """Every weight (not KV scales, not FP8 scales) keyed by unfused HF name, in checkpoint order."""
    h, hd = cfg.hidden_size, cfg.head_dim
    specs: list[ParamSpec] = [ParamSpec("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        attn = f"{p}.self_attn"
        qkv = f"{attn}.qkv_proj"
        sizes = {
            "q": cfg.num_attention_heads * hd,
            "k": cfg.num_key_value_heads * hd,
            "v": cfg.num_key_value_heads * hd,
        }
        for s, n_out in sizes.items():
            specs.append(_linear(f"{attn}.{s}_proj.weight", (n_out, h), fused=qkv))
            if cfg.attention_bias:
                specs.append(ParamSpec(f"{attn}.{s}_proj.bias", (n_out,)))
        specs.append(_linear(f"{attn}.o_proj.weight", (h, sizes["q"])))
        if cfg.attention_bias:
            specs.append(ParamSpec(f"{attn}.o_proj.bias", (h,)))
        specs += [ParamSpec(f"{attn}.q_norm.weight", (hd,)), ParamSpec(f"{attn}.k_norm.weight", (hd,))]
        if cfg.is_moe_layer(i):
            experts = f"{p}.mlp.experts"
            specs.append(ParamSpec(f"{p}.mlp.gate.weight", (cfg.num_experts, h)))
            im = cfg.moe_intermediate_size
            for e in range(cfg.num_experts):
                for proj, shape in (("gate_proj", (im, h)), ("up_proj", (im, h)), ("down_proj", (h, im))):
                    specs.append(_linear(f"{experts}.{e}.{proj}.weight", shape, fused=experts, module=experts))
        else:
            gate_up = f"{p}.mlp.gate_up_proj"
            im = cfg.intermediate_size
            specs.append(_linear(f"{p}.mlp.gate_proj.weight", (im, h), fused=gate_up))
            specs.append(_linear(f"{p}.mlp.up_proj.weight", (im, h), fused=gate_up))
            specs.append(_linear(f"{p}.mlp.down_proj.weight", (h, im)))
        specs += [
            ParamSpec(f"{p}.input_layernorm.weight", (h,)),
            ParamSpec(f"{p}.post_attention_layernorm.weight", (h,)),
        ]
    specs.append(ParamSpec("model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec("lm_head.weight", (cfg.vocab_size, h)))
    return {s.name: s for s in specs}


def kv_scale_names(cfg: ReferenceModelConfig) -> list[str]:
    """Names of the float32 KV-cache scales, ``model.layers.{i}.self_attn.attn.{q,k,v}_scale``."""
    return [kv_scale_name(i, kind) for i in range(cfg.num_hidden_layers) for kind in KV_SCALE_KINDS]


KV_SCALE_ALIASES: tuple[tuple[str, str], ...] = (
    (r"^(model\.layers\.\d+\.self_attn)\.([qkv])_scale$", r"\1.attn.\2_scale"),
    (r"^(model\.layers\.\d+\.self_attn)\.([qkv])_proj\.output_scale$", r"\1.attn.\2_scale"),
)
"""Checkpoint spellings of KV scales that vLLM remaps to ``...self_attn.attn.{q,k,v}_scale``."""


def canonical_kv_scale_name(name: str) -> str:
    """Map a checkpoint KV-scale spelling to the stream name (identity for other names)."""
    for pattern, repl in KV_SCALE_ALIASES:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return name


def _is_ignored(spec: ParamSpec, ignored: set[str]) -> bool:
    return spec.module in ignored or (spec.fused_module is not None and spec.fused_module in ignored)


def default_fp8_names(specs: Mapping[str, ParamSpec], quant: ReferenceQuantConfig) -> frozenset[str]:
    """The FP8 manifest vLLM derives: every linear weight whose module is not in ``ignored_layers``.

    Matching is exact on module prefixes, as vLLM's ``is_layer_skipped`` does by
    default; a fused prefix (``...qkv_proj``, ``...gate_up_proj``,
    ``...mlp.experts``) skips all its shards.

    Raises:
        ConfigError: an ``ignored_layers`` entry names no module of this model,
            or the shards of one fused module end up with different schemes.
    """
    ignored = set(quant.ignored_layers)
    known = {s.module for s in specs.values() if s.linear} | {s.fused_module for s in specs.values() if s.fused_module}
    unknown = sorted(ignored - known)
    if unknown:
        raise ConfigError(
            f"ignored_layers entries {unknown} name no linear module of this model; expected module prefixes "
            f"such as {sorted(known)[:3]}"
        )
    names = frozenset(n for n, s in specs.items() if s.linear and not _is_ignored(s, ignored))
    check_fp8_names(specs, names, quant)
    return names


def check_fp8_names(
    specs: Mapping[str, ParamSpec], fp8_names: Iterable[str], quant: ReferenceQuantConfig
) -> frozenset[str]:
    """Validate an FP8 manifest against the model and vLLM's fused-layer rules.

    Rules: every name is a linear weight of the model; the shards of one fused
    module (q/k/v, gate/up, all experts of a layer) are all FP8 or all BF16; an
    FP8 weight's K is a multiple of ``block_k`` (vLLM's activation quantizer
    needs whole groups) and every non-last shard of a fused FP8 module has N
    divisible by ``block_n`` (vLLM's ``validate_fp8_block_shape``).

    Returns:
        the manifest as a frozenset.

    Raises:
        ManifestError: naming the offending weight and the remedy.
    """
    names = frozenset(fp8_names)
    unknown = sorted(n for n in names if n not in specs)
    if unknown:
        raise ManifestError(
            f"FP8 manifest names {unknown[:5]} are not weights of this model "
            f"({len(unknown)} unknown); rebuild the manifest from this model's vLLM engine"
        )
    not_linear = sorted(n for n in names if not specs[n].linear)
    if not_linear:
        raise ManifestError(
            f"FP8 manifest names {not_linear[:5]} that vLLM always keeps in BF16 (norms, embeddings, lm_head, "
            "router, biases); remove them from the manifest"
        )
    groups: dict[str, list[str]] = {}
    for n, s in specs.items():
        if s.fused_module is not None:
            groups.setdefault(s.fused_module, []).append(n)
    for fused, members in groups.items():
        in_fp8 = [m for m in members if m in names]
        if in_fp8 and len(in_fp8) != len(members):
            missing = sorted(set(members) - set(in_fp8))
            raise ManifestError(
                f"fused module {fused!r}: vLLM holds all its shards in one format, but the manifest has "
                f"{len(in_fp8)} of {len(members)} in FP8 (BF16: {missing[:4]}); make them all FP8 or all BF16"
            )
    bn, bk = quant.block_size
    for n in sorted(names):
        s = specs[n]
        k = s.shape[-1]
        if k % bk:
            raise ManifestError(
                f"{n}: K_in={k} is not a multiple of block_k={bk}; vLLM's per-token-group activation quantizer "
                "needs whole groups. Keep this layer in BF16 (ignored_layers)"
            )
    for fused, members in groups.items():
        if members[0] not in names:
            continue
        if fused.endswith(".experts"):
            im = specs[members[0]].shape[0]
            if im % bn:
                raise ManifestError(
                    f"{fused}: expert intermediate size {im} is not a multiple of block_n={bn} "
                    "(vLLM's validate_fp8_block_shape_moe); keep the experts in BF16"
                )
            continue
        for m in members[:-1]:
            n_out = specs[m].shape[0]
            if n_out % bn:
                raise ManifestError(
                    f"{m}: N_out={n_out} is not a multiple of block_n={bn}, so the fused {fused!r} would put "
                    "two shards in one scale block (vLLM's validate_fp8_block_shape); keep it in BF16"
                )
    return names


def ignored_layers_for(specs: Mapping[str, ParamSpec], fp8_names: frozenset[str]) -> tuple[str, ...]:
    """``ignored_layers`` entries that make vLLM derive exactly ``fp8_names`` (for saved checkpoints)."""
    out: list[str] = []
    for s in specs.values():
        if s.linear and s.name not in fp8_names and s.module not in out:
            out.append(s.module)  # type: ignore[arg-type]
    return tuple(out)


def layer_index(name: str) -> int | None:
    """Decoder layer index of an HF weight name, or ``None`` for global weights."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def scale_shape(shape: tuple[int, ...], block_size: tuple[int, int]) -> tuple[int, int]:
    """``[ceil(N/bn), ceil(K/bk)]``: the float32 block-scale shape of an ``[N, K]`` weight."""
    return (ceil_div(shape[0], block_size[0]), ceil_div(shape[1], block_size[1]))
