"""Synthetic Llama-shaped weight streams for refit tests and benchmarks (random data, no download).

Names follow the unfused HF layout vLLM loads (DESIGN.md): per layer the 7
linear weights ``self_attn.{q,k,v,o}_proj.weight`` and
``mlp.{gate,up,down}_proj.weight`` are the FP8 parameters; embeddings, norms
and ``lm_head`` stay BF16.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.quant import quantize_blockwise
from megatron_fp8.quant.formats import NonFinitePolicy, ScaleFormat
from megatron_fp8.refit.inbucket import PendingPart, blockwise_items
from megatron_fp8.vocab import SCALE_SUFFIX

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The 7 linear weights per decoder layer (HF names, suffix ``.weight``)."""


@dataclass(frozen=True)
class LlamaSpec:
    """Shapes of a Llama-style decoder.

    Attributes:
        hidden_size: model width H.
        intermediate_size: MLP width I.
        num_heads: attention heads (head_dim = H / num_heads).
        num_kv_heads: key/value heads.
        vocab_size: vocabulary V.
        num_layers: decoder layers.
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    num_layers: int

    @property
    def head_dim(self) -> int:
        """Per-head width."""
        return self.hidden_size // self.num_heads

    def shrunk(self, factor: int, *, num_layers: int | None = None) -> LlamaSpec:
        """Widths divided by ``factor`` (head count too, so head_dim stays), optionally fewer layers."""
        if factor < 1 or self.hidden_size % factor or self.intermediate_size % factor or self.num_kv_heads % factor:
            raise ConfigError(f"shrink factor {factor} must divide hidden, intermediate and kv-head counts")
        return replace(
            self,
            hidden_size=self.hidden_size // factor,
            intermediate_size=self.intermediate_size // factor,
            num_heads=self.num_heads // factor,
            num_kv_heads=self.num_kv_heads // factor,
            vocab_size=self.vocab_size // factor,
            num_layers=self.num_layers if num_layers is None else num_layers,
        )


SPECS: dict[str, LlamaSpec] = {
    "llama-3.1-8b": LlamaSpec(4096, 14336, 32, 8, 128256, 32),
    "tiny": LlamaSpec(256, 512, 2, 2, 512, 2),
}
"""Named shapes; ``llama-3.1-8b`` follows the public HF config."""


def get_spec(name: str) -> LlamaSpec:
    """The spec registered as ``name``; unknown names raise :class:`ConfigError` listing the valid ones."""
    try:
        return SPECS[name]
    except KeyError:
        raise ConfigError(f"unknown model spec {name!r}; valid specs: {sorted(SPECS)}") from None


def linear_shapes(spec: LlamaSpec) -> dict[str, tuple[int, int]]:
    """``{hf_name: (N_out, K_in)}`` of the FP8 parameters (the 7 linears of every layer)."""
    h, i, kv = spec.hidden_size, spec.intermediate_size, spec.num_kv_heads * spec.head_dim
    per_layer = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    return {
        f"model.layers.{layer}.{mod}.weight": shape
        for layer in range(spec.num_layers)
        for mod, shape in per_layer.items()
    }


def bf16_rest_shapes(spec: LlamaSpec) -> dict[str, tuple[int, ...]]:
    """``{hf_name: shape}`` of the parameters that stay BF16: embeddings, norms, lm_head."""
    h = spec.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for layer in range(spec.num_layers):
        out[f"model.layers.{layer}.input_layernorm.weight"] = (h,)
        out[f"model.layers.{layer}.post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (spec.vocab_size, h)
    return out


def synthetic_weights(
    spec: LlamaSpec, *, seed: int = 0, include_rest: bool = True, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Random BF16 weights (normal, std 0.02; norms 1.0) for ``spec``, keyed by HF name.

    Returns:
        ``{hf_name: bfloat16 tensor}`` on ``device``: the FP8 parameters first (layer order), then the BF16 rest.
        The values depend on the device's generator (the same seed gives other values on CUDA than on CPU).
    """
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)  # drawn where they live: seconds, not minutes, for 8B on a GPU
    shapes: dict[str, tuple[int, ...]] = dict(linear_shapes(spec))
    if include_rest:
        shapes.update(bf16_rest_shapes(spec))
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=torch.bfloat16, device=dev)
        else:
            out[name] = (torch.randn(shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    return out


def bf16_stream(weights: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights as they are: ``(name, bf16 tensor)``."""
    yield from weights.items()


def fp8_stream(
    weights: Mapping[str, torch.Tensor],
    fp8_names: Iterable[str],
    *,
    scale_format: ScaleFormat = "fp32",
    nonfinite: NonFinitePolicy = "raise",
    in_bucket: bool = False,
) -> Iterator[tuple[str, torch.Tensor | PendingPart]]:
    """Quantize-before-transfer: FP8 parameters become ``(name, fp8)`` + ``(name_scale_inv, fp32)``.

    Each weight is quantized lazily as the stream is consumed (128x128 blocks,
    :func:`megatron_fp8.quant.quantize_blockwise`); other tensors pass through.
    With ``in_bucket=True`` the two items are :class:`~megatron_fp8.refit.inbucket.PendingPart` s
    that the refit packer quantizes straight into its bucket (the same bytes; ``nonfinite`` is then
    the packer's: it refuses a NaN/Inf weight by name).
    """
    fp8 = set(fp8_names)
    for name, tensor in weights.items():
        if name in fp8 and in_bucket:
            yield from blockwise_items(name, tensor, scale_format=scale_format)
        elif name in fp8:
            q, scale_inv = quantize_blockwise(tensor, scale_format=scale_format, name=name, nonfinite=nonfinite)
            yield name, q
            yield name + SCALE_SUFFIX, scale_inv
        else:
            yield name, tensor
