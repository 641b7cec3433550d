"""rl stage: importance-sampling correction, mismatch metrics, FP8 KV-cache scale calibration.

* :mod:`megatron_fp8.rl.correction` -- IS weights (token TIS, sequence IS, masked
  variants) and the PPO clipped loss that applies them;
* :mod:`megatron_fp8.rl.metrics` -- train/rollout mismatch metrics for logging;
* :mod:`megatron_fp8.rl.kv_calibration` -- q/k/v amax recording during the training
  forward and the per-layer scales sent to vLLM's FP8 KV cache.
"""

from megatron_fp8.rl.correction import (
    IS_VARIANTS,
    LOSS_AGGREGATIONS,
    ISConfig,
    ISResult,
    PPOStats,
    compute_is_weights,
    ppo_loss,
)
from megatron_fp8.rl.kv_calibration import (
    KV_HOOK_ATTACHERS,
    KVAmaxRecorder,
    KVHookHandle,
    attach_kv_amax_hooks,
    compute_kv_scales,
    kv_scale_name,
    split_megatron_qkv,
)
from megatron_fp8.rl.metrics import METRIC_KEYS, mismatch_metrics

__all__ = [
    "IS_VARIANTS",
    "KV_HOOK_ATTACHERS",
    "LOSS_AGGREGATIONS",
    "METRIC_KEYS",
    "ISConfig",
    "ISResult",
    "KVAmaxRecorder",
    "KVHookHandle",
    "PPOStats",
    "attach_kv_amax_hooks",
    "compute_is_weights",
    "compute_kv_scales",
    "kv_scale_name",
    "mismatch_metrics",
    "ppo_loss",
    "split_megatron_qkv",
]
