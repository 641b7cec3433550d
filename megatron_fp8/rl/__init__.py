"""rl stage: the GRPO run (BF16 vs FP8 vs FP8+TIS rollout) and what it is built from.

* :mod:`megatron_fp8.rl.grpo` -- the driver, :func:`~megatron_fp8.rl.grpo.run_grpo` (arguments -> arms -> outputs);
* :mod:`megatron_fp8.rl.phases` -- one step of one arm: rollout -> score -> train -> refit;
* :mod:`megatron_fp8.rl.batch` -- prompt + response batches for the trainer, group advantages;
* :mod:`megatron_fp8.rl.results` -- step / arm / run results and the output file names;
* :mod:`megatron_fp8.rl.report` -- ``metrics.jsonl`` reader, ``summary.md``, ``metrics.png``;
* :mod:`megatron_fp8.rl.distributed` -- data-parallel GRPO ranks and the rank-0 helpers;
* :mod:`megatron_fp8.rl.fp8_rollout` -- vLLM's FP8 quantization config and manifest for a run;
* :mod:`megatron_fp8.rl.warm_start` -- the supervised warm start shared by every arm;
* :mod:`megatron_fp8.rl.task` -- the verifiable toy tasks and their rewards;
* :mod:`megatron_fp8.rl.correction` -- IS weights (token TIS, sequence IS, masked
  variants) and the PPO clipped loss that applies them;
* :mod:`megatron_fp8.rl.metrics` -- train/rollout mismatch metrics for logging;
* :mod:`megatron_fp8.rl.kv_calibration` -- q/k/v amax recording during the training
  forward and the per-layer scales sent to vLLM's FP8 KV cache;
* :mod:`megatron_fp8.rl.refit_session` -- what ``megatron-fp8 refit`` measures (FP8 vs BF16 refits).

Only the correction, metrics and KV-calibration names are re-exported here (importing the
package stays light); import the driver from :mod:`megatron_fp8.rl.grpo`.
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
