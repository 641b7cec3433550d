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

from megatron_fp8.exports import lazy_exports

_EXPORTS = {  # exported name -> the module that defines it (resolved on first use: megatron_fp8.exports)
    "DEFAULT_CONFIG_NAME": "megatron_fp8.config.loader",
    "LoadedConfig": "megatron_fp8.config.loader",
    "build_dataclass": "megatron_fp8.config.convert",
    "config_from_dict": "megatron_fp8.config.loader",
    "default_config_text": "megatron_fp8.config.loader",
    "load_config": "megatron_fp8.config.loader",
    "load_config_report": "megatron_fp8.config.loader",
    "KNOWN_MODELS": "megatron_fp8.models.dims",
    "ModelDims": "megatron_fp8.models.dims",
    "known_dims": "megatron_fp8.models.dims",
    "model_key": "megatron_fp8.models.dims",
    "FP8TrainConfig": "megatron_fp8.config.schema",
    "GenerationConfig": "megatron_fp8.config.schema",
    "GRPOConfig": "megatron_fp8.config.schema",
    "KVCacheConfig": "megatron_fp8.config.schema",
    "LoggingConfig": "megatron_fp8.config.schema",
    "LossConfig": "megatron_fp8.config.schema",
    "MegatronConfig": "megatron_fp8.config.schema",
    "ModelConfig": "megatron_fp8.config.schema",
    "OptimizerConfig": "megatron_fp8.config.schema",
    "PolicyConfig": "megatron_fp8.config.schema",
    "QuantizationConfig": "megatron_fp8.config.schema",
    "RefitConfig": "megatron_fp8.config.schema",
    "RolloutConfig": "megatron_fp8.config.schema",
    "RunConfig": "megatron_fp8.config.schema",
    "VllmConfig": "megatron_fp8.config.schema",
    "tp_sizes_that_work": "megatron_fp8.config.validate",
    "validate_config": "megatron_fp8.config.validate",
    "validate_tp_divisibility": "megatron_fp8.config.validate",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
