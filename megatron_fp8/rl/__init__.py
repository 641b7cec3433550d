"""rl stage: the GRPO run (BF16 vs FP8 vs FP8+TIS rollout), as rooms that data flows down through.

* :mod:`megatron_fp8.rl.driver` -- the run: :func:`~megatron_fp8.rl.driver.grpo.run_grpo`, its preflight, arms,
  phases (rollout -> score -> train -> refit), validation, warm start, stopping, FP8 rollout setup, refit session;
* :mod:`megatron_fp8.rl.cluster` -- devices, roles and process groups, data-parallel helpers, remote rollout;
* :mod:`megatron_fp8.rl.state` -- results, output folder, loggers, summary and plot, checkpoints;
* :mod:`megatron_fp8.rl.data` -- problems (dataset or toy task), prompts and rewards;
* :mod:`megatron_fp8.rl.algorithm` -- batches and advantages, IS correction and PPO loss, KL penalty,
  mismatch metrics, KV-scale calibration.

A room imports only rooms on a lower floor (driver > cluster > state, data, algorithm; ``tests/test_architecture.py``
checks it). Only the correction, metrics and KV-calibration names are re-exported here (importing the package stays
light); import the driver from :mod:`megatron_fp8.rl.driver.grpo`.
"""

from megatron_fp8.rl.algorithm.correction import (
    IS_VARIANTS,
    LOSS_AGGREGATIONS,
    ISConfig,
    ISResult,
    PPOStats,
    compute_is_weights,
    ppo_loss,
)
from megatron_fp8.rl.algorithm.kv_calibration import (
    KV_HOOK_ATTACHERS,
    KVAmaxRecorder,
    KVHookHandle,
    attach_kv_amax_hooks,
    compute_kv_scales,
    kv_scale_name,
    split_megatron_qkv,
)
from megatron_fp8.rl.algorithm.metrics import METRIC_KEYS, mismatch_metrics

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
