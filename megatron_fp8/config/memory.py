"""The trainer layout a config asks for, and a per-GPU memory estimate with its formula.

Printed by ``megatron-fp8 config`` before anything is loaded. The estimate counts what a layout must hold
for the whole run (parameters, gradients, optimizer state, and the colocated engine's share), not activations,
which depend on the micro-batch and sequence length:

``trainer bytes per GPU = params x 18 B / (TP x PP)``: BF16 weights (2 B), FP32 main weights (4 B), two FP32
Adam moments (8 B) and the FP32 gradient buffer (4 B, ``grad_reduce_in_fp32``), per parameter. With
``policy.megatron_cfg.optimizer.use_distributed_optimizer`` the FP32 main weights and moments (12 B) are sharded
over the DP replicas: ``params x (6 B + 12 B / DP) / (TP x PP)``, DP = processes / (TP x PP), the processes taken
from ``WORLD_SIZE`` or else one node of 8 GPUs. With expert parallelism a GPU holds 1/EP of the routed experts'
parameters (their optimizer state sharded over DP / EP). A colocated vLLM engine takes ``gpu_memory_utilization x`` the
GPU's memory besides. A KL penalty to the reference policy (``loss_fn.reference_policy_kl_penalty``) keeps
this rank's parameter shard twice more in host memory, not on the GPU (:func:`reference_host_bytes`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_fp8.config.schema import RunConfig
from megatron_fp8.launch_env import launch_place
from megatron_fp8.layout import engine_group_problem, engine_replica_span
from megatron_fp8.models.dims import ModelDims, known_dims

TRAINER_BYTES_PER_PARAM = 2 + 4 + 8 + 4
"""BF16 weights + FP32 main weights + two FP32 Adam moments + FP32 gradients (bytes per parameter)."""
SHARDED_BYTES_PER_PARAM = 4 + 8
"""What the distributed optimizer shards over the DP replicas: FP32 main weights + two FP32 moments (bytes)."""
ASSUMED_PROCESSES = 8
"""Processes assumed when ``WORLD_SIZE`` is not set: one node of 8 GPUs."""

ASSUMED_GPU_BYTES = 80 * 10**9
"""The GPU assumed when none is visible: an H100 80 GB (bytes)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """One GPU's share of a run's state, in bytes (decimal GB in :meth:`describe`).

    Attributes:
        params: model parameters (elements).
        model_parallel: TP x PP (ranks one replica's state is split over).
        data_parallel: DP replicas the distributed optimizer shards its state over (1: not sharded).
        expert_parallel: EP ranks the routed experts are split over (their parameters count 1/EP per GPU).
        processes: the processes DP was computed from, and where that number came from.
        trainer_bytes: parameters, gradients and optimizer state on one GPU.
        engine_bytes: the colocated rollout engine's share (0 when the rollout ranks are separate).
        gpu_bytes: the GPU's memory.
        gpu_name: what the GPU is (or the assumption).
    """

    params: int
    model_parallel: int
    data_parallel: int
    expert_parallel: int
    processes: str
    trainer_bytes: int
    engine_bytes: int
    gpu_bytes: int
    gpu_name: str

    @property
    def total_bytes(self) -> int:
        """Trainer and engine together."""
        return self.trainer_bytes + self.engine_bytes

    @property
    def fits(self) -> bool:
        """Whether the estimate (activations excluded) fits the GPU."""
        return self.total_bytes <= self.gpu_bytes

    def describe(self, *, verdict: bool = True) -> str:
        """One line: the formula with its numbers and the verdict.

        Args:
            verdict: add the engine and judge the sum against the GPU; ``False``: the trainer state alone, for a
                header whose per-phase plan gives the verdict (the sum of both would be a second, other verdict).
        """
        gb = 1e9
        engine = f" + colocated engine {self.engine_bytes / gb:.1f} GB" if self.engine_bytes else ""
        judged = "fits" if self.fits else "EXCEEDS it"
        count = f"{self.params / 1e9:.2f} B" if self.params >= 10**8 else f"{self.params / 1e6:.2f} M"
        per_param = f"{TRAINER_BYTES_PER_PARAM} B"
        if self.data_parallel > 1:
            rest = TRAINER_BYTES_PER_PARAM - SHARDED_BYTES_PER_PARAM
            per_param = f"({rest} B + {SHARDED_BYTES_PER_PARAM} B / DP {self.data_parallel} of {self.processes})"
        experts = f", routed experts / EP {self.expert_parallel}" if self.expert_parallel > 1 else ""
        if not verdict:
            return (
                f"{count} params x {per_param} / (TP x PP = {self.model_parallel}){experts} = "
                f"{self.trainer_bytes / gb:.1f} GB trainer state (weights, gradients, Adam state, all on the GPU at "
                "once); the plan by phase below gives the verdict"
            )
        return (
            f"{count} params x {per_param} / (TP x PP = {self.model_parallel}){experts} = "
            f"{self.trainer_bytes / gb:.1f} GB trainer state{engine} = {self.total_bytes / gb:.1f} GB of "
            f"{self.gpu_bytes / gb:.0f} GB ({self.gpu_name}): {judged}; activations not included"
        )


