"""Named FP8 training recipes: what each one sets in Megatron-Core, the DDP config and the environment.

A :class:`Recipe` is a declaration, not an action: it lists the
``TransformerConfig`` fields, the ``DistributedDataParallelConfig`` fields and
the environment variables of one FP8 training setup, plus the facts other
stages need (TransformerEngine recipe class, sequence padding multiple).
:func:`megatron_fp8.recipes.apply.apply_recipe` writes them into real configs.

Field names are those of the installed Megatron-Core 0.16.1
(``megatron.core.transformer.transformer_config.TransformerConfig``):
``fp8`` (``"e4m3"`` | ``"hybrid"`` | ``None``), ``fp8_recipe`` (``"tensorwise"``,
``"delayed"``, ``"blockwise"``, ``"mxfp8"``), ``fp8_param``, ``fp8_margin``,
``fp8_amax_history_len``, ``fp8_amax_compute_algo``, ``first_last_layers_bf16``,
``num_layers_at_start_in_bf16``, ``num_layers_at_end_in_bf16``; and of
``megatron.core.distributed.DistributedDataParallelConfig``: ``fp8_param_gather``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TypeAlias

from megatron_fp8.errors import ConfigError

FieldValue: TypeAlias = str | int | bool | None
"""A value a recipe writes into a ``TransformerConfig`` / DDP config field."""

FP32_BLOCK_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
"""TransformerEngine switch: ``1`` keeps blockwise scales in float32 instead of rounding them to powers of 2."""

TRANSFORMER_CONFIG_FIELDS: tuple[str, ...] = (
    "fp8",
    "fp8_recipe",
    "fp8_param",
    "fp8_margin",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "first_last_layers_bf16",
    "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16",
)
"""Every ``TransformerConfig`` field a recipe may set (all exist in Megatron-Core 0.16.1)."""

DDP_CONFIG_FIELDS: tuple[str, ...] = ("fp8_param_gather",)
"""Every ``DistributedDataParallelConfig`` field a recipe may set."""


@dataclass(frozen=True)
class Recipe:
    """One named precision recipe for Megatron-Core + TransformerEngine training.

    Attributes:
        name: registry name (``"bf16"``, ``"tensorwise"``, ``"blockwise"``, ...).
        description: one line for humans (``megatron-fp8 doctor`` prints it).
        fp8: Megatron-Core ``TransformerConfig.fp8`` format, ``"e4m3"``, ``"hybrid"`` (E4M3 forward,
            E5M2 gradients) or ``None`` for no FP8.
        fp8_recipe: Megatron-Core ``TransformerConfig.fp8_recipe`` name, ``None`` for BF16.
        fp8_param: keep primary weights in FP8 (``TransformerConfig.fp8_param``).
        fp8_param_gather: all-gather parameters in FP8 (``DistributedDataParallelConfig.fp8_param_gather``).
        fp8_margin: scaling-factor margin (power-of-2 exponent), delayed scaling only.
        fp8_amax_history_len: amax history window length in steps (delayed scaling).
        fp8_amax_compute_algo: ``"most_recent"`` or ``"max"`` over the history window.
        te_recipe_class: TransformerEngine recipe class Megatron-Core builds
            (``transformer_engine.common.recipe.<name>``), ``None`` for BF16.
        seq_padding_multiple: pad sequence lengths (tokens) to a multiple of this for the FP8 GEMMs.
        env_vars: environment variables the recipe needs, as ``(name, value)`` pairs.
        bridge_mixed_precision: the closest named recipe of Megatron-Bridge's
            ``megatron.bridge.training.mixed_precision.MIXED_PRECISION_RECIPES``.
        supports_bf16_layers: whether first/last layers may be kept in BF16 (Megatron-Core
            rejects ``first_last_layers_bf16`` with delayed scaling).
    """

    name: str
    description: str
    fp8: str | None
    fp8_recipe: str | None
    fp8_param: bool
    fp8_param_gather: bool
    te_recipe_class: str | None
    seq_padding_multiple: int
    bridge_mixed_precision: str
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    env_vars: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    supports_bf16_layers: bool = True

    @property
    def is_fp8(self) -> bool:
        """Whether any GEMM of the recipe runs in FP8."""
        return self.fp8 is not None

    @property
    def env(self) -> dict[str, str]:
        """The required environment variables as a fresh dict."""
        return dict(self.env_vars)

    def transformer_fields(
        self,
        *,
        num_first_layers_in_bf16: int = 0,
        num_last_layers_in_bf16: int = 0,
        fp8_format: str | None = None,
    ) -> dict[str, FieldValue]:
        """The ``TransformerConfig`` fields this recipe sets.

        Args:
            num_first_layers_in_bf16: transformer layers at the start kept in BF16 (>= 0).
            num_last_layers_in_bf16: transformer layers at the end kept in BF16 (>= 0).
            fp8_format: override of :attr:`fp8` (``"e4m3"`` or ``"hybrid"``); ``None`` keeps the recipe's.

        Returns:
            Field name -> value, keys drawn from :data:`TRANSFORMER_CONFIG_FIELDS`.

        Raises:
            ConfigError: negative layer counts, BF16 layers with delayed scaling, or an unknown format.
        """
        for key, value in (
            ("num_first_layers_in_bf16", num_first_layers_in_bf16),
            ("num_last_layers_in_bf16", num_last_layers_in_bf16),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"recipe {self.name!r}: {key} must be an integer >= 0, got {value!r}")
        keep_bf16 = num_first_layers_in_bf16 > 0 or num_last_layers_in_bf16 > 0
        if not self.is_fp8:
            return {
                "fp8": None,
                "fp8_param": False,
                "first_last_layers_bf16": False,
                "num_layers_at_start_in_bf16": 0,
                "num_layers_at_end_in_bf16": 0,
            }
        if keep_bf16 and not self.supports_bf16_layers:
            raise ConfigError(
                f"recipe {self.name!r} cannot keep first/last layers in BF16 (Megatron-Core rejects "
                f"first_last_layers_bf16 with {self.fp8_recipe} scaling); set num_first_layers_in_bf16 and "
                "num_last_layers_in_bf16 to 0 or use the 'tensorwise' or 'blockwise' recipe"
            )
        fmt = self.fp8 if fp8_format is None else fp8_format
        if fmt not in FP8_FORMATS:
            raise ConfigError(f"recipe {self.name!r}: fp8 format {fmt!r} is not one of {sorted(FP8_FORMATS)}")
        return {
            "fp8": fmt,
            "fp8_recipe": self.fp8_recipe,
            "fp8_param": self.fp8_param,
            "fp8_margin": self.fp8_margin,
            "fp8_amax_history_len": self.fp8_amax_history_len,
            "fp8_amax_compute_algo": self.fp8_amax_compute_algo,
            "first_last_layers_bf16": keep_bf16,
            "num_layers_at_start_in_bf16": num_first_layers_in_bf16,
            "num_layers_at_end_in_bf16": num_last_layers_in_bf16,
        }

    def ddp_fields(self) -> dict[str, FieldValue]:
        """The ``DistributedDataParallelConfig`` fields this recipe sets (keys from :data:`DDP_CONFIG_FIELDS`)."""
        return {"fp8_param_gather": self.fp8_param_gather}


FP8_FORMATS: dict[str, str] = {
    "e4m3": "E4M3 for every FP8 tensor (max 448)",
    "hybrid": "E4M3 for weights and activations, E5M2 for output gradients",
}
"""Megatron-Core ``TransformerConfig.fp8`` values."""

_BLOCK_ENV = ((FP32_BLOCK_SCALES_ENV, "1"),)

_BLOCKWISE = Recipe(
    name="blockwise",
    description="DeepSeek-style sub-channel scaling: 128x128 weight blocks, 1x128 activation groups, E4M3",
    fp8="e4m3",
    fp8_recipe="blockwise",
    fp8_param=False,
    fp8_param_gather=False,
    te_recipe_class="Float8BlockScaling",
    seq_padding_multiple=128,
    bridge_mixed_precision="bf16_with_fp8_subchannel_scaling_mixed",
    env_vars=_BLOCK_ENV,
)
"""The ``blockwise`` recipe; ``fp8_param`` is this recipe plus FP8 primary weights and FP8 parameter all-gather."""

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            name="bf16",
            description="baseline: BF16 GEMMs, no FP8",
            fp8=None,
            fp8_recipe=None,
            fp8_param=False,
            fp8_param_gather=False,
            te_recipe_class=None,
            seq_padding_multiple=16,
            bridge_mixed_precision="bf16_mixed",
        ),
        Recipe(
            name="tensorwise",
            description="per-tensor current scaling (one scale per tensor, computed every step), E4M3/E5M2 hybrid",
            fp8="hybrid",
            fp8_recipe="tensorwise",
            fp8_param=False,
            fp8_param_gather=False,
            te_recipe_class="Float8CurrentScaling",
            seq_padding_multiple=16,
            bridge_mixed_precision="bf16_with_fp8_current_scaling_mixed",
        ),
        _BLOCKWISE,
        replace(
            _BLOCKWISE,
            name="fp8_param",
            description="blockwise + FP8 primary weights and FP8 parameter all-gather (TE's FP8 data is sent as is)",
            fp8_param=True,
            fp8_param_gather=True,
        ),
        Recipe(
            name="delayed",
            description="delayed scaling: scales from an amax history (1024 steps, max), hybrid",
            fp8="hybrid",
            fp8_recipe="delayed",
            fp8_param=False,
            fp8_param_gather=False,
            te_recipe_class="DelayedScaling",
            seq_padding_multiple=16,
            bridge_mixed_precision="bf16_with_fp8_delayed_scaling_mixed",
            fp8_margin=0,
            fp8_amax_history_len=1024,
            fp8_amax_compute_algo="max",
            supports_bf16_layers=False,
        ),
        Recipe(
            name="mxfp8",
            description="MXFP8: 1x32 blocks with UE8M0 (power-of-2) scales, Blackwell only",
            fp8="e4m3",
            fp8_recipe="mxfp8",
            fp8_param=False,
            fp8_param_gather=False,
            te_recipe_class="MXFP8BlockScaling",
            seq_padding_multiple=32,
            bridge_mixed_precision="bf16_with_mxfp8_mixed",
        ),
    )
}
"""Registry of the named recipes, by name."""


def list_recipes() -> tuple[str, ...]:
    """Names of every registered recipe, in registry order (``bf16`` first)."""
    return tuple(RECIPES)


def fp8_recipe_names() -> tuple[str, ...]:
    """Names of the recipes that run GEMMs in FP8 (every recipe but ``bf16``)."""
    return tuple(name for name, r in RECIPES.items() if r.is_fp8)


def get_recipe(name: str | Recipe) -> Recipe:
    """Look up a recipe by name (a :class:`Recipe` passes through).

    Raises:
        ConfigError: for an unknown name; the message lists the valid names.
    """
    if isinstance(name, Recipe):
        return name
    try:
        return RECIPES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown FP8 recipe {name!r}; valid recipes: {', '.join(RECIPES)}") from None
