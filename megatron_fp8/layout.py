"""One home for block and shard layout math (integers only, no torch).

Block-FP8 weights are cut into ``block_n x block_k`` tiles over ``[N_out, K_in]``;
their float32 scales have one entry per tile, row-major. A tensor-parallel
partition or a fused shard can be quantized (and requantized) independently only
when it starts and ends on block boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, exactly (no float rounding); ``b > 0``."""
    if b <= 0:
        raise ValueError(f"ceil_div: divisor must be positive, got {b}")
    return -(-a // b)


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
