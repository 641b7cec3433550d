"""Data-parallel GRPO ranks: the process group from the environment and the rank-0 helpers.

Colocated (the default) or, with separate rollout ranks (:mod:`megatron_fp8.rl.cluster.roles`), over the trainer ranks
only: there the trainers' world is the default process group of a trainer rank, so every collective here (and
Megatron-Core's) spans the trainers and never a rollout rank (:func:`trainer_data_parallel`).

Under Slurm (``slurm/grpo.sbatch``) every task runs ``megatron-fp8 grpo`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. Each rank rolls out its share of the
step's prompts on its own colocated engine (whole groups, so advantages stay group-local),
Megatron-Core's DDP averages the gradients over ranks, every rank refits its own engine, and
rank 0 (the writer) averages the step metrics over ranks and writes the outputs. Every rank takes its own GPU
first (:mod:`megatron_fp8.rl.cluster.devices`: ``cuda:LOCAL_RANK``, or the one GPU Slurm bound to the task, checked
against the other ranks of its node).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from megatron_fp8.errors import ConfigError
from megatron_fp8.launch_env import launch_place
from megatron_fp8.layout import engine_of_rank, engine_replica_span, even_split
from megatron_fp8.rl.cluster.devices import bind_device, gather_with_process_group
from megatron_fp8.rl.cluster.roles import Placement
from megatron_fp8.rl.state.results import StepMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class DataParallel:
    """This process's place in a multi-process GRPO run (``torch.distributed`` from the environment).

    Ranks are placed in Megatron-Core's default order (``tp-cp-ep-dp-pp``: tensor-parallel ranks adjacent, then
    data-parallel replicas, pipeline stages outermost), so ``rank = tp_rank + TP x (dp_rank + DP x pp_rank)``. The
    ``TP x PP`` ranks of one model replica see the same samples; data is sharded by the data-parallel rank only.
    :func:`check_against_megatron` checks this against Megatron-Core's ``parallel_state`` once it is initialised.

    Attributes:
        rank: this process's rank among the trainers, ``0 <= rank < world_size``.
        world_size: number of GRPO trainer processes.
        tensor_parallel_size: ``policy.megatron_cfg.tensor_model_parallel_size``.
        pipeline_parallel_size: ``policy.megatron_cfg.pipeline_model_parallel_size``.

    Raises:
        ConfigError: ``world_size`` is not a multiple of ``TP x PP``.
    """

    rank: int = 0
    world_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        mp = self.tensor_parallel_size * self.pipeline_parallel_size
        if min(self.tensor_parallel_size, self.pipeline_parallel_size) < 1 or self.world_size % mp:
            raise ConfigError(
                f"{self.world_size} trainer processes cannot hold whole model replicas of {mp} ranks "
                f"(policy.megatron_cfg.tensor_model_parallel_size={self.tensor_parallel_size} x "
                f"pipeline_model_parallel_size={self.pipeline_parallel_size}): launch a multiple of {mp} processes"
            )

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica (``TP x PP``)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def is_writer(self) -> bool:
        """Rank 0 asks vLLM for the manifest, averages the metrics and writes the outputs."""
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Number of model replicas (data-parallel size)."""
        return self.world_size // self.model_parallel_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank (its model replica's index)."""
        return (self.rank // self.tensor_parallel_size) % self.dp_size

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.rank // (self.tensor_parallel_size * self.dp_size)

    @property
    def replica_first_rank(self) -> int:
        """The global rank of the first rank of this model replica (tensor-parallel rank 0 of the first stage)."""
        return self.dp_rank * self.tensor_parallel_size

    @property
    def is_replica_first(self) -> bool:
        """The first rank of its model replica (the one that counts the replica's samples once)."""
        return self.rank == self.replica_first_rank

    def shard(self, items: Sequence[T]) -> list[T]:
        """This replica's items: the ``dp_rank``-th of ``dp_size`` contiguous, even blocks (the same on its
        model-parallel ranks), so a replica's items keep their global order and start at :meth:`shard_start`."""
        a, b = even_split(len(items), self.dp_size)[self.dp_rank]
        return list(items[a:b])

    def shard_start(self, n: int) -> int:
        """Index, among ``n`` items, of this replica's first item of :meth:`shard`."""
        return even_split(n, self.dp_size)[self.dp_rank][0]

    def replicas_block(self, n: int, first: int, count: int) -> tuple[int, int]:
        """``[start, stop)`` among ``n`` items of the :meth:`shard` s of replicas ``first .. first + count - 1`` (they
        are contiguous: replicas take consecutive blocks)."""
        blocks = even_split(n, self.dp_size)
        return blocks[first][0], blocks[first + count - 1][1]


@dataclass(frozen=True)
class RolloutShare:
    """Which of its replica's samples this rank's engine generates.

    Every rank of a model replica (its TP ranks and pipeline stages) hosts a colocated engine or a shard of one: an
    engine of rollout TP ``e`` spans ``e`` consecutive ranks (vLLM's ``external_launcher``), all of which submit the
    same requests. A replica of ``TP x PP`` ranks thus has ``TP x PP / e`` engines; the replica's samples are cut into
    that many contiguous, even parts in rank order, and part ``engine`` is this rank's engine's. An engine larger than
    the trainer's TP (a multiple of it: :func:`megatron_fp8.layout.engine_replica_span`) holds the TP groups of
    ``span`` consecutive replicas (whole replicas at PP 1, one pipeline stage of each at PP > 1) and rolls out the
    same part of each of them (:attr:`first_replica`, :attr:`span`); each rank keeps its own replica's.

    Attributes:
        engine: this rank's engine's index among its replica's engines.
        engines: engines per replica.
        start: first sample of this rank's part, an index into the replica's samples.
        stop: one past its last sample.
        leader: this rank's result stands for its engine in the replica's gather (the engine's lowest rank).
        first_replica: the first data-parallel replica this rank's engine rolls out for (its own when ``span`` is 1).
        span: replicas this rank's engine rolls out for (1: its own only); ``start``/``stop`` then index the part
            of each of those replicas' samples the engine generates (all of them at PP 1, part ``engine`` of
            ``engines``, one per pipeline stage, at PP > 1).
    """

    engine: int
    engines: int
    start: int
    stop: int
    leader: bool = True
    first_replica: int = 0
    span: int = 1

    @property
    def count(self) -> int:
        """Samples this rank's engine generates."""
        return self.stop - self.start


def engine_replicas(dp: DataParallel, engine_ranks: int) -> tuple[int, int]:
    """``(first replica, replicas)`` this rank's engine rolls out for: its own replica alone, or the consecutive
    replicas whose TP groups an engine larger than the trainer's TP holds (:func:`megatron_fp8.layout.engine_replica_span`;
    at PP > 1 one stage of each).

    Raises:
        ConfigError: such an engine that does not hold whole TP groups of replicas (the preflight refuses it).
    """
    if engine_ranks <= dp.tensor_parallel_size or dp.dp_size == 1:
        return dp.dp_rank, 1
    span = engine_replica_span(
        engine_ranks=engine_ranks, tp=dp.tensor_parallel_size, pp=dp.pipeline_parallel_size, dp=dp.dp_size
    )
    if span < 2:
        raise ConfigError(
            f"rank {dp.rank}: an engine of {engine_ranks} ranks neither lies in one replica of {dp.model_parallel_size} "
            "ranks nor holds whole replicas (PP 1, a multiple of the trainer's TP); set "
            "policy.generation.vllm_cfg.tensor_parallel_size to a divisor of the trainer's TP or such a multiple"
        )
    return dp.dp_rank // span * span, span


def rollout_share(n_samples: int, dp: DataParallel, *, engine_ranks: int = 1) -> RolloutShare:
    """This rank's part of its replica's ``n_samples`` samples (:class:`RolloutShare`).

    Args:
        n_samples: the replica's samples this step.
        dp: this rank's place.
        engine_ranks: ranks per engine (``vllm_cfg.tensor_parallel_size``; the preflight checked that an engine lies
            inside one replica: :func:`megatron_fp8.layout.engine_group_problem`).
    """
    if dp.model_parallel_size == 1 and engine_ranks == 1:
        return RolloutShare(engine=0, engines=1, start=0, stop=n_samples)
    first, span = engine_replicas(dp, engine_ranks)
    if span > 1:  # the engine holds the TP groups of `span` replicas (one pipeline stage of each): one engine per stage
        engines = dp.pipeline_parallel_size
        start, stop = even_split(n_samples, engines)[dp.pp_rank]
        leader = dp.rank % dp.tensor_parallel_size == 0  # its replica's first rank in the engine
        return RolloutShare(
            engine=dp.pp_rank, engines=engines, start=start, stop=stop, leader=leader, first_replica=first, span=span
        )
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    group = parallel_state.get_model_parallel_group()
    members = dist.get_process_group_ranks(group) if dp.model_parallel_size > 1 else [dist.get_rank()]
    rank = dist.get_rank()
    engine, engines, leader = engine_of_rank(rank, members, engine_ranks)
    if engines * engine_ranks != len(members):
        raise ConfigError(
            f"rank {rank}: the engines of {engine_ranks} ranks do not tile its model replica (ranks {members}); "
            "set policy.generation.vllm_cfg.tensor_parallel_size to a divisor of the trainer's TP, or run one replica"
        )
    start, stop = even_split(n_samples, engines)[engine]
    return RolloutShare(engine=engine, engines=engines, start=start, stop=stop, leader=leader)


def sample_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of sample ``index`` of GRPO step ``step`` (problem-major: problem ``p``'s generation ``k``
    is ``p x num_generations_per_prompt + k`` among the step's problems), for run seed ``grpo.seed``. An engine
    seeds prompt ``j`` of a request with ``seed + j``, so a request for samples ``a..b`` passes
    ``sample_seed(seed, step, a)``."""
    return seed * 1_000_003 + step * 10_007 + index


def request_ranges(
    dp: DataParallel, share: RolloutShare, *, n_problems: int, generations: int
) -> tuple[list[tuple[int, int]], int]:
    """The samples this rank's engine generates, as ``[start, stop)`` ranges of the step's samples (problem-major):
    its part of its replica's (one range), or the same part of each replica it holds (one range per replica, in
    replica order); and which range is this rank's replica's.

    Args:
        dp: this rank's place.
        share: its :func:`rollout_share`.
        n_problems: the step's problems (over all replicas).
        generations: samples per problem.
    """
    if share.span == 1:
        first = dp.shard_start(n_problems) * generations
        return [(first + share.start, first + share.stop)], 0
    ranges = []
    for replica in range(share.first_replica, share.first_replica + share.span):
        a, b = dp.replicas_block(n_problems, replica, 1)
        lo, hi = even_split((b - a) * generations, share.engines)[share.engine]
        ranges.append((a * generations + lo, a * generations + hi))
    return ranges, dp.dp_rank - share.first_replica


def gather_within_replica(part: Sequence[T], share: RolloutShare) -> list[T]:
    """The replica's whole sample list from each engine's ``part``, in engine order, on every rank of the replica
    (an all-gather over Megatron-Core's model-parallel group of each engine's leader's part; ``part`` itself with one
    engine per replica: every rank of a sharded engine holds its whole result)."""
    if share.engines == 1:
        return list(part)
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    group = parallel_state.get_model_parallel_group()
    boxes: list[tuple[int, list[T]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(boxes, (share.engine, list(part)) if share.leader else None, group=group)
    parts = dict(box for box in boxes if box is not None)
    return [item for engine in range(share.engines) for item in parts[engine]]


def _reduce_device() -> torch.device:
    """Where a tensor of a collective over Megatron-Core's groups lives: the rank's GPU (NCCL reduces device tensors
    only), else the host (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def longest_over_replicas(length: int, dp: DataParallel) -> int:
    """The largest ``length`` over the data-parallel replicas (an all-reduce over Megatron-Core's data-parallel group;
    ``length`` itself with one replica)."""
    if dp.dp_size == 1:
        return length
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional (the GPU test box has torch only)

    box = torch.tensor([length], dtype=torch.int64, device=_reduce_device())
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
    return int(box)


def gather_over_replicas(item: T, dp: DataParallel) -> list[T]:
    """``item`` of every data-parallel replica, in replica order (an all-gather of objects over Megatron-Core's
    data-parallel group; ``[item]`` with one replica)."""
    if dp.dp_size == 1:
        return [item]
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    group = parallel_state.get_data_parallel_group()
    boxes: list[T | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(boxes, item, group=group)
    return boxes  # type: ignore[return-value]


def mean_over_replicas(value: float, dp: DataParallel) -> float:
    """The mean of ``value`` over the data-parallel replicas (a float64 all-reduce over Megatron-Core's data-parallel
    group; ``value`` itself with one replica). An update's loss divides by the mean of the replicas' token (or
    sequence) counts: with DDP's mean of the replicas' gradients, that is the whole batch's token mean, as NeMo-RL
    normalizes by the global batch's count, whatever the data-parallel size."""
    if dp.dp_size == 1:
        return value
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    box = torch.tensor([value], dtype=torch.float64, device=_reduce_device())
    dist.all_reduce(box, group=parallel_state.get_data_parallel_group())
    return float(box) / dp.dp_size


def check_against_megatron(dp: DataParallel) -> None:
    """Refuse a data-parallel place that disagrees with Megatron-Core's ``parallel_state`` (once initialised).

    Raises:
        ConfigError: naming both places.
    """
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    got = (
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_model_parallel_src_rank(),
    )
    want = (dp.dp_rank, dp.dp_size, dp.pp_rank, dp.replica_first_rank)
    if got != want:
        raise ConfigError(
            f"rank {dp.rank}: Megatron-Core places it at (data-parallel rank, size, pipeline stage, replica's first "
            f"rank) = {got}, the GRPO driver at {want}; the GRPO driver supports Megatron-Core's default rank order "
            "(tp-cp-ep-dp-pp)"
        )


@contextlib.contextmanager
def data_parallel_from_env(*, timeout_s: float = 1800.0) -> Iterator[DataParallel]:
    """Join the ``WORLD_SIZE`` processes of this run (gloo) for its whole length; one process: no group.

    Each rank selects its GPU (``torch.cuda.set_device``) before anything touches CUDA, and fails when another
    rank of its node already holds it (:func:`megatron_fp8.rl.cluster.devices.bind_device`).

    Separate trainer and rollout ranks (:func:`megatron_fp8.rl.cluster.roles.placement_from`) join with
    :func:`megatron_fp8.rl.cluster.roles.join_groups` instead; a trainer rank's place is :func:`trainer_data_parallel`.

    Raises:
        ConfigError: ``MFP8_ROLE`` other than ``colocated`` (a separate placement), ``WORLD_SIZE > 1`` without a
            rendezvous, or two ranks of a node on one GPU.
    """
    place = launch_place()
    world, rank = place.world_size, place.rank
    role = os.environ.get("MFP8_ROLE", "colocated") or "colocated"
    if role != "colocated":
        raise ConfigError(
            f"rank {rank}: MFP8_ROLE={role!r} (slurm/grpo.sbatch with ROLLOUT_TASKS set) is a separate trainer / "
            "rollout placement, which joins its groups with megatron_fp8.rl.cluster.roles.join_groups (placement_from "
            "decides); data_parallel_from_env joins colocated ranks only. Unset ROLLOUT_TASKS to run colocated"
        )
    if world <= 1:
        bind_device()
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
        bind_device(gather_with_process_group)
        yield DataParallel(rank=rank, world_size=world)
    finally:
        dist.destroy_process_group()


def trainer_data_parallel(placement: Placement) -> DataParallel:
    """A trainer rank's data-parallel place among the trainer ranks only (separate or colocated placement).

    With separate rollout ranks the trainers' world is the default process group on a trainer rank
    (:func:`megatron_fp8.rl.cluster.roles.join_groups`), so :func:`share_from_writer`, :func:`average_over_ranks` and
    Megatron-Core work over the trainers unchanged.

    Raises:
        ConfigError: ``placement`` is a rollout rank's.
    """
    if placement.trainer_rank is None:
        raise ConfigError(f"rank {placement.rank} is a rollout rank: it has no place among the trainers")
    return DataParallel(rank=placement.trainer_rank, world_size=len(placement.trainer_ranks))


def share_from_writer(value: T | None, dp: DataParallel) -> T:
    """``value`` as computed on rank 0, on every rank (pickled broadcast; other ranks pass ``None``)."""
    box: list[T | None] = [value]
    if dp.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    shared = box[0]
    if shared is None:
        raise ConfigError("rank 0 shared nothing: call share_from_writer with a value on rank 0")
    return shared


_SUM_FIELDS = ("refit_bytes",)
"""Per-rank payloads add up; every other float is averaged, other values are taken from rank 0."""
_RANK0_FIELDS = ("arm", "step", "engine", "sample")
_PER_RANK_FIELDS = (
    "rollout_prompts_per_rank",
    "rollout_tokens_per_s_per_rank",
    "refit_host_staged_bytes_per_rank",
    "refit_device_staged_bytes_per_rank",
    "reward_mean_per_rank",
    "refit_bytes_per_rank",
    "refit_seconds_per_rank",
    "trainer_tokens_real_per_rank",
    "trainer_tokens_computed_per_rank",
)
"""Tuples of one entry per rank: concatenated in rank order."""


def _combine(key: str, values: Sequence[object]) -> object:
    """One field over ranks: bools all-true, floats averaged (``_SUM_FIELDS`` summed), else rank 0's."""
    first = values[0]
    if key in _PER_RANK_FIELDS:
        return tuple(x for v in values if isinstance(v, (tuple, list)) for x in v)
    if isinstance(first, bool):
        return all(values)
    if isinstance(first, Mapping):
        return {k: _combine(f"{key}.{k}", [v[k] for v in values if isinstance(v, Mapping)]) for k in first}
    if not isinstance(first, (int, float)):
        return first
    numbers = [v for v in values if isinstance(v, (int, float))]
    if key.split(".")[0] in _SUM_FIELDS:
        return sum(numbers)
    return float(sum(numbers) / len(numbers)) if isinstance(first, float) else first


def average_over_ranks(m: StepMetrics, dp: DataParallel) -> StepMetrics:
    """Average a step's numeric metrics over ranks (refit bytes summed); collective, rank 0 uses the result."""
    if dp.world_size == 1:
        return m
    gathered: list[dict[str, object] | None] = [None] * dp.world_size
    dist.all_gather_object(gathered, dataclasses.asdict(m))
    records = [g for g in gathered if g is not None]
    merged = {k: _combine(k, [r[k] for r in records]) for k in records[0] if k not in _RANK0_FIELDS}
    return dataclasses.replace(m, **merged)
