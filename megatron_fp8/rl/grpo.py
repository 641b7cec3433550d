"""The GRPO driver: BF16 vs FP8 vs FP8+TIS rollout on one model, one seed, one task.

:func:`run_grpo` runs each arm of ``config.grpo.arms`` (:data:`megatron_fp8.vocab.ARMS`) from the same
initial weights, the same prompts and the same sampling seeds. One step of one arm:

1. sample ``num_prompts_per_step`` problems of the toy task (:mod:`megatron_fp8.rl.task`),
   the same for every arm;
2. roll out ``num_generations_per_prompt`` responses per prompt with the arm's engine
   (:mod:`megatron_fp8.rollout.engines`; BF16 or FP8 weights) and keep the engine's per-token
   log-probabilities ``logp_rollout``;
3. score the responses (verifiable partial-credit reward) and normalise within each
   group: ``A = (r - mean_group) / (std_group + 1e-6)``;
4. score the same tokens with the Megatron-Core trainer (no grad): ``logp_train_old``;
   log :func:`~megatron_fp8.rl.metrics.mismatch_metrics` between the two;
5. importance weights: none for ``bf16`` and ``fp8``; ``loss_fn.is_variant`` (token TIS,
   C = ``loss_fn.is_cap``) for ``fp8_tis``; the token-TIS statistics are logged for every
   arm (``is_applied`` says whether they entered the loss);
6. ``grpo.updates_per_step`` optimizer steps on the PPO clipped loss
   (:func:`~megatron_fp8.rl.correction.ppo_loss`, old policy = ``logp_train_old``);
7. refit: the trainer's HF-named weights (Megatron-Bridge export) go to the engine, for the
   FP8 arms quantized to FP8 + 128x128 block scales exactly for the weights in vLLM's FP8
   manifest (asked of vLLM once per run, before the arms), through the bucketed refit
   pipeline with a verified two-phase commit. The payload bytes (fp8 / scales / bf16) and
   the time are logged.

Every step appends one JSON line per arm to ``metrics.jsonl``; at the end
``summary.md`` and ``metrics.png`` are written (:mod:`megatron_fp8.rl.report`).

On CPU machines all arms default to the reference engine (an emulator of vLLM's FP8
numerics, BF16 for the ``bf16`` arm) and the FP8 *training* recipe is validated and
recorded while the training math runs in BF16 (see :mod:`megatron_fp8.megatron.build`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_fp8.config.schema import RunConfig
from megatron_fp8.errors import ConfigError, ManifestError
from megatron_fp8.rl.correction import ISConfig, ISResult, compute_is_weights, ppo_loss
from megatron_fp8.rl.metrics import METRIC_KEYS, mismatch_metrics
from megatron_fp8.rl.task import Problem, ToyTask, get_task, sample_problems
from megatron_fp8.rollout.engines import Rollout, RolloutEngine, build_rollout_engine, resolve_engine_name
from megatron_fp8.vocab import ARMS, ArmSpec

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.md"
PLOT_FILE = "metrics.png"
CONFIG_FILE = "config.yaml"

ADVANTAGE_EPS = 1e-6
"""Added to the group's reward standard deviation before dividing."""


@dataclass(frozen=True)
class StepMetrics:
    """What one GRPO step of one arm measured.

    Attributes:
        arm: arm name.
        step: 0-based step index.
        engine: rollout engine name (``reference-fp8``, ``vllm-bf16``, ...).
        reward_mean: mean reward over the step's responses, in [0, 1].
        reward_std: population standard deviation of the rewards.
        reward_max: best reward of the step.
        exact_match: fraction of responses that are exactly right (and stopped at EOS).
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
        mismatch: :func:`~megatron_fp8.rl.metrics.mismatch_metrics` of ``logp_train_old`` vs
            ``logp_rollout`` (keys of :data:`~megatron_fp8.rl.metrics.METRIC_KEYS`).
        refit_bytes: refit payload bytes by class (``fp8``, ``scales``, ``bf16``, ``other``).
        refit_seconds: wall time of the refit after the update (export, quantization, transfer,
            verified commit), seconds.
        refit_version: engine weight version after the refit.
        refit_max_rel_error: worst relative weight error the post-refit verification found
            (FP8 rounding for quantized weights; ``nan`` when verification is off).
        rollout_seconds: generation time, seconds.
        train_seconds: trainer scoring + optimizer updates, seconds.
        step_seconds: whole step, seconds.
        sample: one prompt and response of the step, for reading.
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

    @property
    def gen_kl(self) -> float:
        """KL(pi_rollout || pi_train) per token, k3 estimator (>= 0): the mismatch headline number."""
        return float(self.mismatch["gen_kl_k3"])

    def to_json_dict(self) -> dict[str, Any]:
        """One flat JSON-able record: mismatch keys at the top level, ``gen_kl`` = ``gen_kl_k3``,
        ``refit_{fp8,scales,bf16,other,total}_bytes``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("mismatch", "refit_bytes"):
                continue
            out[f.name] = getattr(self, f.name)
        out["gen_kl"] = self.gen_kl
        out.update({k: float(v) for k, v in self.mismatch.items()})
        for cls in ("fp8", "scales", "bf16", "other"):
            out[f"refit_{cls}_bytes"] = int(self.refit_bytes.get(cls, 0))
        out["refit_total_bytes"] = int(sum(self.refit_bytes.values()))
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


