"""Which vLLM layer classes hold a model's weights, across vLLM releases, and which checkpoint tensors each one loads.

The refit walks a built vLLM model by layer kind: linear layers (``LinearBase``: fused ``qkv_proj`` /
``gate_up_proj`` map back to their Hugging Face shards through the model's ``packed_modules_mapping``),
routed experts (``RoutedExperts`` on vLLM >= 0.30, ``FusedMoE`` before: their names through vLLM's expert
mapping), the vocabulary embedding and the attention layers that own a KV cache. Every class is looked up
lazily (vLLM is optional at import time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # vLLM's types, for annotations only (vLLM is optional at import time)
    from vllm.model_executor.layers.linear import LinearBase


def linear_base_cls() -> type[LinearBase]:
    from vllm.model_executor.layers.linear import LinearBase  # lazy: vLLM is optional

    return LinearBase


def routed_experts_cls() -> type[torch.nn.Module]:
    # vLLM >= 0.30 splits FusedMoE into a runner and RoutedExperts (which owns the
    # weights and the quant method); older releases had FusedMoE itself.
    try:
        from vllm.model_executor.layers.fused_moe import RoutedExperts  # lazy: vLLM is optional

        return RoutedExperts
    except ImportError:  # pragma: no cover - vLLM < 0.30
        from vllm.model_executor.layers.fused_moe import FusedMoE  # lazy: vLLM is optional

        return FusedMoE


def vocab_embedding_cls() -> type[torch.nn.Module]:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding  # lazy: vLLM is optional

    return VocabParallelEmbedding


def attention_prefixes(model: torch.nn.Module) -> list[str]:
    """Module names of the attention layers that own a KV cache (``...self_attn.attn``)."""
    try:
        from vllm.model_executor.layers.attention import Attention  # lazy: vLLM is optional
    except ImportError:  # pragma: no cover - vLLM < 0.30
        from vllm.attention.layer import Attention  # lazy: vLLM is optional

    return [name for name, module in model.named_modules() if isinstance(module, Attention)]


def experts_prefix(module: torch.nn.Module) -> str:
    return getattr(module, "layer_name", None) or getattr(module, "prefix", "")


def linear_hf_weights(prefix: str, packed: dict[str, list[str]]) -> tuple[str, ...]:
    head, _, last = prefix.rpartition(".")
    shards = packed.get(last)
    if shards:
        return tuple(f"{head}.{s}.weight" for s in shards)
    return (f"{prefix}.weight",)


def expert_hf_weights(module: torch.nn.Module) -> tuple[str, ...]:
    prefix = experts_prefix(module)
    mapping = module.get_expert_mapping() if hasattr(module, "get_expert_mapping") else []
    names = []
    for _param, weight_name, _expert, _shard in mapping:
        # weight_name looks like "experts.3.gate_proj.": rebase it on the layer prefix
        tail = weight_name.split("experts.", 1)[-1]
        names.append(f"{prefix}.{tail}weight")
    return tuple(sorted(set(names)))
