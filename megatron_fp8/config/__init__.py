"""The run configuration: one typed schema, loaded from YAML with dotted overrides.

``load_config(None)`` gives the embedded default (``configs/tiny_cpu.yaml``,
shipped as package data); NeMo-RL config files load as they are (``defaults:``
parents, ``_override_``, interpolations and NeMo-RL's resolvers:
:mod:`megatron_fp8.config.nemo_rl.inheritance`), NeMo-RL keys megatron-fp8 does not
implement are accepted with one "no effect" warning
(:mod:`megatron_fp8.config.nemo_rl.keys`), and :mod:`megatron_fp8.config.explain`
says what every key does. See
:mod:`megatron_fp8.config.schema` for the layout and
:mod:`megatron_fp8.config.validate` for the cross-field rules.
"""

from __future__ import annotations

from megatron_fp8.config.loader import (
    DEFAULT_CONFIG_NAME,
    LoadedConfig,
    build_dataclass,
    config_from_dict,
    default_config_text,
    load_config,
    load_config_report,
)
from megatron_fp8.config.models import KNOWN_MODELS, ModelDims, known_dims, model_key
from megatron_fp8.config.schema import (
    FP8TrainConfig,
    GenerationConfig,
    GRPOConfig,
    KVCacheConfig,
    LoggingConfig,
    LossConfig,
    MegatronConfig,
    ModelConfig,
    OptimizerConfig,
    PolicyConfig,
    QuantizationConfig,
    RefitConfig,
    RolloutConfig,
    RunConfig,
    VllmConfig,
)
from megatron_fp8.config.validate import tp_sizes_that_work, validate_config, validate_tp_divisibility

__all__ = [
    "DEFAULT_CONFIG_NAME",
    "KNOWN_MODELS",
    "FP8TrainConfig",
    "GRPOConfig",
    "GenerationConfig",
    "KVCacheConfig",
    "LoadedConfig",
    "LoggingConfig",
    "LossConfig",
    "MegatronConfig",
    "ModelConfig",
    "ModelDims",
    "OptimizerConfig",
    "PolicyConfig",
    "QuantizationConfig",
    "RefitConfig",
    "RolloutConfig",
    "RunConfig",
    "VllmConfig",
    "build_dataclass",
    "config_from_dict",
    "default_config_text",
    "known_dims",
    "load_config",
    "load_config_report",
    "model_key",
    "tp_sizes_that_work",
    "validate_config",
    "validate_tp_divisibility",
]