@dataclass(frozen=True)
class ArmResult:
    """All steps of one arm.

    Attributes:
        arm: arm name.
        engine: rollout engine name.
        training_recipe: the training recipe recorded for the arm (``bf16``, ``blockwise``, ...).
        training_math: how the training GEMMs ran (``bf16``, ``bf16-emulated`` on CPU, ``fp8``).
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
        return _mean(self._series(lambda s: s.gen_kl))

    @property
    def mean_token_mult_prob_error(self) -> float:
        """Mean over steps of ``token_mult_prob_error``."""
        return _mean(self._series(lambda s: s.mismatch["token_mult_prob_error"]))

    @property
    def mean_refit_bytes(self) -> dict[str, float]:
        """Mean refit payload bytes per class, plus ``total``."""
        out = {c: _mean(self._series(lambda s, c=c: float(s.refit_bytes.get(c, 0)))) for c in ("fp8", "scales", "bf16")}
        out["total"] = _mean(self._series(lambda s: float(sum(s.refit_bytes.values()))))
        return out

    @property
    def mean_refit_seconds(self) -> float:
        """Mean refit wall time, seconds."""
        return _mean(self._series(lambda s: s.refit_seconds))


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


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


# ----------------------------------------------------------------------------- setup helpers


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``policy.megatron_cfg.env_vars`` for the duration of the run, then restore."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rollout_quantization_config(config: RunConfig, model_path: Path) -> dict:
    """vLLM's FP8 ``quantization_config`` for this run (explicit one, or blockwise 128x128 with the BF16 layers).

    Raises:
        ConfigError: a per-tensor (non-blockwise) FP8 rollout, which the blockwise refit cannot feed.
    """
    from bridge_mappings.manifest import build_quantization_config

    vllm_cfg = config.policy.generation.vllm_cfg
    if not config.rollout_blockwise:
        raise ConfigError(
            "policy.generation.vllm_cfg.quantization_config has no weight_block_size: the GRPO refit sends "
            "128x128 blockwise FP8; set weight_block_size: [128, 128] (or drop quantization_config)"
        )
    qc = vllm_cfg.quantization_config
    if qc is not None:
        return {
            "quant_method": qc.quant_method or "fp8",
            "fmt": qc.fmt or "e4m3",
            "activation_scheme": qc.activation_scheme or "dynamic",
            "weight_block_size": list(qc.weight_block_size or (128, 128)),
            "ignored_layers": list(qc.ignored_layers),
        }
    return build_quantization_config(
        model_path,
        num_first_layers_in_bf16=vllm_cfg.num_first_layers_in_bf16,
        num_last_layers_in_bf16=vllm_cfg.num_last_layers_in_bf16,
    )


_ASK_SCRIPT = (
    "import json, sys\n"
    "from bridge_mappings.manifest import ManifestStore\n"
    "ManifestStore().get_or_ask(sys.argv[1], json.loads(sys.argv[2]), num_first_layers_in_bf16=int(sys.argv[3]),\n"
    "    num_last_layers_in_bf16=int(sys.argv[4]), refresh=sys.argv[5] == '1')\n"
)


def fp8_manifest(config: RunConfig, model_path: Path, qcfg: dict) -> Any:
    """vLLM's FP8 manifest for the run, asked once (cached across runs by fingerprint).

    A stored manifest with a matching fingerprint is reused. Otherwise vLLM is asked in a
    child process (so its process-global state never meets the trainer's process group) and
    the stored answer is read back. Without vLLM installed, the manifest is derived the way
    vLLM derives it (every linear weight outside ``ignored_layers``), with a warning.

    Returns:
        A :class:`bridge_mappings.manifest.Manifest`.

    Raises:
        ManifestError: vLLM failed to answer (its output is in the message).
    """
    from bridge_mappings.manifest import ManifestStore, make_fingerprint
    from megatron_fp8.rollout.vllm.adapter import vllm_version

    vllm_cfg = config.policy.generation.vllm_cfg
    first, last = vllm_cfg.num_first_layers_in_bf16, vllm_cfg.num_last_layers_in_bf16
    expected = make_fingerprint(model_path, qcfg, num_first_layers_in_bf16=first, num_last_layers_in_bf16=last)
    if vllm_version() is None:
        raise ManifestError(
            "vLLM is not installed, and the FP8 manifest must come from vLLM itself (never from name rules); "
            "install vllm (make install) or run the FP8 arms where vLLM is"
        )
    store = ManifestStore()
    refresh = False
    try:
        stored = store.load(model_path, expected)
    except ManifestError as exc:
        logger.warning("%s -- asking vLLM again", exc)
        stored, refresh = None, True
    if stored is not None:
        logger.info("FP8 manifest: reusing %s (%d FP8 weights)", store.path_for(model_path), len(stored.fp8_params))
        return stored
    logger.info("FP8 manifest: asking vLLM %s once for %s (stored for later runs)", vllm_version(), model_path)
    cmd = [
        sys.executable,
        "-c",
        _ASK_SCRIPT,
        str(model_path),
        json.dumps(qcfg),
        str(first),
        str(last),
        "1" if refresh else "0",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise ManifestError(
            f"asking vLLM for the FP8 manifest of {model_path} failed (exit {proc.returncode}):\n"
            f"{proc.stderr[-3000:]}\nRun `megatron-fp8 manifest --model {model_path}` to see the full error."
        )
    stored = store.load(model_path, expected)
    if stored is None:
        raise ManifestError(f"vLLM answered but no manifest was stored at {store.path_for(model_path)}")
    return stored


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Text of response tokens, one token at a time (ids beyond the tokenizer become U+FFFD)."""
    size = len(tokenizer)
    return "".join(tokenizer.decode([i], skip_special_tokens=True) if i < size else "\ufffd" for i in ids)


def _lr_at(step: int, config: RunConfig) -> float:
    g = config.grpo
    if g.warmup_steps <= 0 or step >= g.warmup_steps:
        return g.learning_rate
    return g.learning_rate * (0.1 + 0.9 * step / g.warmup_steps)


# ----------------------------------------------------------------------------- one step


@dataclass(frozen=True)
class _Batch:
    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64
    response_mask: torch.Tensor  # [B, T-1] bool: position t scores token t+1
    logp_rollout: torch.Tensor  # [B, T-1] float32, 0 off the response


def _make_batch(prompts: Sequence[Sequence[int]], rollout: Rollout, pad_id: int) -> _Batch:
    seqs = [list(p) + list(r) for p, r in zip(prompts, rollout.token_ids, strict=True)]
    b, t = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((b, t), pad_id, dtype=torch.int64)
    attention = torch.zeros((b, t), dtype=torch.int64)
    mask = torch.zeros((b, t - 1), dtype=torch.bool)
    logp = torch.zeros((b, t - 1), dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, rollout.token_ids, rollout.logprobs, strict=True)):
        n = len(p) + len(r)
        input_ids[i, :n] = torch.tensor(seqs[i], dtype=torch.int64)
        attention[i, :n] = 1
        start = len(p) - 1
        mask[i, start : start + len(r)] = True
        logp[i, start : start + len(r)] = lp
    return _Batch(input_ids=input_ids, attention_mask=attention, response_mask=mask, logp_rollout=logp)


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO advantages ``(r - mean) / (std + 1e-6)`` within each group.

    Args:
        rewards: float ``[num_prompts, num_generations]``.

    Returns:
        float32 ``[num_prompts * num_generations]`` (row-major: prompt-major), 0 for groups whose
        rewards are all equal.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ConfigError(f"group_advantages needs [prompts, generations >= 2] rewards, got {tuple(rewards.shape)}")
    r = rewards.to(torch.float32)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + ADVANTAGE_EPS)
    return adv.reshape(-1)


