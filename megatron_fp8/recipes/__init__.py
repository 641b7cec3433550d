"""FP8 training recipes: the registry, capability checks, and applying a recipe to Megatron configs.

* :mod:`~megatron_fp8.recipes.registry`: named recipes (``bf16``, ``tensorwise``, ``blockwise``,
  ``fp8_param``, ``delayed``, ``mxfp8``) as frozen dataclasses;
* :mod:`~megatron_fp8.recipes.capability`: which recipes this machine can run, and why not;
* :mod:`~megatron_fp8.recipes.apply`: write a recipe into a ``TransformerConfig``, DDP config or
  Megatron-Bridge ``MixedPrecisionConfig`` and the environment.

Importing this package does not import Megatron, TransformerEngine, vLLM or torch.
"""

from __future__ import annotations

from megatron_fp8.exports import lazy_exports

_EXPORTS = {  # exported name -> the module that defines it (resolved on first use: megatron_fp8.exports)
    "MATH_MODES": "megatron_fp8.recipes.apply",
    "RecipeApplication": "megatron_fp8.recipes.apply",
    "apply_recipe": "megatron_fp8.recipes.apply",
    "apply_recipe_with_report": "megatron_fp8.recipes.apply",
    "build_bridge_mixed_precision": "megatron_fp8.recipes.apply",
    "CPU_EMULATION_NOTE": "megatron_fp8.recipes.capability",
    "REQUIREMENTS": "megatron_fp8.recipes.capability",
    "Environment": "megatron_fp8.recipes.capability",
    "Requirements": "megatron_fp8.recipes.capability",
    "Verdict": "megatron_fp8.recipes.capability",
    "check": "megatron_fp8.recipes.capability",
    "check_all": "megatron_fp8.recipes.capability",
    "probe_environment": "megatron_fp8.recipes.capability",
    "transformer_engine_version": "megatron_fp8.recipes.capability",
    "DDP_CONFIG_FIELDS": "megatron_fp8.recipes.registry",
    "FP8_FORMATS": "megatron_fp8.recipes.registry",
    "FP32_BLOCK_SCALES_ENV": "megatron_fp8.recipes.registry",
    "RECIPES": "megatron_fp8.recipes.registry",
    "TRANSFORMER_CONFIG_FIELDS": "megatron_fp8.recipes.registry",
    "Recipe": "megatron_fp8.recipes.registry",
    "fp8_recipe_names": "megatron_fp8.recipes.registry",
    "get_recipe": "megatron_fp8.recipes.registry",
    "list_recipes": "megatron_fp8.recipes.registry",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
