"""The GPU memory plan of a run, phase by phase: what a colocated GPU holds while it generates, trains and refits.

A colocated step (:mod:`megatron_fp8.rollout.sleep`, :mod:`megatron_fp8.megatron.offload`)::

    generate -> sleep -> score / train -> wake_up(weights) -> refit -> wake_up(kv_cache) -> KV scales -> generate

puts these on one GPU (per-GPU bytes; ``W`` = the trainer's BF16 weights ``2 B x params / (TP x PP)`` with routed
experts / EP, ``G`` = its FP32 gradient buffer ``4 B x ...``, ``O`` = FP32 main weights + Adam moments ``12 B x ...``,
sharded over DP with the distributed optimizer, :mod:`megatron_fp8.config.memory`):

* **generation**: the engine's budget (``gpu_memory_utilization x`` the GPU: weights + KV cache) + ``W``, + ``G + O``
  unless the trainer offloads them during generation (it does when the engine sleeps; ``O`` is never on the GPU with
  ``optimizer_cpu_offload``);
* **training**: ``W + G + O`` (``O`` not with ``optimizer_cpu_offload``) + what the sleeping engine keeps
  (:data:`SLEEPING_ENGINE_BYTES`, assumed: its CUDA context and graphs; at sleep level 0 its whole budget);
* **refit**: ``W`` + the woken engine weights (its FP8 / BF16 weights / rollout TP) + the refit's staged version
  (the stream stays on the GPU and its buckets are the version the engine loads and verifies there, kept until the
  commit: this rank's part of it, the engine's weights / rollout TP (:class:`~megatron_fp8.layout.ShardPlan`), at
  least :data:`REFIT_BUCKETS_IN_FLIGHT` x ``refit.bucket_size_mb``; at sleep level 1 or 2 in the memory the sleeping
  KV cache gave back) + the engine's rollback snapshot (a copy of its weights, the image's vLLM 0.11 loading in place)
  + what the sleeping engine keeps, + ``G + O`` unless offloaded (they go before the refit).

Activations are not included (they depend on the micro-batch and sequence length). Host memory: the offloaded ``O``
(pinned) and at sleep level 1 the engine's weights; no refit version (a vLLM >= 0.15 engine's layerwise reload would
add its rollback source, the last committed version's part, pinned: not the image's). A separate rollout rank (``colocated.enabled: false``) holds the
engine budget alone; a trainer rank then has training and refit phases only.

``config``, ``doctor --config`` and ``grpo`` print the plan; ``config`` and ``grpo`` refuse a plan whose peak exceeds
the GPU, naming the changes that would fit (sleep level, offload, distributed optimizer, TP), unless
``--allow-over-memory`` (``grpo.allow_over_memory``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_fp8.config.memory import (
    SHARDED_BYTES_PER_PARAM,
    engine_weight_bytes,
    estimate_memory,
    gpu_memory,
    layout_report,
)
from megatron_fp8.config.schema import RunConfig
from megatron_fp8.models.dims import ModelDims, known_dims
from megatron_fp8.vocab import MEMORY_PHASES, SLEEP_LEVELS

COLOCATED_QUEUED_BUCKETS = 1
"""Refit buckets a GRPO run's colocated refit lets wait between its sender and its receiver (the in-process queue)."""

REFIT_BUCKETS_IN_FLIGHT = COLOCATED_QUEUED_BUCKETS + 3
"""Refit buckets a colocated GPU holds at once when the refit stream stays on the GPU (a vLLM engine): the one being
filled, the one whose device work awaits its host read (the sender's lookahead), the queued ones, and the one the
receiver is copying to the host (the receiver stages the version in host memory for vLLM's applier)."""

SLEEPING_ENGINE_BYTES = 2 * 10**9
"""What a sleeping vLLM engine is assumed to keep on its GPU (CUDA context, CUDA graphs, NCCL buffers), bytes."""

GB = 1e9


def sleep_level(cfg: RunConfig) -> int:
    """The colocated engine's sleep level: 0 when not colocated; ``colocated.sleep_level``, else 2 (every refit
    rewrites every weight: :func:`megatron_fp8.rollout.sleep.sleep_level_for`)."""
    colocated = cfg.policy.generation.colocated
    if not colocated.enabled:
        return 0
    return 2 if colocated.sleep_level is None else colocated.sleep_level