def _is_config(config: RunConfig) -> ISConfig:
    loss = config.loss_fn
    lo = loss.is_lower if loss.is_lower is not None else ISConfig.lo
    hi = loss.is_upper if loss.is_upper is not None else ISConfig.hi
    return ISConfig(variant=loss.is_variant, cap=loss.is_cap, lo=lo, hi=hi, log_ratio_clamp=loss.log_ratio_clamp)


@dataclass
class _ArmState:
    spec: ArmSpec
    model: Any
    optimizer: Any
    engine: RolloutEngine
    refit: Any
    manifest: Any
    export_settings: Any
    dp: DataParallel
    kv_recorder: Any = None
    kv_settings: Any = None


def _refit(state: _ArmState) -> tuple[dict[str, int], float, int, float]:
    from bridge_mappings.quantized_export import refit_stream
    from megatron_fp8.megatron import export_hf_weights

    if state.spec.rollout_precision == "fp8":
        # the bridge adapter uses Megatron-Bridge's quantized-export hook where the installed version has one
        stream = refit_stream(state.model, state.manifest, state.export_settings)
        if state.kv_recorder is not None and state.kv_recorder.layers():
            from megatron_fp8.rl.kv_calibration import compute_kv_scales

            kv = compute_kv_scales(
                state.kv_recorder, percentile=state.kv_settings.percentile, margin=state.kv_settings.margin
            )
            state.kv_recorder.reset()
            stream = itertools.chain(stream, kv.items())
    else:
        stream = export_hf_weights(state.model)
    result = state.refit.refit(stream)
    verify = getattr(state.engine.applier, "last_verify", None)
    err = float(verify.max_rel_weight_error) if verify is not None else float("nan")
    return dict(result.send.payload_bytes), float(result.seconds), int(result.version), err


