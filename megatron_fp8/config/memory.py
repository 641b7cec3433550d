"""The trainer layout a config asks for, and a per-GPU memory estimate with its formula.

Printed by ``megatron-fp8 config`` before anything is loaded. The estimate counts what a layout must hold
for the whole run (parameters, gradients, optimizer state, and the colocated engine's share), not activations,
which depend on the micro-batch and sequence length:

``trainer bytes per GPU = params x 18 B / (TP x PP)``: BF16 weights (2 B), FP32 main weights (4 B), two FP32
Adam moments (8 B) and the FP32 gradient buffer (4 B, ``grad_reduce_in_fp32``), per parameter; the optimizer
state is not sharded over data-parallel ranks (no distributed optimizer yet). A colocated vLLM engine takes
``gpu_memory_utilization x`` the GPU's memory besides.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_fp8.config.models import ModelDims
from megatron_fp8.config.schema import RunConfig

TRAINER_BYTES_PER_PARAM = 2 + 4 + 8 + 4
"""BF16 weights + FP32 main weights + two FP32 Adam moments + FP32 gradients (bytes per parameter)."""

ASSUMED_GPU_BYTES = 80 * 10**9
"""The GPU assumed when none is visible: an H100 80 GB (bytes)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """One GPU's share of a run's state, in bytes (decimal GB in :meth:`describe`).

    Attributes:
        params: model parameters (elements).
        model_parallel: TP x PP (ranks one replica's state is split over).
        trainer_bytes: parameters, gradients and optimizer state on one GPU.
        engine_bytes: the colocated rollout engine's share (0 when the rollout ranks are separate).
        gpu_bytes: the GPU's memory.
        gpu_name: what the GPU is (or the assumption).
    """

    params: int
    model_parallel: int
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

    def describe(self) -> str:
        """One line: the formula with its numbers and the verdict."""
        gb = 1e9
        engine = f" + colocated engine {self.engine_bytes / gb:.1f} GB" if self.engine_bytes else ""
        verdict = "fits" if self.fits else "EXCEEDS it"
        count = f"{self.params / 1e9:.2f} B" if self.params >= 10**8 else f"{self.params / 1e6:.2f} M"
        return (
            f"{count} params x {TRAINER_BYTES_PER_PARAM} B / (TP x PP = {self.model_parallel}) = "
            f"{self.trainer_bytes / gb:.1f} GB trainer state{engine} = {self.total_bytes / gb:.1f} GB of "
            f"{self.gpu_bytes / gb:.0f} GB ({self.gpu_name}): {verdict}; activations not included"
        )


def gpu_memory() -> tuple[int, str]:
    """``(bytes, name)`` of this machine's first GPU, else :data:`ASSUMED_GPU_BYTES` and the assumption."""
    import torch  # lazy: `config --explain` imports no torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), props.name
    return ASSUMED_GPU_BYTES, "no GPU here: an H100 80 GB assumed"


def estimate_memory(cfg: RunConfig, dims: ModelDims, *, gpu: tuple[int, str] | None = None) -> MemoryEstimate:
    """The per-GPU estimate of :mod:`this module <megatron_fp8.config.memory>` for ``cfg`` on ``dims``.

    Args:
        cfg: the run config (TP, PP, colocation and ``gpu_memory_utilization``).
        dims: the model's dimensions (its vocabulary included).
        gpu: ``(bytes, name)`` of the GPU; ``None``: :func:`gpu_memory`.
    """
    gpu_bytes, gpu_name = gpu if gpu is not None else gpu_memory()
    mcfg = cfg.policy.megatron_cfg
    model_parallel = mcfg.tensor_model_parallel_size * mcfg.pipeline_model_parallel_size
    params = dims.num_parameters
    colocated = cfg.policy.generation.colocated.enabled
    engine = int(cfg.policy.generation.vllm_cfg.gpu_memory_utilization * gpu_bytes) if colocated else 0
    return MemoryEstimate(
        params=params,
        model_parallel=model_parallel,
        trainer_bytes=params * TRAINER_BYTES_PER_PARAM // model_parallel,
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
    return (
        f"TP {mcfg.tensor_model_parallel_size} x PP {mcfg.pipeline_model_parallel_size} per model replica; "
        f"DP = processes / {mp}; CP 1, EP 1; {samples} samples per step in {updates} optimizer update(s) of "
        f"{samples // updates}; {micro_text}"
    )