def trainer_offloads(cfg: RunConfig) -> bool:
    """Whether the trainer's optimizer state and gradients leave the GPU while the engine generates (colocated, the
    engine sleeping while the trainer trains)."""
    return sleep_level(cfg) > 0


def memory_rules(cfg: RunConfig) -> list[str]:
    """The memory keys' values (rules of :mod:`megatron_fp8.config.validate`)."""
    mcfg, colocated = cfg.policy.megatron_cfg, cfg.policy.generation.colocated
    out = []
    if mcfg.empty_unused_memory_level not in (0, 1, 2):
        out.append(
            f"policy.megatron_cfg.empty_unused_memory_level must be 0, 1 or 2 (Megatron's levels), got "
            f"{mcfg.empty_unused_memory_level!r}"
        )
    if colocated.sleep_level is not None and colocated.sleep_level not in SLEEP_LEVELS:
        out.append(
            f"policy.generation.colocated.sleep_level must be one of {tuple(SLEEP_LEVELS)} or null (derived), got "
            f"{colocated.sleep_level!r}"
        )
    if colocated.sleep_level and not colocated.enabled:
        out.append(
            "policy.generation.colocated.sleep_level is for an engine colocated with the trainer; with "
            "colocated.enabled false the rollout ranks keep their engines awake: drop sleep_level"
        )
    fraction = mcfg.optimizer.optimizer_offload_fraction
    if not 0.0 <= fraction <= 1.0:
        out.append(f"policy.megatron_cfg.optimizer.optimizer_offload_fraction must be in [0, 1], got {fraction!r}")
    elif mcfg.optimizer.optimizer_cpu_offload and fraction == 0:
        out.append(
            "policy.megatron_cfg.optimizer.optimizer_cpu_offload with optimizer_offload_fraction 0 keeps the whole "
            "optimizer state on the GPU: set optimizer_offload_fraction (1.0: all of it in host memory)"
        )
    elif fraction and not mcfg.optimizer.optimizer_cpu_offload:
        out.append(
            f"policy.megatron_cfg.optimizer.optimizer_offload_fraction {fraction} acts only with optimizer_cpu_offload "
            "true: set it, or the fraction to 0"
        )
    if mcfg.optimizer.optimizer_cpu_offload and not mcfg.optimizer.use_distributed_optimizer:
        out.append(
            "policy.megatron_cfg.optimizer.optimizer_cpu_offload runs Megatron-Core's HybridDeviceOptimizer, which "
            "lives in its distributed optimizer: set policy.megatron_cfg.optimizer.use_distributed_optimizer true"
        )
    if cfg.policy.offload_optimizer_for_logprob and not trainer_offloads(cfg):
        out.append(
            "policy.offload_optimizer_for_logprob keeps the optimizer state in host memory while a colocated engine "
            "sleeps; with colocated.enabled false or sleep_level 0 nothing is offloaded: drop it"
        )
    return out


@dataclass(frozen=True)
class PhasePeak:
    """What one GPU holds during one phase.

    Attributes:
        phase: a key of :data:`megatron_fp8.vocab.MEMORY_PHASES`.
        parts: ``(what, bytes)`` in the order printed.
    """

    phase: str
    parts: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        """The phase's bytes."""
        return sum(b for _, b in self.parts)

    def describe(self) -> str:
        """``phase: a X GB + b Y GB = Z GB``."""
        terms = " + ".join(f"{what} {b / GB:.1f} GB" for what, b in self.parts if b)
        return f"{self.phase}: {terms or 'nothing'} = {self.total / GB:.1f} GB"


@dataclass(frozen=True)
class MemoryPlan:
    """The per-phase GPU memory of a run (module docstring).

    Attributes:
        phases: the phases, in step order.
        gpu_bytes, gpu_name: the GPU (or the assumption).
        sleep_level: the engine's sleep level (0: awake throughout, or not colocated).
        offload: whether the trainer offloads its optimizer state and gradients during generation.
        host_bytes: host memory per rank the plan adds (offloaded optimizer state; level-1 engine weights).
    """

    phases: tuple[PhasePeak, ...]
    gpu_bytes: int
    gpu_name: str
    sleep_level: int
    offload: bool
    host_bytes: int

    @property
    def peak(self) -> PhasePeak:
        """The phase that holds the most."""
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        """Whether every phase fits the GPU (activations excluded)."""
        return self.peak.total <= self.gpu_bytes

    def lines(self) -> list[str]:
        """The lines ``config`` prints: one per phase, then the verdict."""
        how = f"engine sleep level {self.sleep_level}" + (", trainer offload during generation" if self.offload else "")
        out = [f"memory plan per GPU by phase ({how}; activations not included):"]
        out += [f"  {p.describe()}" for p in self.phases]
        verdict = "fits" if self.fits else "EXCEEDS it"
        out.append(
            f"  peak: {self.peak.phase} {self.peak.total / GB:.1f} GB of {self.gpu_bytes / GB:.0f} GB "
            f"({self.gpu_name}): {verdict}; host memory per rank +{self.host_bytes / GB:.1f} GB"
        )
        return out