def _step(
    state: _ArmState,
    *,
    step: int,
    config: RunConfig,
    task: ToyTask,
    tokenizer: Any,
    eos_id: int,
    pad_id: int,
) -> StepMetrics:
    from megatron_fp8.megatron import token_logprobs, train_step

    g = config.grpo
    t_step = time.perf_counter()
    problems: list[Problem] = state.dp.shard(
        sample_problems(task, seed=g.seed, step=step, count=g.num_prompts_per_step)
    )
    prompt_ids = [tokenizer.encode(p.prompt, add_special_tokens=False) for p in problems]
    flat_prompts = [ids for ids in prompt_ids for _ in range(g.num_generations_per_prompt)]
    flat_problems = [p for p in problems for _ in range(g.num_generations_per_prompt)]

    t0 = time.perf_counter()
    rollout = state.engine.generate(
        flat_prompts,
        max_new_tokens=g.max_new_tokens,
        temperature=g.temperature,
        seed=g.seed * 1_000_003 + step * 10_007,
        eos_token_id=eos_id,
    )
    rollout_s = time.perf_counter() - t0

    texts, scores = [], []
    for problem, ids, finished in zip(flat_problems, rollout.token_ids, rollout.finished, strict=True):
        body = ids[:-1] if finished and ids and ids[-1] == eos_id else ids
        text = _decode(tokenizer, body)
        texts.append(text)
        scores.append(task.reward(problem, text, finished=finished))
    rewards = torch.tensor([s.reward for s in scores], dtype=torch.float32)
    advantages = group_advantages(rewards.view(len(problems), g.num_generations_per_prompt))

    t1 = time.perf_counter()
    batch = _make_batch(flat_prompts, rollout, pad_id)
    with torch.no_grad():
        logp_old = token_logprobs(
            state.model, batch.input_ids, temperature=g.temperature, attention_mask=batch.attention_mask
        )
    is_cfg = _is_config(config)
    diag_cfg = is_cfg if is_cfg.variant != "none" else ISConfig(log_ratio_clamp=is_cfg.log_ratio_clamp)
    is_result: ISResult = compute_is_weights(logp_old, batch.logp_rollout, batch.response_mask, config=diag_cfg)
    mismatch = mismatch_metrics(
        logp_old, batch.logp_rollout, batch.response_mask, is_result=is_result, log_ratio_clamp=is_cfg.log_ratio_clamp
    )
    weights = is_result if state.spec.correct else None

    lr = _lr_at(step, config)
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    captured: dict[str, Any] = {}

    def loss_fn(logp_new: torch.Tensor) -> torch.Tensor:
        loss, stats = ppo_loss(
            logp_new,
            logp_old,
            advantages,
            batch.response_mask,
            clip_low=config.loss_fn.ratio_clip_min,
            clip_high=config.loss_fn.ratio_clip_max,
            is_weights=weights,
            log_ratio_clamp=config.loss_fn.log_ratio_clamp,
        )
        captured["stats"] = stats
        return loss

    losses, norms, ok = [], [], True
    for _ in range(g.updates_per_step):
        result = train_step(
            state.model,
            state.optimizer,
            loss_fn,
            {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask},
            temperature=g.temperature,
        )
        losses.append(result.loss)
        norms.append(result.grad_norm)
        ok = ok and result.update_successful
    train_s = time.perf_counter() - t1
    ppo = captured["stats"].as_floats()

    refit_bytes, refit_s, version, refit_err = _refit(state)
    best = int(torch.argmax(rewards))
    return StepMetrics(
        arm=state.spec.name,
        step=step,
        engine=rollout.engine,
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std(unbiased=False)),
        reward_max=float(rewards.max()),
        exact_match=sum(s.exact for s in scores) / len(scores),
        response_tokens_mean=sum(len(t) for t in rollout.token_ids) / len(rollout.token_ids),
        loss=_mean(losses),
        grad_norm=_mean(norms),
        update_successful=ok,
        learning_rate=lr,
        ppo_clip_fraction=ppo["clip_fraction"],
        ppo_approx_kl=ppo["approx_kl"],
        is_applied=state.spec.correct,
        is_variant=diag_cfg.variant,
        is_weight_mean=mismatch["is_weight_mean"],
        is_truncated_fraction=mismatch["is_truncated_fraction"],
        is_masked_fraction=mismatch["is_masked_fraction"],
        mismatch={k: mismatch[k] for k in METRIC_KEYS},
        refit_bytes=refit_bytes,
        refit_seconds=refit_s,
        refit_version=version,
        refit_max_rel_error=refit_err,
        rollout_seconds=rollout_s,
        train_seconds=train_s,
        step_seconds=time.perf_counter() - t_step,
        sample=f"{flat_problems[best].prompt}{texts[best]!r} (answer {flat_problems[best].answer})",
    )


