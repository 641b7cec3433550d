"""FP8 training recipes: the registry, capability checks, and applying a recipe to Megatron configs.

* :mod:`~megatron_fp8.recipes.registry`: named recipes (``bf16``, ``tensorwise``, ``blockwise``,
  ``fp8_param``, ``delayed``, ``mxfp8``) as frozen dataclasses;
* :mod:`~megatron_fp8.recipes.capability`: which recipes this machine can run, and why not;
* :mod:`~megatron_fp8.recipes.apply`: write a recipe into a ``TransformerConfig``, DDP config or
  Megatron-Bridge ``MixedPrecisionConfig`` and the environment.

Importing this package does not import Megatron, TransformerEngine, vLLM or torch.
"""

from __future__ import annotations

from megatron_fp8.recipes.apply import (
    MATH_MODES,
    RecipeApplication,
    apply_recipe,
    apply_recipe_with_report,
    build_bridge_mixed_precision,
)
from megatron_fp8.recipes.capability import (
    CPU_EMULATION_NOTE,
    REQUIREMENTS,
    Environment,
    Requirements,
    Verdict,
    check,
    check_all,
    probe_environment,
    transformer_engine_version,
)
from megatron_fp8.recipes.registry import (
    DDP_CONFIG_FIELDS,
    FP8_FORMATS,
    FP32_BLOCK_SCALES_ENV,
    RECIPES,
    TRANSFORMER_CONFIG_FIELDS,
    Recipe,
    fp8_recipe_names,
    get_recipe,
    list_recipes,
)

__all__ = [
    "CPU_EMULATION_NOTE",
    "DDP_CONFIG_FIELDS",
    "FP8_FORMATS",
    "FP32_BLOCK_SCALES_ENV",
    "MATH_MODES",
    "RECIPES",
    "REQUIREMENTS",
    "TRANSFORMER_CONFIG_FIELDS",
    "Environment",
    "Recipe",
    "RecipeApplication",
    "Requirements",
    "Verdict",
    "apply_recipe",
    "apply_recipe_with_report",
    "build_bridge_mixed_precision",
    "check",
    "check_all",
    "fp8_recipe_names",
    "get_recipe",
    "list_recipes",
    "probe_environment",
    "transformer_engine_version",
]
