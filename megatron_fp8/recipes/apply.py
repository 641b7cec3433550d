"""Write a recipe into real Megatron-Core / Megatron-Bridge configs and the environment.

:func:`apply_recipe` works on any config object that carries some of the recipe
fields, and sets exactly the ones it has:

* ``megatron.core.transformer.transformer_config.TransformerConfig`` (and its
  subclasses, e.g. Megatron-Bridge's ``GPTModelProvider``): the FP8 fields. The
  new config is built with :func:`dataclasses.replace`, so Megatron-Core's own
  ``__post_init__`` validation runs on the result;
* ``megatron.core.distributed.DistributedDataParallelConfig``: ``fp8_param_gather``;
* ``megatron.bridge.training.mixed_precision.MixedPrecisionConfig``: both sets
  (it mirrors the Megatron-Core names).

The input config is never modified; a new one is returned.

CPU emulation: without a CUDA GPU every FP8 recipe is unsupported by
:func:`megatron_fp8.recipes.capability.check`. With ``allow_cpu_emulation``
(the default when no GPU is present) the recipe is still applied: its fields
are validated and recorded and no FP8 GEMM runs (TransformerEngine is absent,
Megatron-Core's local layers ignore the FP8 fields; what the math runs in is the trainer's dtype:
:mod:`megatron_fp8.recipes.precision`). On a machine
*with* a GPU an unsupported recipe always raises
:class:`~megatron_fp8.errors.RecipeUnsupportedError`, because TransformerEngine
would assert at the first FP8 GEMM; pass ``check_capability=False`` to skip the
check deliberately.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from megatron_fp8.errors import ConfigError, RecipeUnsupportedError
from megatron_fp8.recipes.capability import (
    Environment,
    Verdict,
    check,
    probe_environment,
    transformer_engine_version,
)
from megatron_fp8.recipes.registry import (
    DDP_CONFIG_FIELDS,
    TRANSFORMER_CONFIG_FIELDS,
    FieldValue,
    Recipe,
    get_recipe,
)

if TYPE_CHECKING:
    from bridge_mappings.adapter import MixedPrecisionConfig

logger = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT")
"""The config type a recipe is applied to (``TransformerConfig``, DDP config, ``MixedPrecisionConfig``, ...):
the recipe fields are found by name (``getattr`` / :func:`dataclasses.fields`), so any class carrying some of
them works, and the result has the input's type."""

MATH_MODES: dict[str, str] = {
    "fp8": "the GEMMs run in FP8 through TransformerEngine",
    "bf16": "BF16 recipe: no FP8 anywhere",
    "bf16-emulated": "no CUDA GPU: FP8 fields validated and recorded, no FP8 GEMM (the trainer's dtype: recipes.precision)",
    "unchecked": "capability check skipped (check_capability=False); FP8 if TransformerEngine accepts it",
}
"""What :attr:`RecipeApplication.math` may say, and what each value means."""


@dataclass(frozen=True)
class RecipeApplication(Generic[ConfigT]):
    """What :func:`apply_recipe_with_report` did.

    Attributes:
        recipe: the recipe name.
        config: the new config object (the input is left unchanged).
        config_type: class name of the config.
        fields_set: field -> value written into the config.
        fields_absent: recipe fields this config type does not have (e.g. ``fp8_param_gather`` on a
            ``TransformerConfig``: it belongs to the DDP config).
        env_set: environment variables written (name -> value).
        math: a key of :data:`MATH_MODES`.
        math_note: the matching :data:`MATH_MODES` text.
        verdict: the capability verdict, ``None`` when the check was skipped.
        seq_padding_multiple: pad sequence lengths to a multiple of this many tokens.
        te_recipe_class: TransformerEngine recipe class Megatron-Core builds, ``None`` for BF16.
    """

    recipe: str
    config: ConfigT
    config_type: str
    fields_set: Mapping[str, FieldValue]
    fields_absent: tuple[str, ...]
    env_set: Mapping[str, str]
    math: str
    math_note: str
    verdict: Verdict | None
    seq_padding_multiple: int
    te_recipe_class: str | None
    notes: tuple[str, ...] = field(default_factory=tuple)


def _has_field(config: object, name: str) -> bool:
    if dataclasses.is_dataclass(config):
        return any(f.name == name for f in dataclasses.fields(config))
    return hasattr(config, name)


def _is_transformer_config(config: object) -> bool:
    return any(
        klass.__name__ == "TransformerConfig" and klass.__module__.startswith("megatron.core")
        for klass in type(config).__mro__
    )


def _num_layers_per_stage(config: object) -> int | None:
    layers = getattr(config, "num_layers", None)
    pp = getattr(config, "pipeline_model_parallel_size", 1) or 1
    if not isinstance(layers, int):
        return None
    return layers // pp