# ----------------------------------------------------------------------------- data parallel


@dataclass(frozen=True)
class DataParallel:
    """This process's place in a multi-process GRPO run (``torch.distributed`` from the environment).

    Under Slurm (``slurm/grpo.sbatch``) every task runs ``megatron-fp8 grpo`` with ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. Each rank rolls out its share of
    the step's prompts on its own colocated engine (whole groups, so advantages stay
    group-local), Megatron-Core's DDP averages the gradients over ranks, every rank refits its
    own engine, and rank 0 averages the step metrics over ranks and writes the outputs.
    """

    rank: int = 0
    world_size: int = 1

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def shard(self, items: Sequence[Any]) -> list[Any]:
        return list(items[self.rank :: self.world_size])


@contextlib.contextmanager
def data_parallel_from_env(*, timeout_s: float = 1800.0) -> Iterator[DataParallel]:
    """Join the ``WORLD_SIZE`` processes of this run (gloo) for its whole length; one process: no group."""
    import datetime

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank = int(os.environ.get("RANK", "0") or 0)
    role = os.environ.get("MFP8_ROLE", "colocated") or "colocated"
    if role != "colocated":
        raise ConfigError(
            f"MFP8_ROLE={role!r} (slurm/grpo.sbatch with ROLLOUT_TASKS set): megatron-fp8 grpo runs colocated "
            "data-parallel ranks, each training and rolling out; separate trainer/rollout placement is not "
            "implemented yet. Unset ROLLOUT_TASKS."
        )
    if world <= 1:
        yield DataParallel()
        return
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch through slurm/grpo.sbatch "
            "(or torchrun), which set the rendezvous"
        )
    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    logger.info("GRPO data parallel: rank %d of %d", rank, world)
    try:
        yield DataParallel(rank=rank, world_size=world)
    finally:
        dist.destroy_process_group()


_SUM_FIELDS = ("refit_bytes",)  # per-rank payloads add up; everything else numeric is averaged


def _average_over_ranks(m: StepMetrics, dp: DataParallel) -> StepMetrics:
    """Average a step's numeric metrics over ranks (refit bytes summed); rank 0 gets the result."""
    if dp.world_size == 1:
        return m
    import torch.distributed as dist

    gathered: list[Any] = [None] * dp.world_size
    dist.all_gather_object(gathered, dataclasses.asdict(m))

    def combine(key: str, values: list[Any]) -> Any:
        first = values[0]
        if isinstance(first, bool) or not isinstance(first, (int, float, dict)):
            return all(values) if isinstance(first, bool) else first
        if isinstance(first, dict):
            return {k: combine(f"{key}.{k}", [v[k] for v in values]) for k in first}
        total = sum(values)
        if key.split(".")[0] in _SUM_FIELDS:
            return total
        return type(first)(total / len(values)) if isinstance(first, float) else first

    merged = {k: combine(k, [g[k] for g in gathered]) for k in gathered[0]}
    return dataclasses.replace(m, **{k: v for k, v in merged.items() if k not in ("arm", "step", "engine", "sample")})


# ----------------------------------------------------------------------------- warm start

WARM_START_DIR = "warm_start"