def _trainer_parts(cfg: RunConfig, dims: ModelDims, *, processes: int | None) -> tuple[int, int, int]:
    """``(W, G, O)`` bytes per GPU (module docstring), from :func:`estimate_memory`'s layout."""
    est = estimate_memory(cfg, dims, gpu=(1, ""), processes=processes)
    experts = dims.num_expert_parameters if est.expert_parallel > 1 else 0
    dense = dims.num_parameters - experts
    held = dense + experts // est.expert_parallel
    expert_dp = max(est.data_parallel // est.expert_parallel, 1)
    sharded = dense // est.data_parallel + experts // est.expert_parallel // expert_dp
    mp = est.model_parallel
    return 2 * held // mp, 4 * held // mp, SHARDED_BYTES_PER_PARAM * sharded // mp


def plan_memory(
    cfg: RunConfig, dims: ModelDims, *, gpu: tuple[int, str] | None = None, processes: int | None = None
) -> MemoryPlan:
    """The per-phase plan of ``cfg`` on ``dims`` (module docstring).

    Args:
        cfg: the run config.
        dims: the model's dimensions.
        gpu: ``(bytes, name)``; ``None``: this machine's first GPU, else an H100 80 GB assumed.
        processes: trainer processes; ``None``: ``$WORLD_SIZE``, else one node of 8.
    """
    gpu_bytes, gpu_name = gpu if gpu is not None else gpu_memory()
    weights, grads, optim = _trainer_parts(cfg, dims, processes=processes)
    opt = cfg.policy.megatron_cfg.optimizer
    optim_host = int(optim * opt.optimizer_offload_fraction) if opt.optimizer_cpu_offload else 0
    optim_gpu = optim - optim_host
    vllm = cfg.policy.generation.vllm_cfg
    budget = int(vllm.gpu_memory_utilization * gpu_bytes)
    engine_weights = engine_weight_bytes(cfg, dims) // vllm.tensor_parallel_size
    bucket = cfg.refit.bucket_size_mb << 20
    # every rank receives its engine shard's part of the version (rollout TP > 1: the shard plan; TP 1: all of it),
    # staged on the engine's GPU until the commit; the image's vLLM 0.11 loads it in place, its rollback source a
    # copy of the engine's weights on the GPU for the refit's duration (rollout/vllm/rollback.py EngineSnapshot)
    staged = engine_weights
    snapshot = ("rollback snapshot (engine weights)", engine_weights)
    in_flight = max(REFIT_BUCKETS_IN_FLIGHT * bucket, staged)
    level, offload = sleep_level(cfg), trainer_offloads(cfg)
    trainer = (("trainer weights", weights), ("gradients", grads), ("optimizer state", optim_gpu))
    if not cfg.policy.generation.colocated.enabled:
        phases = (
            PhasePeak("training", trainer),
            PhasePeak("refit", (("trainer weights", weights), ("gradients", grads), ("optimizer state", optim_gpu),
                                ("refit bucket", bucket))),
        )  # fmt: skip
        return MemoryPlan(
            phases=phases, gpu_bytes=gpu_bytes, gpu_name=gpu_name, sleep_level=0, offload=False, host_bytes=optim_host
        )
    asleep = (("sleeping engine (assumed)", SLEEPING_ENGINE_BYTES),) if level else (("engine awake", budget),)
    kept = (("trainer weights", weights),) if offload else trainer
    phases = (
        PhasePeak("generation", (("engine", budget), *kept)),
        PhasePeak("training", (*trainer, *asleep)),
        PhasePeak(
            "refit",
            (*kept, ("woken engine weights", engine_weights), ("refit's staged version", in_flight), snapshot, *asleep)
            if level
            else (*trainer, ("engine awake", budget), ("refit's staged version", in_flight), snapshot),
        ),
    )
    host = (optim if offload else optim_host) + (engine_weights if level == 1 else 0)
    assert tuple(p.phase for p in phases) == tuple(MEMORY_PHASES)
    return MemoryPlan(
        phases=phases, gpu_bytes=gpu_bytes, gpu_name=gpu_name, sleep_level=level, offload=offload, host_bytes=host
    )


def _replaced(obj: object, path: str, **changes: object) -> object:
    head, _, rest = path.partition(".")
    inner = getattr(obj, head)
    return dataclasses.replace(
        obj, **{head: _replaced(inner, rest, **changes) if rest else dataclasses.replace(inner, **changes)}
    )


def what_would_fit(
    cfg: RunConfig, dims: ModelDims, *, gpu: tuple[int, str] | None = None, processes: int | None = None
) -> list[str]:
    """The single changes (sleep level, offload, distributed optimizer, TP, the engine's share) whose plan fits,
    each as ``key=value (peak X GB)``."""
    mcfg, colocated = cfg.policy.megatron_cfg, cfg.policy.generation.colocated
    candidates: list[tuple[str, RunConfig]] = []
    if colocated.enabled and sleep_level(cfg) != 2:
        candidates.append(
            ("policy.generation.colocated.sleep_level=2", _replaced(cfg, "policy.generation.colocated", sleep_level=2))
        )
    if not mcfg.optimizer.use_distributed_optimizer:
        candidates.append(
            (
                "policy.megatron_cfg.optimizer.use_distributed_optimizer=true",
                _replaced(cfg, "policy.megatron_cfg.optimizer", use_distributed_optimizer=True),
            )
        )
    elif not mcfg.optimizer.optimizer_cpu_offload:
        candidates.append(
            (
                "policy.megatron_cfg.optimizer.optimizer_cpu_offload=true optimizer_offload_fraction=1.0",
                _replaced(
                    cfg, "policy.megatron_cfg.optimizer", optimizer_cpu_offload=True, optimizer_offload_fraction=1.0
                ),
            )
        )
    for tp in (2, 4, 8):
        if tp > mcfg.tensor_model_parallel_size:
            candidates.append(
                (
                    f"policy.megatron_cfg.tensor_model_parallel_size={tp}",
                    _replaced(cfg, "policy.megatron_cfg", tensor_model_parallel_size=tp),
                )
            )
    util = cfg.policy.generation.vllm_cfg.gpu_memory_utilization
    for lower in (0.4, 0.3):
        if colocated.enabled and lower < util:
            candidates.append(
                (
                    f"policy.generation.vllm_cfg.gpu_memory_utilization={lower}",
                    _replaced(cfg, "policy.generation.vllm_cfg", gpu_memory_utilization=lower),
                )
            )
    out = []
    for label, changed in candidates:
        plan = plan_memory(changed, dims, gpu=gpu, processes=processes)
        if plan.fits:
            out.append(f"{label} (peak {plan.peak.phase} {plan.peak.total / GB:.1f} GB)")
    return out


def memory_report(cfg: RunConfig) -> tuple[list[str], str | None]:
    """What ``config`` and ``doctor --config`` print (layout, estimate, the plan per phase) and the problem that
    refuses the run (``None``: it fits, or the model is unknown).

    Returns:
        ``(lines, problem)``; ``problem`` names the phase over the GPU and the changes that would fit.
    """
    lines, problem = layout_report(cfg, total_decides=False)
    dims = known_dims(cfg.model.name_or_path)
    if dims is None or not dims.vocab_size:
        return lines, problem
    plan = plan_memory(cfg, dims)
    lines += plan.lines()
    if problem is not None or plan.fits:
        return lines, problem
    fixes = what_would_fit(cfg, dims)
    return lines, (
        f"the memory plan exceeds the GPU in its {plan.peak.phase} phase: {plan.peak.describe()} of "
        f"{plan.gpu_bytes / GB:.0f} GB ({plan.gpu_name}); "
        + (f"would fit: {'; '.join(fixes)}" if fixes else "no single change of sleep level, offload, distributed "
           "optimizer, TP or gpu_memory_utilization fits: combine them, or use more GPUs")
        + " (--allow-over-memory / grpo.allow_over_memory=true proceeds anyway)"
    )  # fmt: skip