def _decide_math(
    recipe: Recipe,
    *,
    check_capability: bool,
    allow_cpu_emulation: bool | None,
    environment: Environment | None,
) -> tuple[str, Verdict | None]:
    if not recipe.is_fp8:
        return "bf16", check(recipe, environment or Environment()) if check_capability else None
    if not check_capability:
        return "unchecked", None
    environment = probe_environment() if environment is None else environment
    verdict = check(recipe, environment)
    if verdict.supported:
        return "fp8", verdict
    emulate = (not environment.has_gpu) if allow_cpu_emulation is None else allow_cpu_emulation
    reasons = "; ".join(r for r in verdict.reasons)
    if environment.has_gpu:
        raise RecipeUnsupportedError(
            f"FP8 recipe {recipe.name!r} cannot run on {environment.gpu_name} "
            f"(compute capability {environment.to_dict()['compute_capability']}): {reasons}. "
            "Pick a supported recipe (`megatron-fp8 doctor` lists them) or pass check_capability=False to skip"
        )
    if not emulate:
        raise RecipeUnsupportedError(
            f"FP8 recipe {recipe.name!r} is unsupported here and CPU emulation is disabled "
            f"(allow_cpu_emulation=False): {reasons}"
        )
    logger.debug("recipe %r: no CUDA GPU, its FP8 fields are validated and recorded (no FP8 GEMM)", recipe.name)
    return "bf16-emulated", verdict


def _set_env(recipe: Recipe, env: MutableMapping[str, str]) -> dict[str, str]:
    written: dict[str, str] = {}
    for key, value in recipe.env_vars:
        current = env.get(key)
        if current is not None and current != value:
            raise ConfigError(
                f"recipe {recipe.name!r} needs environment variable {key}={value} but it is set to {current!r}; "
                f"unset it or set {key}={value}"
            )
        env[key] = value
        written[key] = value
    return written


def _build(config: ConfigT, updates: Mapping[str, FieldValue], recipe: Recipe) -> tuple[ConfigT, tuple[str, ...]]:
    """A new config with ``updates``; Megatron-Core's validation runs for TransformerConfig."""
    notes: list[str] = []
    if _is_transformer_config(config) and dataclasses.is_dataclass(config) and not isinstance(config, type):
        try:
            return dataclasses.replace(config, **updates), ()
        except (ValueError, AssertionError) as exc:
            raise ConfigError(
                f"Megatron-Core rejected recipe {recipe.name!r} on {type(config).__name__}: {exc}; "
                "adjust the BF16 layer counts or the model parallel sizes"
            ) from exc
        except TypeError as exc:
            # Megatron-Core's MoE checks compare TE versions and fail with a TypeError when TE is absent.
            if transformer_engine_version() is not None:
                raise
            notes.append(
                f"Megatron-Core's __post_init__ needs TransformerEngine for this config ({exc}); "
                "the fields were set directly after megatron-fp8's own checks"
            )
            logger.debug(notes[-1])
    new = copy.copy(config)
    for key, value in updates.items():
        setattr(new, key, value)
    return new, tuple(notes)


