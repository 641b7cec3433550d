"""One home for block and shard layout math (integers only, no torch).

Block-FP8 weights are cut into ``block_n x block_k`` tiles over ``[N_out, K_in]``;
their float32 scales have one entry per tile, row-major. A tensor-parallel
partition or a fused shard can be quantized (and requantized) independently only
when it starts and ends on block boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, exactly (no float rounding); ``b > 0``."""
    if b <= 0:
        raise ValueError(f"ceil_div: divisor must be positive, got {b}")
    return -(-a // b)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``, in elements, as torch gives them (a size-0
    dimension counts as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, stop)`` ranges covering ``0..n`` in order, sizes differing by at most one
    (the larger first); ``parts > 0``."""
    if parts <= 0:
        raise ValueError(f"even_split: parts must be positive, got {parts}")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        stop = start + base + (1 if k < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def block_scale_shape(shape: Sequence[int], block_size: Sequence[int]) -> tuple[int, ...]:
    """Float32 scale shape of a blockwise-quantized tensor.

    Args:
        shape: ``[N, K]`` or ``[E, N, K]`` (leading dims kept).
        block_size: ``(block_n, block_k)``.

    Returns:
        ``(*lead, ceil(N / block_n), ceil(K / block_k))``.
    """
    if len(shape) < 2:
        raise ValueError(f"block_scale_shape needs at least 2 dims, got shape {tuple(shape)}")
    *lead, n, k = shape
    bn, bk = block_size
    return (*lead, ceil_div(n, bn), ceil_div(k, bk))


def group_scale_shape(shape: Sequence[int], group_size: int) -> tuple[int, ...]:
    """Float32 scale shape of per-token-group quantization: ``(*lead, ceil(K / group_size))``."""
    *lead, k = shape
    return (*lead, ceil_div(k, group_size))


def is_blockable(offset: int, size: int, block: int) -> bool:
    """Whether the slice ``[offset, offset + size)`` starts and ends on ``block`` boundaries."""
    return offset % block == 0 and size % block == 0


def tp_splits_blockable(size: int, tp_size: int, block: int) -> bool:
    """Whether ``size`` splits into ``tp_size`` equal partitions of whole ``block`` blocks."""
    return size % tp_size == 0 and (size // tp_size) % block == 0


def blockable_tp_sizes(size: int, block: int, candidates: Sequence[int] = (1, 2, 4, 8, 16)) -> list[int]:
    """The ``candidates`` TP sizes for which :func:`tp_splits_blockable` holds."""
    return [t for t in candidates if tp_splits_blockable(size, t, block)]


def engine_group_problem(*, world_size: int, engine_ranks: int, tp: int, pp: int) -> str | None:
    """Why ``world_size`` trainer ranks cannot host engines of ``engine_ranks`` consecutive ranks each, or ``None``.

    An engine sharded over trainer ranks (vLLM's ``external_launcher``) takes ``engine_ranks`` consecutive ranks
    (vLLM's own TP groups); every rank of it submits the same requests. In Megatron-Core's rank order (TP fastest,
    then DP, then PP) the block lies inside one model replica when ``engine_ranks`` divides the trainer's TP, or when
    there is a single replica (DP = 1); it holds the TP groups of consecutive replicas (:func:`engine_replica_span`)
    when it is a multiple of the trainer's TP and the replicas split into such groups (at PP > 1: one pipeline stage
    of each): the engine then rolls out for all of them.

    Args:
        world_size: trainer processes.
        engine_ranks: rollout tensor-parallel size.
        tp: trainer tensor-parallel size.
        pp: trainer pipeline-parallel size.
    """
    if engine_ranks <= 1:
        return None
    if world_size % engine_ranks:
        return f"{world_size} ranks do not split into engines of {engine_ranks} ranks"
    dp = world_size // (tp * pp) if world_size % (tp * pp) == 0 else 0
    if tp % engine_ranks == 0 or dp == 1 or engine_replica_span(engine_ranks=engine_ranks, tp=tp, pp=pp, dp=dp) > 1:
        return None
    span = engine_ranks // math.gcd(engine_ranks, tp)
    why = "its ranks would hold parts of replicas' TP groups"
    if engine_ranks % tp == 0:
        why = f"the {dp} replicas do not split into groups of {engine_ranks // tp}"
    return f"an engine of {engine_ranks} consecutive ranks would span {span} data-parallel replicas (trainer TP {tp}, DP {dp}, PP {pp}): {why}"


def engine_replica_span(*, engine_ranks: int, tp: int, pp: int, dp: int) -> int:
    """How many data-parallel replicas one engine of ``engine_ranks`` consecutive ranks rolls out for: 1 when it lies
    inside one replica; ``engine_ranks / tp`` when it is a multiple of the trainer's TP and the ``dp`` replicas split
    into groups of that many (its ranks are then the TP groups of consecutive replicas: whole replicas at PP 1, one
    pipeline stage of each at PP > 1); 0 when neither holds (:func:`engine_group_problem` refuses the layout)."""
    if engine_ranks <= tp:
        return 1 if tp % engine_ranks == 0 else 0
    span = engine_ranks // tp
    return span if engine_ranks % tp == 0 and dp % span == 0 else 0


def engine_of_rank(rank: int, replica_ranks: Sequence[int], engine_ranks: int) -> tuple[int, int, bool]:
    """``(engine index within the replica, engines per replica, whether rank leads its engine)``.

    Engines are blocks of ``engine_ranks`` consecutive ranks (:func:`engine_group_problem` must hold); a replica's
    engines are numbered in rank order; an engine's lowest rank leads it.
    """
    blocks = sorted({r // engine_ranks for r in replica_ranks})
    return blocks.index(rank // engine_ranks), len(blocks), rank % engine_ranks == 0


@dataclass(frozen=True)
class ShardSlice:
    """One engine rank's part of one checkpoint-format tensor: ``narrow(dim, start, length)`` of its ``full`` size
    along ``dim`` (rows of a column-parallel weight or of a vocabulary, columns of a row-parallel weight).

    Raises:
        ValueError: a slice outside ``[0, full)`` or empty.
    """

    dim: int
    start: int
    length: int
    full: int

    def __post_init__(self) -> None:
        if self.dim < 0 or self.length <= 0 or self.start < 0 or self.start + self.length > self.full:
            raise ValueError(f"shard slice {self} is not a part of dimension {self.dim} of size {self.full}")

    def scaled(self, block: int) -> ShardSlice:
        """The same part of a block-scale grid of ``block`` elements per entry (the FP8 weight's scales).

        Raises:
            ValueError: the part does not start on a block, or ends inside one that is not the last: its blocks
                would not be the full tensor's (blockwise FP8 needs block-aligned TP partitions).
        """
        end = self.start + self.length
        if self.start % block or (end % block and end != self.full):
            raise ValueError(
                f"rows/columns {self.start}:{end} of {self.full} along dimension {self.dim} are not whole "
                f"{block}-element blocks: this TP split cannot be quantized shard by shard"
            )
        return ShardSlice(
            self.dim, self.start // block, ceil_div(end, block) - self.start // block, ceil_div(self.full, block)
        )


@dataclass(frozen=True)
class ShardPlan:
    """What one rank of an engine sharded over trainer ranks takes of each tensor of a refit version: declared once
    (by the engine's worker, from its live layers) and used by the trainer's export (it sends only these parts), the
    receiver's staging and the worker's load and verification.

    Attributes:
        rank: the engine rank (its TP rank).
        size: the engine's TP size.
        slices: checkpoint name -> :class:`ShardSlice`; a name without one is taken whole (norms, KV scales, a
            replicated layer).
    """

    rank: int
    size: int
    slices: Mapping[str, ShardSlice]

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"shard plan of engine rank {self.rank} of {self.size}")

    def local_shape(self, name: str, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of this rank's part of ``name``, whose full shape is ``shape``."""
        part = self.slices.get(name)
        if part is None:
            return tuple(shape)
        out = list(shape)
        out[part.dim] = part.length
        return tuple(out)

    def local_fraction(self, shapes: Mapping[str, Sequence[int]]) -> float:
        """Elements of this rank's parts over the full tensors' (``shapes``: name -> full shape)."""
        full = sum(math.prod(s) for s in shapes.values())
        local = sum(math.prod(self.local_shape(n, s)) for n, s in shapes.items())
        return local / full if full else 1.0


def narrow_stream(stream: Iterable[tuple[str, Any]], plan: ShardPlan) -> Iterator[tuple[str, Any]]:
    """``stream`` with every tensor cut to this rank's part (a view along rows; a contiguous copy along columns, so
    that the packer and the quantizer read only the part).

    Raises:
        ValueError: a tensor whose size along its slice's dimension is not the planned full size (a stream of
            another model or TP layout than the engine's).
    """
    for name, tensor in stream:
        part = plan.slices.get(name)
        if part is None:
            yield name, tensor
            continue
        if tensor.dim() <= part.dim or int(tensor.shape[part.dim]) != part.full:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} does not hold {part.full} along dimension {part.dim}, as engine "
                f"rank {plan.rank} of {plan.size} planned its part; the stream and the engine describe different models"
            )
        local = tensor.narrow(part.dim, part.start, part.length)
        yield name, (local if part.dim == 0 else local.contiguous())