def _save_hf_checkpoint(tensors: Mapping[str, torch.Tensor], source: Path, dest: Path) -> Path:
    """Write the trainer's weights as an HF folder: the source's config/tokenizer files + ``model.safetensors``."""
    import shutil

    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(f, dest / f.name)
    tmp = dest / "model.safetensors.tmp"
    save_file({n: t.detach().contiguous() for n, t in tensors.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(dest / "model.safetensors")
    return dest


def warm_start(
    config: RunConfig, model_path: Path, *, task: ToyTask, tokenizer: Any, out_dir: Path
) -> tuple[Path, list[float]]:
    """Supervised warm start on task answers, shared by every arm; saved as an HF checkpoint folder.

    ``grpo.warm_start_steps`` AdamW steps (lr ``grpo.warm_start_learning_rate``) of the mean
    negative log-likelihood of ``answer + EOS`` given the prompt, on fresh problems each step
    (seeded apart from the GRPO problems), ``num_prompts_per_step x num_generations_per_prompt``
    examples per step, BF16 recipe.

    Returns:
        ``(checkpoint folder, per-step loss)``; the folder is ``out_dir/warm_start``.
    """
    from megatron_fp8.megatron import (
        build_megatron_model,
        export_hf_weights,
        make_optimizer,
        megatron_parallel,
        train_step,
    )

    g = config.grpo
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    batch_size = g.num_prompts_per_step * g.num_generations_per_prompt
    losses: list[float] = []
    torch.manual_seed(g.seed)
    with megatron_parallel(seed=g.seed):
        model = build_megatron_model(model_path, recipe="bf16")
        optimizer = make_optimizer(model, lr=g.warm_start_learning_rate)
        for step in range(g.warm_start_steps):
            problems = sample_problems(task, seed=g.seed + 7919, step=step, count=batch_size)
            prompts = [tokenizer.encode(p.prompt, add_special_tokens=False) for p in problems]
            answers = [tuple(tokenizer.encode(p.answer, add_special_tokens=False)) + (eos,) for p in problems]
            fake = Rollout(
                token_ids=tuple(answers),
                logprobs=tuple(torch.zeros(len(a)) for a in answers),
                finished=tuple(True for _ in answers),
                engine="warm-start",
            )
            batch = _make_batch(prompts, fake, pad)
            mask = batch.response_mask.float()

            def nll(logp: torch.Tensor, mask: torch.Tensor = mask) -> torch.Tensor:
                return -(logp * mask).sum() / mask.sum()

            result = train_step(
                model, optimizer, nll, {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
            )
            losses.append(result.loss)
        path = out_dir / WARM_START_DIR
        tensors = dict(export_hf_weights(model))  # collective over model-parallel ranks: every rank exports
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            _save_hf_checkpoint(tensors, model_path, path)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    logger.info(
        "warm start: %d supervised steps, NLL %.3f -> %.3f per answer token; checkpoint %s",
        g.warm_start_steps,
        losses[0] if losses else float("nan"),
        losses[-1] if losses else float("nan"),
        path,
    )
    return path, losses


# ----------------------------------------------------------------------------- the run


def _progress(enabled: bool) -> Any:
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=Console(stderr=True),
    )


def _run_arm(
    spec: ArmSpec,
    *,
    config: RunConfig,
    steps: int,
    model_path: Path,
    manifest: Any,
    qcfg: dict | None,
    task: ToyTask,
    tokenizer: Any,
    on_step: Callable[[StepMetrics], StepMetrics],
    dp: DataParallel | None = None,
) -> ArmResult:
    from bridge_mappings.quantized_export import ExportSettings
    from megatron_fp8.megatron import build_megatron_model, make_optimizer, megatron_parallel
    from megatron_fp8.refit.pipeline import ColocatedRefit

    vllm_cfg = config.policy.generation.vllm_cfg
    fp8_cfg = config.policy.megatron_cfg.fp8_cfg
    t_arm = time.perf_counter()
    engine_name = resolve_engine_name(config.rollout.engine, precision=spec.rollout_precision)
    fp8 = spec.rollout_precision == "fp8"
    engine_kwargs: dict[str, Any] = {
        "quantization_config": qcfg if fp8 else None,
        "fp8_names": list(manifest.fp8_params) if fp8 else None,
        "kv_cache_dtype": vllm_cfg.kv_cache_dtype if fp8 else "auto",
        "verify": config.refit.verify,
    }
    if engine_name == "reference":
        engine_kwargs["activation_scale_format"] = "ue8m0" if vllm_cfg.pow2_activation_scaling_factors else "fp32"
    # The engine is built before the trainer's process group: an in-process vLLM sets up its own.
    engine = build_rollout_engine(engine_name, model_path, **engine_kwargs)
    recipe = config.training_recipe if spec.fp8_training_recipe else "bf16"
    try:
        torch.manual_seed(config.grpo.seed)
        with megatron_parallel(
            tensor_parallel_size=config.policy.megatron_cfg.tensor_model_parallel_size,
            pipeline_parallel_size=config.policy.megatron_cfg.pipeline_model_parallel_size,
            seed=config.grpo.seed,
        ):
            model = build_megatron_model(
                model_path,
                recipe=recipe,
                num_first_layers_in_bf16=fp8_cfg.num_first_layers_in_bf16 if spec.fp8_training_recipe else 0,
                num_last_layers_in_bf16=fp8_cfg.num_last_layers_in_bf16 if spec.fp8_training_recipe else 0,
            )
            optimizer = make_optimizer(
                model, lr=config.grpo.learning_rate, clip_grad=config.policy.megatron_cfg.optimizer.clip_grad
            )
            state = _ArmState(
                spec=spec,
                model=model,
                optimizer=optimizer,
                engine=engine,
                refit=ColocatedRefit(
                    engine.applier, bucket_bytes=config.refit.bucket_size_mb << 20, timeout=config.refit.timeout_s
                ),
                manifest=manifest,
                export_settings=ExportSettings(
                    scale_format="ue8m0" if vllm_cfg.pow2_weight_scaling_factors else "fp32",
                    tp_size=vllm_cfg.tensor_parallel_size,
                ),
                dp=dp or DataParallel(),
            )
            kv_hooks = None
            if fp8 and vllm_cfg.kv_cache_dtype == "fp8":
                # FP8 KV cache: q/k/v amax of every training forward -> per-layer scales sent with each refit
                from megatron_fp8.rl.kv_calibration import KVAmaxRecorder, attach_kv_amax_hooks

                state.kv_recorder, state.kv_settings = KVAmaxRecorder(), config.kv_cache
                kv_hooks = attach_kv_amax_hooks(model.model[0], state.kv_recorder, kind="megatron")
            eos_id = tokenizer.eos_token_id
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
            if eos_id is None:
                raise ConfigError(
                    f"the tokenizer of {model_path} has no eos_token_id; GRPO needs one to stop responses"
                )
            results = []
            try:
                for step in range(steps):
                    metrics = _step(
                        state, step=step, config=config, task=task, tokenizer=tokenizer, eos_id=eos_id, pad_id=pad_id
                    )
                    results.append(on_step(metrics))
            finally:
                state.refit.close()
                if kv_hooks is not None:
                    kv_hooks.remove()
            application = model.recipe_application
    finally:
        engine.close()
    return ArmResult(
        arm=spec.name,
        engine=engine.name,
        training_recipe=str(application.recipe),
        training_math=str(application.math),
        steps=tuple(results),
        seconds=time.perf_counter() - t_arm,
    )


def run_grpo(
    config: RunConfig,
    *,
    out_dir: str | Path,
    steps: int | None = None,
    arms: Sequence[str] | None = None,
    progress: bool = True,
) -> GRPOResult:
    """Run GRPO for each arm and write ``metrics.jsonl``, ``summary.md``, ``metrics.png`` and ``config.yaml``.

    Args:
        config: the run configuration (:func:`megatron_fp8.config.load_config`).
        out_dir: output folder (created; an existing ``metrics.jsonl`` there is replaced).
        steps: steps per arm; ``None`` = ``config.grpo.num_steps``.
        arms: arm names (keys of :data:`megatron_fp8.vocab.ARMS`); ``None`` = ``config.grpo.arms``.
        progress: show a progress bar on stderr.

    Returns:
        The :class:`GRPOResult`.

    Raises:
        ConfigError: unknown arm or task, bad step count, a non-blockwise FP8 rollout.
        ManifestError: vLLM could not be asked for the FP8 manifest.
    """

    t_run = time.perf_counter()
    n_steps = config.grpo.num_steps if steps is None else int(steps)
    if n_steps < 1:
        raise ConfigError(f"steps must be >= 1, got {n_steps}")
    arm_names = tuple(config.grpo.arms if arms is None else arms)
    unknown = [a for a in arm_names if a not in ARMS]
    if unknown or not arm_names:
        raise ConfigError(f"unknown or no arm(s) {unknown or list(arm_names)}; valid arms: {', '.join(ARMS)}")
    if len(set(arm_names)) != len(arm_names):
        raise ConfigError(f"an arm is listed twice: {list(arm_names)}")
    if "fp8_tis" in arm_names and config.loss_fn.is_variant == "none":
        raise ConfigError("arm fp8_tis corrects with loss_fn.is_variant, which is 'none'; set is_variant: token_tis")
    task = get_task(config.grpo.task, max_digits=config.grpo.task_max_digits)
    with data_parallel_from_env() as dp:
        if config.grpo.num_prompts_per_step % dp.world_size:
            raise ConfigError(
                f"grpo.num_prompts_per_step={config.grpo.num_prompts_per_step} is not divisible by the "
                f"{dp.world_size} GRPO processes (WORLD_SIZE); each rank rolls out whole prompt groups"
            )
        return _run_grpo_ranks(
            config,
            dp=dp,
            task=task,
            n_steps=n_steps,
            arm_names=arm_names,
            out_dir=out_dir,
            progress=progress,
            t_run=t_run,
        )


def _run_grpo_ranks(
    config: RunConfig,
    *,
    dp: DataParallel,
    task: ToyTask,
    n_steps: int,
    arm_names: tuple[str, ...],
    out_dir: str | Path,
    progress: bool,
    t_run: float,
) -> GRPOResult:
    from transformers import AutoTokenizer

    from megatron_fp8.models import resolve_model
    from megatron_fp8.rl import report

    out = Path(out_dir)
    metrics_path = out / METRICS_FILE
    if dp.is_writer:
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_FILE).write_text(config.dump_yaml())
    model_path = Path(resolve_model(config.model.name_or_path))
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))

    manifest, qcfg, manifest_source = None, None, ""
    if any(ARMS[a].rollout_precision == "fp8" for a in arm_names):
        qcfg = rollout_quantization_config(config, model_path)
        box: list[Any] = [fp8_manifest(config, model_path, qcfg) if dp.is_writer else None]
        if dp.world_size > 1:  # asked of vLLM once, on rank 0, and shared
            torch.distributed.broadcast_object_list(box, src=0)
        manifest = box[0]
        manifest_source = manifest.source
        logger.info("FP8 manifest: %d weights in FP8 (%s)", len(manifest.fp8_params), manifest.source)
    if config.grpo.warm_start_steps > 0:
        # Same architecture and names as the base checkpoint: the manifest above applies unchanged.
        model_path, _ = warm_start(config, model_path, task=task, tokenizer=tokenizer, out_dir=out)

    results: list[ArmResult] = []
    sink_cm = metrics_path.open("w") if dp.is_writer else contextlib.nullcontext(None)
    with (
        _environment(config.policy.megatron_cfg.env_vars),
        sink_cm as sink,
        _progress(progress and dp.is_writer) as bar,
    ):
        bar_task = bar.add_task("GRPO", total=n_steps * len(arm_names), info="") if bar is not None else None

        def on_step(local: StepMetrics) -> StepMetrics:
            m = _average_over_ranks(local, dp)
            if sink is not None:
                sink.write(json.dumps(m.to_json_dict(), sort_keys=False) + "\n")
                sink.flush()
            logger.debug("arm %s step %d: reward %.3f gen_kl %.2e", m.arm, m.step, m.reward_mean, m.gen_kl)
            if bar is not None:
                bar.update(
                    bar_task,
                    advance=1,
                    description=f"GRPO {m.arm}",
                    info=f"step {m.step + 1}/{n_steps} reward {m.reward_mean:.3f} gen_kl {m.gen_kl:.1e}",
                )
            return m

        for name in arm_names:
            logger.info("GRPO arm %s: %s", name, ARMS[name].description)
            results.append(
                _run_arm(
                    ARMS[name],
                    config=config,
                    steps=n_steps,
                    model_path=model_path,
                    manifest=manifest,
                    qcfg=qcfg,
                    task=task,
                    tokenizer=tokenizer,
                    on_step=on_step,
                    dp=dp,
                )
            )

    if not dp.is_writer:
        return GRPOResult(
            arms=tuple(results),
            out_dir=out,
            metrics_path=metrics_path,
            summary_path=None,
            plot_path=None,
            manifest_source=manifest_source,
            seconds=time.perf_counter() - t_run,
        )
    summary_path = report.write_summary(results, out / SUMMARY_FILE, config=config, manifest_source=manifest_source)
    plot_path = report.plot_metrics(results, out / PLOT_FILE)
    return GRPOResult(
        arms=tuple(results),
        out_dir=out,
        metrics_path=metrics_path,
        summary_path=summary_path,
        plot_path=plot_path,
        manifest_source=manifest_source,
        seconds=time.perf_counter() - t_run,
    )