def apply_recipe_with_report(
    config: ConfigT,
    recipe_or_name: str | Recipe,
    *,
    num_first_layers_in_bf16: int = 0,
    num_last_layers_in_bf16: int = 0,
    fp8_format: str | None = None,
    check_capability: bool = True,
    allow_cpu_emulation: bool | None = None,
    environment: Environment | None = None,
    env: MutableMapping[str, str] | None = None,
) -> RecipeApplication[ConfigT]:
    """Apply a recipe and report exactly what was set.

    Args:
        config: a ``TransformerConfig`` (or subclass), ``DistributedDataParallelConfig`` or Megatron-Bridge
            ``MixedPrecisionConfig``; left unchanged.
        recipe_or_name: a :class:`~megatron_fp8.recipes.registry.Recipe` or its name.
        num_first_layers_in_bf16: transformer layers at the start kept in BF16.
        num_last_layers_in_bf16: transformer layers at the end kept in BF16.
        fp8_format: override of the recipe's ``fp8`` format (``"e4m3"`` or ``"hybrid"``).
        check_capability: check the recipe against ``environment`` first.
        allow_cpu_emulation: apply an unsupported FP8 recipe anyway when no GPU is present (fields validated
            and recorded, math in BF16). ``None``: on exactly when the environment has no CUDA GPU.
        environment: the machine description; ``None`` probes this machine.
        env: environment mapping to write the recipe's variables into; ``None`` means ``os.environ``.

    Returns:
        A :class:`RecipeApplication` whose ``config`` is the new config.

    Raises:
        ConfigError: unknown recipe, bad layer counts, a config without any recipe field, a conflicting
            environment variable, or Megatron-Core's validation rejecting the result.
        RecipeUnsupportedError: the recipe cannot run here (see the module docstring).
    """
    recipe = get_recipe(recipe_or_name)
    env = os.environ if env is None else env
    wanted = recipe.transformer_fields(
        num_first_layers_in_bf16=num_first_layers_in_bf16,
        num_last_layers_in_bf16=num_last_layers_in_bf16,
        fp8_format=fp8_format,
    )
    wanted.update(recipe.ddp_fields())
    present = {k: v for k, v in wanted.items() if _has_field(config, k)}
    absent = tuple(k for k in wanted if k not in present)
    if not present:
        raise ConfigError(
            f"{type(config).__name__} has none of the recipe fields {list(TRANSFORMER_CONFIG_FIELDS + DDP_CONFIG_FIELDS)}; "
            "pass a Megatron-Core TransformerConfig, DistributedDataParallelConfig or Megatron-Bridge MixedPrecisionConfig"
        )
    per_stage = _num_layers_per_stage(config)
    if recipe.is_fp8 and per_stage is not None:
        for key, value in (
            ("num_first_layers_in_bf16", num_first_layers_in_bf16),
            ("num_last_layers_in_bf16", num_last_layers_in_bf16),
        ):
            if value > per_stage:
                raise ConfigError(
                    f"recipe {recipe.name!r}: {key}={value} exceeds the {per_stage} layers per pipeline stage of "
                    f"this {type(config).__name__}; use at most {per_stage}"
                )
    math, verdict = _decide_math(
        recipe, check_capability=check_capability, allow_cpu_emulation=allow_cpu_emulation, environment=environment
    )
    new_config, notes = _build(config, present, recipe)
    env_set = _set_env(recipe, env)
    logger.debug(
        "recipe %r applied to %s: %s (env %s, math %s)", recipe.name, type(config).__name__, present, env_set, math
    )
    return RecipeApplication(
        recipe=recipe.name,
        config=new_config,
        config_type=type(config).__name__,
        fields_set=dict(present),
        fields_absent=absent,
        env_set=env_set,
        math=math,
        math_note=MATH_MODES[math],
        verdict=verdict,
        seq_padding_multiple=recipe.seq_padding_multiple,
        te_recipe_class=recipe.te_recipe_class,
        notes=notes,
    )


def apply_recipe(
    config: ConfigT,
    recipe_or_name: str | Recipe,
    *,
    num_first_layers_in_bf16: int = 0,
    num_last_layers_in_bf16: int = 0,
    fp8_format: str | None = None,
    check_capability: bool = True,
    allow_cpu_emulation: bool | None = None,
    environment: Environment | None = None,
    env: MutableMapping[str, str] | None = None,
) -> ConfigT:
    """Apply a recipe and return the new config (see :func:`apply_recipe_with_report` for the arguments)."""
    return apply_recipe_with_report(
        config,
        recipe_or_name,
        num_first_layers_in_bf16=num_first_layers_in_bf16,
        num_last_layers_in_bf16=num_last_layers_in_bf16,
        fp8_format=fp8_format,
        check_capability=check_capability,
        allow_cpu_emulation=allow_cpu_emulation,
        environment=environment,
        env=env,
    ).config


def build_bridge_mixed_precision(
    recipe_or_name: str | Recipe,
    *,
    num_first_layers_in_bf16: int = 0,
    num_last_layers_in_bf16: int = 0,
    fp8_format: str | None = None,
    check_capability: bool = True,
    allow_cpu_emulation: bool | None = None,
    environment: Environment | None = None,
    env: MutableMapping[str, str] | None = None,
) -> MixedPrecisionConfig:
    """A Megatron-Bridge ``MixedPrecisionConfig`` for the recipe (BF16 base + the recipe's FP8 fields).

    Starts from Bridge's ``bf16_mixed()`` and applies the recipe on top, so the result is the same whichever
    Bridge named recipe is closest. Needs megatron-bridge installed.

    Raises:
        ConfigError: Megatron-Bridge is not importable; the message names the remedy.
    """
    from bridge_mappings.adapter import bf16_mixed_precision  # lazy: pulls torch; recipes must stay torch-free

    return apply_recipe(
        bf16_mixed_precision(),
        recipe_or_name,
        num_first_layers_in_bf16=num_first_layers_in_bf16,
        num_last_layers_in_bf16=num_last_layers_in_bf16,
        fp8_format=fp8_format,
        check_capability=check_capability,
        allow_cpu_emulation=allow_cpu_emulation,
        environment=environment,
        env=env,
    )
