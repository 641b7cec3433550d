"""What a GRPO run produces: per-step metrics, per-arm and per-run results, output file names.

No torch, Megatron or vLLM here: :mod:`megatron_fp8.rl.state.report` reads these types to write the
summary and the plot, and :mod:`megatron_fp8.rl.driver.grpo` fills them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_fp8.errors import ConfigError
from megatron_fp8.vocab import PAYLOAD_CLASSES

METRICS_FILE = "metrics.jsonl"
"""One JSON line per step and arm (:meth:`StepMetrics.to_json_dict`)."""
SUMMARY_FILE = "summary.md"
"""The per-arm markdown table (:func:`megatron_fp8.rl.state.report.write_summary`)."""
PLOT_FILE = "metrics.png"
"""Reward and gen_kl per step (:func:`megatron_fp8.rl.state.report.plot_metrics`)."""
CONFIG_FILE = "config.yaml"
"""The run configuration as resolved."""
VALIDATION_FILE = "validation.jsonl"
"""One JSON line per validation (:meth:`megatron_fp8.rl.driver.validation.ValidationResult.to_json_dict`)."""
LOGS_DIR = "logs"
"""Default folder of the TensorBoard / W&B files (``logger.log_dir``)."""
WARM_START_DIR = "warm_start"
"""Sub-folder of the output folder holding the warm-start HF checkpoint."""
CHECKPOINTS_DIR = "checkpoints"
"""Sub-folder of the output folder holding the run's checkpoints when ``checkpointing.checkpoint_dir`` is unset."""

JSONRecord = dict[str, object]
"""One flat JSON object (a line of ``metrics.jsonl``)."""

TIMING_SUFFIXES = ("_seconds", "_per_s_per_rank", "_seconds_per_rank")
"""A ``metrics.jsonl`` key ending so is measured by the clock (differs between two runs of the same steps)."""
_RECORD_EXTRAS = frozenset({"training_recipe", "training_math"})
"""Per-arm facts the driver adds to each record (not :class:`StepMetrics` fields)."""


@dataclass(frozen=True)
class RefitDone:
    """One refit of an arm's engine after the updates, as the trainer sees it (colocated or remote).

    Attributes:
        payload_bytes: bytes sent per class (``fp8``, ``scales``, ``bf16``, ``other``).
        seconds: export + quantization + transfer + verified commit, seconds.
        version: the engine's weight version after the refit.
        max_rel_error: worst relative weight error of the post-refit verification (``nan``: not verified).
        prefix_cache: how the engines retired their prefix caches (a key of
            :data:`megatron_fp8.vocab.PREFIX_CACHE_RESETS`; with several engines, the least checked one).
        host_staged_bytes: bytes of the version this rank's engine kept in host memory until its commit (the
            receiver's host staging; 0 when it stayed on the engine's GPU or the engine is remote).
        device_staged_bytes: the same on the engine's GPU (the refit kept on the device).
    """

    payload_bytes: dict[str, int]
    seconds: float
    version: int
    max_rel_error: float
    prefix_cache: str = "no_cache"
    host_staged_bytes: int = 0
    device_staged_bytes: int = 0


def least_checked_prefix_cache(states: Sequence[str | None]) -> str:
    """The least checked of several engines' prefix-cache retirements (keys of
    :data:`megatron_fp8.vocab.PREFIX_CACHE_RESETS`): ``reset_unprobed``, then ``slept``, then ``reset``, then
    ``no_cache``."""
    for state in ("reset_unprobed", "slept", "reset"):
        if state in states:
            return state
    return "no_cache"


