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

from megatron_fp8.exports import lazy_exports

_EXPORTS = {  # exported name -> the module that defines it (resolved on first use: megatron_fp8.exports)
    "IS_VARIANTS": "megatron_fp8.rl.algorithm.correction",
    "LOSS_AGGREGATIONS": "megatron_fp8.rl.algorithm.correction",
    "ISConfig": "megatron_fp8.rl.algorithm.correction",
    "ISResult": "megatron_fp8.rl.algorithm.correction",
    "PPOStats": "megatron_fp8.rl.algorithm.correction",
    "compute_is_weights": "megatron_fp8.rl.algorithm.correction",
    "ppo_loss": "megatron_fp8.rl.algorithm.correction",
    "KV_HOOK_ATTACHERS": "megatron_fp8.rl.algorithm.kv_calibration",
    "KVAmaxRecorder": "megatron_fp8.rl.algorithm.kv_calibration",
    "KVHookHandle": "megatron_fp8.rl.algorithm.kv_calibration",
    "attach_kv_amax_hooks": "megatron_fp8.rl.algorithm.kv_calibration",
    "compute_kv_scales": "megatron_fp8.rl.algorithm.kv_calibration",
    "kv_scale_name": "megatron_fp8.rl.algorithm.kv_calibration",
    "split_megatron_qkv": "megatron_fp8.rl.algorithm.kv_calibration",
    "METRIC_KEYS": "megatron_fp8.rl.algorithm.metrics",
    "mismatch_metrics": "megatron_fp8.rl.algorithm.metrics",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
