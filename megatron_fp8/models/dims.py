"""Dimensions of the models megatron-fp8 knows, for validation before anything is loaded.

The tiny models are read from :data:`megatron_fp8.models.tiny.TINY_MODELS` (one
source of truth); the public models are the published Hugging Face
``config.json`` values.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_fp8.models.tiny import MODEL_ALIASES, TINY_MODELS


@dataclass(frozen=True)
class ModelDims:
    """Shapes that decide FP8 block and TP divisibility.

    Attributes:
        num_layers: decoder layers.
        hidden_size: model width (elements).
        intermediate_size: dense MLP width (elements).
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads.
        head_dim: elements per head.
        moe_intermediate_size: width of each expert MLP, ``None`` for dense models.
        num_experts: routed experts per layer, 0 for dense models.
        vocab_size: embedding rows (0: unknown).
        tie_word_embeddings: the output layer shares the embedding's weight.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int | None = None
    num_experts: int = 0
    vocab_size: int = 0
    tie_word_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        """Whether the model has routed experts."""
        return self.num_experts > 0

    @property
    def num_expert_parameters(self) -> int:
        """Parameters of the routed experts (split over the expert-parallel ranks), in elements."""
        return self.num_layers * self.num_experts * 3 * self.hidden_size * int(self.moe_intermediate_size or 0)

    @property
    def num_parameters(self) -> int:
        """Parameters of the model (embeddings, attention, MLP or experts and router, norms), in elements."""
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * d
        if self.is_moe:
            mlp = self.num_experts * 3 * h * int(self.moe_intermediate_size or 0) + h * self.num_experts
        else:
            mlp = 3 * h * self.intermediate_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * (attention + mlp + 2 * h) + h


def _tiny_dims(name: str) -> ModelDims:
    """Dimensions of an embedded tiny model, read from its spec (one source of truth)."""
    spec = TINY_MODELS[name]
    return ModelDims(
        num_layers=spec.num_hidden_layers,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        moe_intermediate_size=spec.moe_intermediate_size or None,
        num_experts=spec.num_experts,
        vocab_size=spec.vocab_size,
    )


_LLAMA_70B = ModelDims(
    num_layers=80,
    hidden_size=8192,
    intermediate_size=28672,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
)
"""Llama-3.1-70B and Llama-3.3-70B (NeMo-RL's 70B recipes)."""

KNOWN_MODELS: dict[str, ModelDims] = {
    **{name: _tiny_dims(name) for name in TINY_MODELS},
    "llama-3.1-8b": ModelDims(
        num_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
    ),
    "llama-3.3-70b": _LLAMA_70B,
    "llama-3.1-70b": _LLAMA_70B,  # the same config.json dimensions
    "qwen3-8b": ModelDims(
        num_layers=36,
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    "qwen3-30b-a3b": ModelDims(
        num_layers=48,
        hidden_size=2048,
        intermediate_size=6144,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        moe_intermediate_size=768,
        num_experts=128,
        vocab_size=151936,
    ),
}
"""Known models by canonical key (lower-case base name without ``-instruct`` / ``-base``)."""


def model_key(name_or_path: str) -> str:
    """Canonical :data:`KNOWN_MODELS` key for a model name or path (it may not be in the table)."""
    name = MODEL_ALIASES.get(name_or_path, name_or_path)
    base = name.rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix in ("-instruct", "-base"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return base


def known_dims(name_or_path: str) -> ModelDims | None:
    """Dimensions of a known model, ``None`` for any other name or path."""
    return KNOWN_MODELS.get(model_key(name_or_path))