def finite_mean(values: Sequence[float]) -> float:
    """Mean of the finite values; ``nan`` when there are none."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


@dataclass(frozen=True)
class StepMetrics:
    """What one GRPO step of one arm measured.

    Attributes:
        arm: arm name.
        step: 0-based step index.
        engine: rollout engine name (``reference-fp8``, ``vllm-bf16``, ...).
        reward_mean: mean reward over the step's responses (with dynamic sampling: every response of every round,
            NeMo-RL's ``reward``; the trained ones' mean is ``filtered_reward_mean``).
        reward_std: population standard deviation of the rewards.
        reward_max: best reward of the step.
        exact_match: fraction of responses that are exactly right (and stopped at EOS); with dynamic sampling, of
            every response of every round.
        response_tokens_mean: mean response length (tokens, EOS included).
        loss: PPO loss (mean over the step's optimizer updates, before each update).
        grad_norm: gradient L2 norm before clipping (mean over updates).
        update_successful: every optimizer update was applied (finite gradients).
        learning_rate: learning rate used this step.
        ppo_clip_fraction: fraction of tokens where the PPO clip was active (last update).
        ppo_approx_kl: k3 KL(old || new) estimate (last update).
        is_applied: whether the IS weights entered the loss (``fp8_tis``).
        is_variant: the IS variant whose statistics are logged.
        is_weight_mean: mean IS weight over response tokens.
        is_truncated_fraction: fraction of tokens whose weight the cap lowered.
        is_masked_fraction: fraction of tokens rejected by a band (masking variants).
        mismatch: :func:`~megatron_fp8.rl.algorithm.metrics.mismatch_metrics` of ``logp_train_old`` vs
            ``logp_rollout`` (keys of :data:`~megatron_fp8.rl.algorithm.metrics.METRIC_KEYS`).
        refit_bytes: refit payload bytes by class (``fp8``, ``scales``, ``bf16``, ``other``).
        refit_seconds: wall time of the refit after the update (export, quantization, transfer,
            verified commit), seconds.
        refit_version: engine weight version after the refit.
        refit_max_rel_error: worst relative weight error the post-refit verification found
            (FP8 rounding for quantized weights; ``nan`` when verification is off).
        refit_prefix_cache: how the refit retired the engine's prefix cache (a key of
            :data:`megatron_fp8.vocab.PREFIX_CACHE_RESETS`; ``""`` in records written before it existed).
        rollout_seconds: generation time, seconds.
        rollout_age_steps: updates the samples' generating weights were behind the trainer's (``grpo.async_grpo``:
            1 when they were generated during the previous step's training; 0 synchronous).
        rollout_busy_seconds: the engine's generation time for the step (the rollout ranks' own when separate).
        rollout_wait_seconds: the trainer's time waiting for the step's samples; ``rollout_busy_seconds`` minus it
            is the generation hidden behind training (``rollout_overlap_seconds`` in the record).
        filtered_reward_mean: ``grpo.use_dynamic_sampling``: the mean reward of the samples trained on (NeMo-RL's
            ``filtered_reward``; ``nan`` without dynamic sampling).
        dynamic_sampling_num_gen_batches: generation rounds of the step (0: dynamic sampling off).
        dynamic_sampling_num_discarded_valid_samples: samples with varying group rewards beyond the step's need.
        dynamic_sampling_filtered_share: the share of generated samples left out for equal group rewards.
        train_seconds: trainer scoring + optimizer updates, seconds.
        step_seconds: whole step, seconds.
        sample: one prompt and response of the step, for reading.
        reward_errors: responses whose reward function raised (scored 0, reported in the log).
        kl_penalty: the KL-to-reference term of the loss, ``beta`` x the mean per-token estimate (last update; 0
            without ``loss_fn.reference_policy_kl_penalty``; NeMo-RL logs the same quantity as ``kl_penalty``).
        rollout_prompts_per_rank: per trainer rank (rank order), the samples (prompt x generation) its engine
            generated this step: each replica's samples are split over its ranks' engines (empty in older records).
        rollout_tokens_per_s_per_rank: per trainer rank, the response tokens its engine generated over its
            generation time (tokens/s).
        refit_host_staged_bytes_per_rank: per trainer rank, the bytes of the version its colocated engine kept in
            host memory until the commit (empty in older records).
        refit_device_staged_bytes_per_rank: per trainer rank, the same kept on the engine's GPU.
        reward_mean_per_rank: per trainer rank, the mean reward of the samples its replica trained on (the ranks of
            one replica agree; replicas differ: each trains on its own samples).
        refit_bytes_per_rank: per trainer rank, the refit payload bytes it sent (its engine shard's part).
        refit_seconds_per_rank: per trainer rank, its refit's wall time, seconds.
        trainer_tokens_real_per_rank: per trainer rank, the real tokens (prompt + response) of every trainer pass of
            the step (old-policy and reference scores, each training pass).
        trainer_tokens_computed_per_rank: per trainer rank, the token positions those passes computed (real +
            padding): ``trainer_padding_share`` in the record is the share of them that is padding.
    """

    arm: str
    step: int
    engine: str
    reward_mean: float
    reward_std: float
    reward_max: float
    exact_match: float
    response_tokens_mean: float
    loss: float
    grad_norm: float
    update_successful: bool
    learning_rate: float
    ppo_clip_fraction: float
    ppo_approx_kl: float
    is_applied: bool
    is_variant: str
    is_weight_mean: float
    is_truncated_fraction: float
    is_masked_fraction: float
    mismatch: Mapping[str, float]
    refit_bytes: Mapping[str, int]
    refit_seconds: float
    refit_version: int
    refit_max_rel_error: float
    rollout_seconds: float
    train_seconds: float
    step_seconds: float
    sample: str = ""
    reward_errors: int = 0
    refit_prefix_cache: str = ""
    kl_penalty: float = 0.0
    rollout_prompts_per_rank: tuple[int, ...] = ()
    rollout_tokens_per_s_per_rank: tuple[float, ...] = ()
    refit_host_staged_bytes_per_rank: tuple[int, ...] = ()
    refit_device_staged_bytes_per_rank: tuple[int, ...] = ()
    reward_mean_per_rank: tuple[float, ...] = ()
    refit_bytes_per_rank: tuple[int, ...] = ()
    refit_seconds_per_rank: tuple[float, ...] = ()
    trainer_tokens_real_per_rank: tuple[int, ...] = ()
    trainer_tokens_computed_per_rank: tuple[int, ...] = ()
    rollout_age_steps: int = 0
    rollout_busy_seconds: float = 0.0
    rollout_wait_seconds: float = 0.0
    filtered_reward_mean: float = float("nan")
    dynamic_sampling_num_gen_batches: int = 0
    dynamic_sampling_num_discarded_valid_samples: int = 0
    dynamic_sampling_filtered_share: float = 0.0

    @property
    def rollout_overlap_seconds(self) -> float:
        """Generation time hidden behind the trainer's work (busy minus waited, >= 0), seconds."""
        return max(0.0, self.rollout_busy_seconds - self.rollout_wait_seconds)

    @property
    def trainer_padding_share(self) -> float:
        """The share of the token positions the trainer computed that were padding, over every rank (``nan`` when
        not recorded)."""
        computed = sum(self.trainer_tokens_computed_per_rank)
        return 1.0 - sum(self.trainer_tokens_real_per_rank) / computed if computed else float("nan")

    @property
    def gen_kl(self) -> float:
        """KL(pi_rollout || pi_train) per token, k3 estimator (>= 0): the mismatch headline number."""
        return float(self.mismatch["gen_kl_k3"])

    @property
    def refit_payload_ratio(self) -> float:
        """Refit bytes sent over the bytes the same weights take in BF16 (1 byte per FP8 element -> 2; scales count
        as overhead): 1.0 for a BF16 refit, ~0.54 for the tiny model's FP8 refit; ``nan`` when nothing was sent."""
        b = self.refit_bytes
        bf16_equivalent = 2 * int(b.get("fp8", 0)) + int(b.get("bf16", 0)) + int(b.get("other", 0))
        return sum(b.values()) / bf16_equivalent if bf16_equivalent else float("nan")

    def to_json_dict(self) -> JSONRecord:
        """One flat JSON-able record: mismatch keys at the top level, ``gen_kl`` = ``gen_kl_k3``,
        ``refit_{fp8,scales,bf16,other,total}_bytes``, ``refit_payload_ratio``; non-finite floats become ``None``."""
        out: JSONRecord = {}
        for f in dataclasses.fields(self):
            if f.name in ("mismatch", "refit_bytes"):
                continue
            out[f.name] = getattr(self, f.name)
        out["gen_kl"] = self.gen_kl
        out.update({k: float(v) for k, v in self.mismatch.items()})
        for cls in PAYLOAD_CLASSES:
            out[f"refit_{cls}_bytes"] = int(self.refit_bytes.get(cls, 0))
        out["refit_total_bytes"] = int(sum(self.refit_bytes.values()))
        out["refit_payload_ratio"] = self.refit_payload_ratio
        out["trainer_padding_share"] = self.trainer_padding_share
        out["rollout_overlap_seconds"] = self.rollout_overlap_seconds
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}

    @classmethod
    def from_json_dict(cls, record: JSONRecord, *, where: str = "metrics record") -> StepMetrics:
        """Inverse of :meth:`to_json_dict` (``None`` floats come back as ``nan``).

        Raises:
            ConfigError: a field is missing (the message names it and ``where``).
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, object] = {}
        for name, f in fields.items():
            if name == "mismatch":  # every key that is neither a field nor derived by to_json_dict
                derived = {
                    "gen_kl",
                    "refit_payload_ratio",
                    "trainer_padding_share",
                    "rollout_overlap_seconds",
                    *(f"refit_{c}_bytes" for c in (*PAYLOAD_CLASSES, "total")),
                }
                values[name] = {
                    k: float("nan") if v is None else float(v)  # type: ignore[arg-type]
                    for k, v in record.items()
                    if k not in fields and k not in derived and k not in _RECORD_EXTRAS
                }
            elif name == "refit_bytes":
                values[name] = {c: int(record.get(f"refit_{c}_bytes") or 0) for c in PAYLOAD_CLASSES}
            elif name in record:
                v = record[name]
                if isinstance(v, list):
                    v = tuple(v)
                values[name] = float("nan") if v is None and f.type in ("float", float) else v
            elif f.default is dataclasses.MISSING:
                raise ConfigError(f"{where}: field {name!r} is missing; was the file written by megatron-fp8 grpo?")
        if "gen_kl_k3" not in values["mismatch"]:  # type: ignore[operator]
            raise ConfigError(f"{where}: field 'gen_kl_k3' is missing; was the file written by megatron-fp8 grpo?")
        return cls(**values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ArmResult:
    """All steps of one arm.

    Attributes:
        arm: arm name.
        engine: rollout engine name.
        training_recipe: the training recipe recorded for the arm (``bf16``, ``blockwise``, ...).
        training_math: what the training math ran in (:func:`megatron_fp8.recipes.precision.math_label`: ``fp8``,
            ``bf16`` / ``bf16-emulated`` on a GPU, ``fp32`` / ``fp32-emulated`` in the CPU trainer).
        steps: per-step metrics, in order.
        seconds: wall time of the arm, seconds.
    """

    arm: str
    engine: str
    training_recipe: str
    training_math: str
    steps: tuple[StepMetrics, ...]
    seconds: float

    def _series(self, key: Callable[[StepMetrics], float]) -> list[float]:
        return [key(s) for s in self.steps]

    @property
    def first_reward(self) -> float:
        """Mean reward of the first step."""
        return self.steps[0].reward_mean if self.steps else float("nan")

    @property
    def last_reward(self) -> float:
        """Mean reward of the last step."""
        return self.steps[-1].reward_mean if self.steps else float("nan")

    @property
    def best_reward(self) -> float:
        """Best per-step mean reward."""
        return max(self._series(lambda s: s.reward_mean), default=float("nan"))

    @property
    def mean_gen_kl(self) -> float:
        """Mean over steps of :attr:`StepMetrics.gen_kl`."""
        return finite_mean(self._series(lambda s: s.gen_kl))

    @property
    def mean_token_mult_prob_error(self) -> float:
        """Mean over steps of ``token_mult_prob_error``."""
        return finite_mean(self._series(lambda s: s.mismatch["token_mult_prob_error"]))

    @property
    def mean_refit_bytes(self) -> dict[str, float]:
        """Mean refit payload bytes per class, plus ``total``."""
        out = {
            c: finite_mean(self._series(lambda s, c=c: float(s.refit_bytes.get(c, 0))))
            for c in ("fp8", "scales", "bf16")
        }
        out["total"] = finite_mean(self._series(lambda s: float(sum(s.refit_bytes.values()))))
        return out

    @property
    def mean_refit_seconds(self) -> float:
        """Mean refit wall time, seconds."""
        return finite_mean(self._series(lambda s: s.refit_seconds))


@dataclass(frozen=True)
class GRPOResult:
    """A finished run.

    Attributes:
        arms: per arm, in run order.
        out_dir: the output folder.
        metrics_path: ``metrics.jsonl`` (one line per step and arm).
        summary_path: ``summary.md`` (``None`` on ranks other than 0, which write nothing).
        plot_path: ``metrics.png``.
        manifest_source: how the FP8 manifest was obtained (``""`` without FP8 arms).
        seconds: wall time of the run, seconds.
    """

    arms: tuple[ArmResult, ...]
    out_dir: Path
    metrics_path: Path
    summary_path: Path | None
    plot_path: Path | None
    manifest_source: str = ""
    seconds: float = 0.0

    def arm(self, name: str) -> ArmResult:
        """The result of arm ``name``.

        Raises:
            ConfigError: the arm did not run (the message lists those that did).
        """
        for a in self.arms:
            if a.arm == name:
                return a
        raise ConfigError(f"arm {name!r} did not run; arms of this run: {', '.join(a.arm for a in self.arms)}")


def arms_from_records(
    records: Sequence[JSONRecord], *, arm_order: Sequence[str] | None = None, where: str = "metrics.jsonl"
) -> list[ArmResult]:
    """Group ``metrics.jsonl`` records into per-arm results (steps in file order).

    Training recipe and math are read from the records when present, else ``"n/a"``; arm seconds
    are the sum of the step times.
    """
    by_arm: dict[str, list[StepMetrics]] = {}
    extra: dict[str, JSONRecord] = {}
    for i, rec in enumerate(records, start=1):
        step = StepMetrics.from_json_dict(rec, where=f"{where}:{i}")
        by_arm.setdefault(step.arm, []).append(step)
        extra.setdefault(step.arm, rec)
    order = list(arm_order) if arm_order is not None else list(by_arm)
    return [
        ArmResult(
            arm=name,
            engine=by_arm[name][0].engine,
            training_recipe=str(extra[name].get("training_recipe", "n/a")),
            training_math=str(extra[name].get("training_math", "n/a")),
            steps=tuple(by_arm[name]),
            seconds=sum(s.step_seconds for s in by_arm[name]),
        )
        for name in order
        if name in by_arm
    ]