def gpu_memory() -> tuple[int, str]:
    """``(bytes, name)`` of this machine's first GPU, else :data:`ASSUMED_GPU_BYTES` and the assumption."""
    import torch  # lazy: `config --explain` imports no torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), props.name
    return ASSUMED_GPU_BYTES, "no GPU here: an H100 80 GB assumed"


def estimate_memory(
    cfg: RunConfig, dims: ModelDims, *, gpu: tuple[int, str] | None = None, processes: int | None = None
) -> MemoryEstimate:
    """The per-GPU estimate of :mod:`this module <megatron_fp8.config.memory>` for ``cfg`` on ``dims``.

    Args:
        cfg: the run config (TP, PP, colocation and ``gpu_memory_utilization``).
        dims: the model's dimensions (its vocabulary included).
        gpu: ``(bytes, name)`` of the GPU; ``None``: :func:`gpu_memory`.
        processes: trainer processes; ``None``: ``$WORLD_SIZE``, else :data:`ASSUMED_PROCESSES`.
    """
    gpu_bytes, gpu_name = gpu if gpu is not None else gpu_memory()
    mcfg = cfg.policy.megatron_cfg
    model_parallel = mcfg.tensor_model_parallel_size * mcfg.pipeline_model_parallel_size
    params = dims.num_parameters
    colocated = cfg.policy.generation.colocated.enabled
    engine = int(cfg.policy.generation.vllm_cfg.gpu_memory_utilization * gpu_bytes) if colocated else 0
    if processes is not None:
        where = f"{processes} processes"
    elif os.environ.get("WORLD_SIZE", "").strip():
        processes = launch_place().world_size
        where = f"WORLD_SIZE {processes}"
    else:
        processes, where = ASSUMED_PROCESSES, f"{ASSUMED_PROCESSES} GPUs assumed"
    replicas = max(processes // model_parallel, 1)
    dp = replicas if mcfg.optimizer.use_distributed_optimizer else 1
    ep = mcfg.expert_model_parallel_size
    experts = dims.num_expert_parameters if ep > 1 else 0  # each EP rank holds 1/EP of them
    expert_dp = max(dp // ep, 1)  # the distributed optimizer shards an expert over the ranks holding it
    kept, sharded = TRAINER_BYTES_PER_PARAM - SHARDED_BYTES_PER_PARAM, SHARDED_BYTES_PER_PARAM
    per_replica = (params - experts) * kept + (params - experts) * sharded // dp
    per_replica += (experts * kept + experts * sharded // expert_dp) // ep
    return MemoryEstimate(
        params=params,
        model_parallel=model_parallel,
        data_parallel=dp,
        expert_parallel=ep,
        processes=where,
        trainer_bytes=per_replica // model_parallel,
        engine_bytes=engine,
        gpu_bytes=gpu_bytes,
        gpu_name=gpu_name,
    )


def describe_layout(cfg: RunConfig) -> str:
    """The trainer layout: TP and PP of one replica, DP from the process count, micro-batches per update."""
    mcfg = cfg.policy.megatron_cfg
    mp = mcfg.tensor_model_parallel_size * mcfg.pipeline_model_parallel_size
    micro, global_batch = cfg.policy.train_micro_batch_size, cfg.policy.train_global_batch_size
    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    updates = samples // global_batch if global_batch else 1
    micro_text = f"micro-batches of {micro} sequences" if micro else "one micro-batch per update"
    pack, dyn = cfg.policy.sequence_packing, cfg.policy.dynamic_batching
    if pack.enabled or dyn.enabled:
        kind, budgets = ("packed", pack) if pack.enabled else ("dynamic", dyn)
        micro_text = (
            f"{kind} micro-batches of <= {budgets.train_mb_tokens} tokens (scoring <= {budgets.logprob_mb_tokens})"
            + ("; a MoE model keeps padded rows" if cfg.model.is_moe else "")
        )
    return (
        f"TP {mcfg.tensor_model_parallel_size} x PP {mcfg.pipeline_model_parallel_size} per model replica; "
        f"DP = processes / {mp}; CP 1, EP {mcfg.expert_model_parallel_size}; {samples} samples per step in {updates} optimizer update(s) of "
        f"{samples // updates}; {micro_text}; Adam state "
        f"{'sharded over DP (distributed optimizer)' if mcfg.optimizer.use_distributed_optimizer else 'on every DP replica'}"
    )


def describe_rollout(cfg: RunConfig, *, processes: int) -> str:
    """Where the rollout runs for ``processes`` GRPO processes: engines, their TP, each replica's samples per engine."""
    mcfg = cfg.policy.megatron_cfg
    mp = mcfg.tensor_model_parallel_size * mcfg.pipeline_model_parallel_size
    tp = cfg.policy.generation.vllm_cfg.tensor_parallel_size
    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    if not cfg.policy.generation.colocated.enabled:
        if tp > 1:
            return f"engines of rollout TP {tp} cannot be placed on separate one-GPU rollout ranks (refused)"
        return "separate rollout ranks, one engine each (one GPU); the trainers' samples split evenly over them"
    if processes % mp:
        return f"{processes} processes do not hold whole replicas of TP x PP = {mp}"
    if processes > 1 or tp == 1:
        problem = engine_group_problem(
            world_size=processes, engine_ranks=tp, tp=mcfg.tensor_model_parallel_size,
            pp=mcfg.pipeline_model_parallel_size,
        )  # fmt: skip
        if problem is not None:
            return f"engines of rollout TP {tp} cannot be placed: {problem} (refused)"
    replicas = processes // mp
    engines = max(processes // tp, 1)
    per_replica = samples // replicas if replicas else 0
    pp, trainer_tp = mcfg.pipeline_model_parallel_size, mcfg.tensor_model_parallel_size
    span = engine_replica_span(engine_ranks=tp, tp=trainer_tp, pp=pp, dp=replicas)
    if tp > trainer_tp and replicas > 1 and span > 1:  # an engine holds the TP groups of `span` replicas
        if pp == 1:
            return (
                f"{processes} ranks: {engines} engine(s) of TP {tp}, each sharded over {tp} consecutive trainer ranks "
                f"(vLLM external_launcher) holding {span} replicas; each engine's {span * per_replica} samples in one "
                f"request, {per_replica} per replica"
            )
        low, high = per_replica // pp, -(-per_replica // pp)
        each = f"{low}" if low == high else f"{low}-{high}"
        return (
            f"{processes} ranks: {engines} engine(s) of TP {tp}, each sharded over {tp} consecutive trainer ranks "
            f"(vLLM external_launcher) holding one pipeline stage of {span} replicas; each replica's {per_replica} "
            f"samples over its {pp} engine(s) (one per stage), {each} each, an engine generating that part of each of "
            f"its {span} replicas"
        )
    per_engine_group = max(engines // replicas, 1)
    low, high = per_replica // per_engine_group, -(-per_replica // per_engine_group)
    each = f"{low}" if low == high else f"{low}-{high}"
    how = (
        "colocated (one per GPU)"
        if tp == 1
        else (
            f"each sharded over {tp} consecutive trainer ranks (vLLM external_launcher)"
            if processes > 1
            else "in one process (vLLM's own workers)"
        )
    )
    return (
        f"{processes} ranks: {engines} engine(s) of TP {tp}, {how}; each replica's {per_replica} samples over "
        f"its {per_engine_group} engine(s), {each} each"
    )


def engine_weight_bytes(cfg: RunConfig, dims: ModelDims) -> int:
    """Bytes of the rollout engine's whole weights: BF16 (2 B per parameter), or FP8 linear weights (1 B, plus a
    float32 scale per 128 x 128 block) with BF16 embeddings and output layer."""
    embeddings = dims.vocab_size * dims.hidden_size * (1 if dims.tie_word_embeddings else 2)
    if cfg.policy.generation.vllm_cfg.precision != "fp8":
        return 2 * dims.num_parameters
    linear = max(dims.num_parameters - embeddings, 0)
    return linear + 4 * linear // (128 * 128) + 2 * embeddings


def describe_engine_memory(cfg: RunConfig, dims: ModelDims, *, gpu: tuple[int, str] | None = None) -> tuple[str, bool]:
    """One line on a rollout engine's memory per GPU (its weights' shard and the KV cache left in its
    ``gpu_memory_utilization`` budget) and whether the weights fit that budget."""
    gpu_bytes, gpu_name = gpu if gpu is not None else gpu_memory()
    vllm = cfg.policy.generation.vllm_cfg
    weights = engine_weight_bytes(cfg, dims)
    shard = weights // vllm.tensor_parallel_size
    budget = int(vllm.gpu_memory_utilization * gpu_bytes)
    gb = 1e9
    line = (
        f"weights {weights / gb:.1f} GB ({vllm.precision}) / rollout TP {vllm.tensor_parallel_size} = "
        f"{shard / gb:.1f} GB + KV cache {max(budget - shard, 0) / gb:.1f} GB = its budget {budget / gb:.1f} GB "
        f"(gpu_memory_utilization {vllm.gpu_memory_utilization} x {gpu_bytes / gb:.0f} GB, {gpu_name})"
    )
    return line, shard < budget


def reference_host_bytes(cfg: RunConfig, dims: ModelDims) -> int:
    """Host bytes per rank the KL penalty's reference policy takes: its BF16 parameter shard and the swap copy
    (``2 x 2 B x params / (TP x PP)``, experts / EP); 0 without a penalty."""
    if not cfg.loss_fn.kl_enabled:
        return 0
    mcfg = cfg.policy.megatron_cfg
    experts = dims.num_expert_parameters if mcfg.expert_model_parallel_size > 1 else 0
    params = dims.num_parameters - experts + experts // mcfg.expert_model_parallel_size
    return 2 * 2 * params // (mcfg.tensor_model_parallel_size * mcfg.pipeline_model_parallel_size)


def layout_report(cfg: RunConfig, *, total_decides: bool = True) -> tuple[list[str], str | None]:
    """The lines ``config`` and ``doctor --config`` print (``layout: ...``, ``memory per GPU ...``), and a warning
    when the estimate exceeds the GPU (``None`` when it fits or the model is unknown).

    Args:
        cfg: the run config.
        total_decides: warn when trainer state + engine budget exceed the GPU; ``False``: the per-phase plan decides
            (:func:`megatron_fp8.config.memory_plan.memory_report`), only the engine's own budget is checked here.
    """
    processes = launch_place().world_size if os.environ.get("WORLD_SIZE", "").strip() else ASSUMED_PROCESSES
    lines = [
        f"layout: {describe_layout(cfg)}",
        f"rollout ({processes} processes): {describe_rollout(cfg, processes=processes)}",
    ]
    g = cfg.grpo
    if g.use_dynamic_sampling:
        lines.append(
            f"dynamic sampling: generation rounds of {g.round_prompts} prompts x {g.num_generations_per_prompt} = "
            f"{g.round_prompts * g.num_generations_per_prompt} samples until {g.num_prompts_per_step} x "
            f"{g.num_generations_per_prompt} = {g.num_prompts_per_step * g.num_generations_per_prompt} have varying "
            f"group rewards; at most {g.dynamic_sampling_max_gen_batches + 1} rounds a step, then the run stops"
        )
    dims = known_dims(cfg.model.name_or_path)
    if dims is None or not dims.vocab_size:
        lines.append(f"memory per GPU: no estimate ({cfg.model.name_or_path!r} is not in megatron_fp8/models/dims.py)")
        return lines, None
    estimate = estimate_memory(cfg, dims)
    lines.append(f"memory per GPU (estimate): {estimate.describe(verdict=total_decides)}")
    engine_line, engine_fits = describe_engine_memory(cfg, dims)
    lines.append(f"rollout engine per GPU (estimate): {engine_line}")
    if not engine_fits:
        return lines, (
            f"the rollout engine's weights do not fit its memory budget: {engine_line}; raise "
            "policy.generation.vllm_cfg.tensor_parallel_size (an engine over more ranks) or gpu_memory_utilization"
        )
    host = reference_host_bytes(cfg, dims)
    if host:
        lines.append(
            f"host memory per rank for the KL penalty's reference policy: {host / 1e9:.1f} GB (2 x 2 B x params / "
            "(TP x PP): its BF16 shard and the swap copy)"
        )
    if estimate.fits or not total_decides:
        return lines, None
    return lines, (
        f"the run's state does not fit one GPU: {estimate.describe()}; set "
        "policy.megatron_cfg.optimizer.use_distributed_optimizer, raise tensor_model_parallel_size or "
        "pipeline_model_parallel_size, or lower policy.generation.vllm_cfg.gpu_memory_utilization"
    )
