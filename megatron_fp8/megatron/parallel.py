"""torch.distributed + Megatron-Core model-parallel state on CPU (gloo).

Megatron-Core modules read their tensor/pipeline/expert groups from
``megatron.core.parallel_state`` even for a single process, so every model build
happens inside :func:`megatron_parallel`, which

1. initialises a gloo process group (single process by default, or the
   ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` of a launcher such
   as ``torchrun`` or ``srun``); a lone process without a port meets on an in-process store;
2. calls ``parallel_state.initialize_model_parallel`` with the requested sizes;
3. tears both down on exit, in reverse order, even on error. A process group that
   already existed before entry is reused and left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from bridge_mappings.adapter import reset_rng_tracker, use_cpu_rng_tracker
from megatron_fp8.errors import ConfigError
from megatron_fp8.launch_env import env_int, launch_place

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelState:
    """What :func:`megatron_parallel` set up.

    Attributes:
        rank: global rank of this process.
        world_size: number of processes.
        tensor_parallel_size: Megatron tensor-parallel size.
        pipeline_parallel_size: Megatron pipeline-parallel size.
        expert_parallel_size: Megatron expert-parallel size.
        backend: torch.distributed backend (``"gloo"`` on CPU).
        owns_process_group: whether this context created (and will destroy) the process group.
    """

    rank: int
    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    expert_parallel_size: int
    backend: str
    owns_process_group: bool


@contextlib.contextmanager
def megatron_parallel(
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    seed: int = 1234,
) -> Iterator[ParallelState]:
    """Initialise torch.distributed and Megatron-Core parallel state; tear both down on exit.

    Args:
        tensor_parallel_size: Megatron TP size (must divide ``world_size``).
        pipeline_parallel_size: Megatron PP size.
        expert_parallel_size: Megatron EP size (MoE).
        rank: global rank; defaults to the initialized default group's rank, else ``$RANK`` or 0.
        world_size: number of processes; defaults to the initialized default group's size, else ``$WORLD_SIZE``
            or 1 (with separate rollout ranks the trainers' world, not every process of the run).
        master_addr: rendezvous host; defaults to ``$MASTER_ADDR`` or 127.0.0.1.
        master_port: rendezvous port; defaults to ``$MASTER_PORT``. Without one a single process
            initialises on an in-process store (no port); several processes must agree on a port.
        backend: torch.distributed backend; ``"gloo"`` for CPU.
        timeout_s: collective timeout in seconds.
        seed: seed for Megatron's model-parallel RNG tracker (and ``torch.manual_seed``).

    Yields:
        The :class:`ParallelState` that was set up.

    Raises:
        ConfigError: inconsistent sizes, a missing port for multi-process runs, or
            Megatron parallel state that is already initialised.
    """
    from megatron.core import parallel_state, tensor_parallel  # lazy: Megatron-Core is optional

    if dist.is_initialized():  # an existing default group (e.g. the trainers' world of a split run) decides
        rank = rank if rank is not None else dist.get_rank()
        world_size = world_size if world_size is not None else dist.get_world_size()
    place = launch_place() if rank is None or world_size is None else None
    rank = rank if rank is not None else place.rank
    world_size = world_size if world_size is not None else place.world_size
    model_parallel = tensor_parallel_size * pipeline_parallel_size
    if min(tensor_parallel_size, pipeline_parallel_size, expert_parallel_size, world_size) < 1:
        raise ConfigError("parallel sizes and world_size must be >= 1")
    if world_size % model_parallel:
        raise ConfigError(
            f"world_size {world_size} is not divisible by tensor_parallel_size x pipeline_parallel_size "
            f"= {model_parallel}; change the sizes or the number of processes"
        )
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside [0, {world_size})")
    if parallel_state.model_parallel_is_initialized():
        raise ConfigError(
            "Megatron-Core parallel state is already initialised; nest model builds inside one "
            "megatron_parallel() context instead of opening a second one"
        )

    owns_pg = not dist.is_initialized()
    if owns_pg:
        addr = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        port = master_port or (env_int("MASTER_PORT", default=0, minimum=1) or None)
        timeout = timedelta(seconds=timeout_s)
        if port is not None:
            logger.debug("init_process_group(%s) rank %d/%d at %s:%d", backend, rank, world_size, addr, port)
            dist.init_process_group(
                backend=backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size, timeout=timeout
            )
        elif world_size > 1:
            raise ConfigError(
                f"world_size {world_size} > 1 needs a shared master_port (or $MASTER_PORT) so ranks can meet"
            )
        else:
            # a lone process meets no one: an in-process store binds no port, so no other process can take it
            # between a free-port probe and the bind (EADDRINUSE under a busy machine's parallel jobs)
            logger.debug("init_process_group(%s) rank 0/1 on an in-process store", backend)
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel_size,
            pipeline_model_parallel_size=pipeline_parallel_size,
            expert_model_parallel_size=expert_parallel_size,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        )
        try:
            torch.manual_seed(seed)
            if not use_cpu_rng_tracker():
                tensor_parallel.model_parallel_cuda_manual_seed(seed)
            yield ParallelState(
                rank=rank,
                world_size=world_size,
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
                expert_parallel_size=expert_parallel_size,
                backend=backend,
                owns_process_group=owns_pg,
            )
        finally:
            reset_rng_tracker()
            parallel_state.destroy_model_parallel()
    finally:
        if owns_pg and dist.is_initialized():
            dist.destroy_process_group()
