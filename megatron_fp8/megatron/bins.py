"""Sequence bin packing for packed micro-batches (NeMo-RL's ``policy.sequence_packing.algorithm``).

:func:`pack_bins` groups sequence lengths into bins of at most ``capacity`` tokens and returns, for each bin, the
indices of its sequences. Every algorithm yields the very bins NeMo-RL's packer of the same name yields, in the same
order and with the same order inside a bin (``tests/megatron/test_bins.py`` checks this against NeMo-RL's code):

``concatenative``
    Sequences in their given order; a bin is closed when the next one does not fit.
``first_fit_decreasing``
    Longest first (equal lengths: the *higher* index first), each into the first open bin with room.
``first_fit_shuffle``
    First fit in a random order. NeMo-RL shuffles with Python's global :mod:`random` state; so does ``seed=None``,
    while an integer ``seed`` draws the same permutation ``random.seed(seed)`` would, from a private generator.
``modified_first_fit_decreasing``
    Johnson & Garey's MFFD with NeMo-RL's phases: lengths are large (> C/2), medium (> C/3), small (> C/6) or tiny.
    Each large one opens a bin; each such bin, in turn, takes the longest medium that fits; the bins left without
    a medium, last first, take the shortest small plus the longest small that fits beside it; each bin then takes
    the longest leftovers that fit. What is still left goes, longest first, into the emptiest of a new set of bins
    (a fresh bin when it does not fit there); those bins come last, ordered by load (equal loads: least recently
    filled first). Lengths must be positive here.

With ``min_bin_count`` / ``bin_count_multiple`` (NeMo-RL passes the data-parallel size for both), extra bins are made
afterwards as NeMo-RL makes them: the bin holding the most sequences (equal counts: the later bin) gives its last
sequence to a new bin at the end, again and again until it holds one, then the next such bin does.
"""

from __future__ import annotations

import heapq
import operator
import random
from collections.abc import Callable, Sequence

from megatron_fp8.errors import ConfigError

_ALGORITHM_KEY = "policy.sequence_packing.algorithm"
_BUDGET_KEYS = "policy.sequence_packing.train_mb_tokens / logprob_mb_tokens"
_MFFD = "modified_first_fit_decreasing"

Bins = list[list[int]]


def _concatenative(sizes: list[int], capacity: int, seed: int | None) -> Bins:
    bins: Bins = []
    load = 0
    for i, size in enumerate(sizes):
        if bins and load + size <= capacity:
            bins[-1].append(i)
            load += size
        else:
            bins.append([i])
            load = size
    return bins


def _first_fit(order: Sequence[int], sizes: list[int], capacity: int) -> Bins:
    """Each index of ``order`` in turn goes into the first bin (oldest first) with room, else into a new bin."""
    bins: Bins = []
    room: list[int] = []
    for i in order:
        size = sizes[i]
        target = next((b for b, free in enumerate(room) if size <= free), len(bins))
        if target == len(bins):
            bins.append([])
            room.append(capacity)
        bins[target].append(i)
        room[target] -= size
    return bins


def _first_fit_decreasing(sizes: list[int], capacity: int, seed: int | None) -> Bins:
    order = sorted(range(len(sizes)), key=lambda i: (sizes[i], i), reverse=True)
    return _first_fit(order, sizes, capacity)


def _first_fit_shuffle(sizes: list[int], capacity: int, seed: int | None) -> Bins:
    order = list(range(len(sizes)))  # a shuffle's permutation depends only on the length of the list
    (random if seed is None else random.Random(seed)).shuffle(order)
    return _first_fit(order, sizes, capacity)


def _modified_first_fit_decreasing(sizes: list[int], capacity: int, seed: int | None) -> Bins:
    def longest_first(indices: list[int]) -> list[int]:
        return sorted(indices, key=lambda i: (-sizes[i], i))

    # Integer forms of size > C/2, > C/3, > C/6 (the same comparisons for integer lengths).
    large = longest_first([i for i, n in enumerate(sizes) if 2 * n > capacity])
    medium = longest_first([i for i, n in enumerate(sizes) if 3 * n > capacity >= 2 * n])
    small = sorted((i for i, n in enumerate(sizes) if 6 * n > capacity >= 3 * n), key=lambda i: (sizes[i], i))
    tiny = [i for i, n in enumerate(sizes) if capacity >= 6 * n]  # its order is irrelevant: re-sorted below

    bins: Bins = [[i] for i in large]
    loads = [sizes[i] for i in large]

    def take(b: int, pool: list[int], pos: int) -> None:
        i = pool.pop(pos)
        bins[b].append(i)
        loads[b] += sizes[i]

    with_medium = [False] * len(bins)
    for b in range(len(bins)):
        pos = next((p for p, i in enumerate(medium) if sizes[i] <= capacity - loads[b]), None)
        if pos is not None:
            take(b, medium, pos)
            with_medium[b] = True

    for b in reversed(range(len(bins))):
        free = capacity - loads[b]
        if with_medium[b] or len(small) < 2 or sizes[small[0]] + sizes[small[1]] > free:
            continue
        take(b, small, 0)
        free = capacity - loads[b]
        pos = max(p for p, i in enumerate(small) if sizes[i] <= free)  # the longest that fits; small[0] does
        take(b, small, pos)

    rest = longest_first(medium + small + tiny)
    for b in range(len(bins)):
        while rest and sizes[rest[-1]] <= capacity - loads[b]:
            take(b, rest, next(p for p, i in enumerate(rest) if sizes[i] <= capacity - loads[b]))

    # The leftovers, longest first, into the least-loaded bin (ties: the earliest stamped); it starts empty.
    heap: list[tuple[int, int, list[int]]] = [(0, 0, [])]
    for stamp, i in enumerate(rest, start=1):
        load, _, members = heapq.heappop(heap) if sizes[i] <= capacity - heap[0][0] else (0, 0, [])
        members.append(i)
        heapq.heappush(heap, (load + sizes[i], stamp, members))
    bins.extend(members for _, _, members in sorted(heap) if members)
    return bins


_PACKERS: dict[str, Callable[[list[int], int, int | None], Bins]] = {
    "concatenative": _concatenative,
    "first_fit_decreasing": _first_fit_decreasing,
    "first_fit_shuffle": _first_fit_shuffle,
    _MFFD: _modified_first_fit_decreasing,
}

PACKING_ALGORITHMS: tuple[str, ...] = tuple(_PACKERS)
"""The values of ``policy.sequence_packing.algorithm``, as NeMo-RL names them."""


def _add_bins(bins: Bins, min_bin_count: int | None, bin_count_multiple: int | None) -> Bins:
    """Split single sequences off the fullest bins until the bin count meets both constraints."""
    target = max(len(bins), min_bin_count or 0)
    if bin_count_multiple:
        target = -(-target // bin_count_multiple) * bin_count_multiple
    if target == len(bins):
        return bins
    total = sum(len(b) for b in bins)
    if total < target:
        raise ConfigError(
            f"sequence packing needs {target} micro-batches (min_bin_count={min_bin_count}, "
            f"bin_count_multiple={bin_count_multiple}) but has only {total} sequences; each micro-batch needs one"
        )
    bins = [list(b) for b in bins]
    donors = sorted(range(len(bins)), key=lambda b: (len(bins[b]), b), reverse=True)
    d = 0
    for _ in range(target - len(bins)):
        while len(bins[donors[d]]) == 1:
            d += 1
        bins.append([bins[donors[d]].pop()])
    return bins


def pack_bins(
    lengths: Sequence[int],
    *,
    capacity: int,
    algorithm: str = _MFFD,
    seed: int | None = None,
    what: str = "the token budget",
    min_bin_count: int | None = None,
    bin_count_multiple: int | None = None,
) -> list[list[int]]:
    """Pack sequences into bins of at most ``capacity`` tokens, exactly as NeMo-RL's packer of that name.

    Args:
        lengths: The token count of each sequence (non-negative integers; positive for MFFD).
        capacity: The most tokens one bin may hold.
        algorithm: One of :data:`PACKING_ALGORITHMS` (case-insensitive, as in NeMo-RL).
        seed: ``first_fit_shuffle`` only: an integer gives the order ``random.seed(seed)`` would; ``None`` shuffles
            with the global :mod:`random` state, as NeMo-RL does. Ignored by the other algorithms.
        what: The name of ``capacity`` in error messages (e.g. ``"policy.sequence_packing.train_mb_tokens"``).
        min_bin_count: At least this many bins, if given.
        bin_count_multiple: A multiple of this many bins, if given.

    Returns:
        The bins, each a list of indices into ``lengths``; every index appears exactly once. Empty input: ``[]``.

    Raises:
        ConfigError: An unknown algorithm, ``capacity < 1``, a sequence longer than ``capacity``, bad bin-count
            constraints, or fewer sequences than the bins those constraints require.
        ValueError: A negative length, or a zero length with ``modified_first_fit_decreasing``.
    """
    name = algorithm.lower() if isinstance(algorithm, str) else algorithm
    if name not in _PACKERS:
        raise ConfigError(
            f"{_ALGORITHM_KEY}: unknown sequence packing algorithm {algorithm!r}; "
            f"valid: {', '.join(PACKING_ALGORITHMS)}"
        )
    if capacity < 1:
        raise ConfigError(f"sequence packing: {what} must be at least 1 token per micro-batch, got {capacity}")
    if min_bin_count is not None and min_bin_count < 0:
        raise ConfigError(f"sequence packing: min_bin_count must be >= 0, got {min_bin_count}")
    if bin_count_multiple is not None and bin_count_multiple < 1:
        raise ConfigError(f"sequence packing: bin_count_multiple must be >= 1, got {bin_count_multiple}")

    sizes = [operator.index(n) for n in lengths]
    smallest = 1 if name == _MFFD else 0
    for i, size in enumerate(sizes):
        if size < smallest:
            raise ValueError(f"sequence packing ({name}): sequence {i} has length {size}, below {smallest}")
        if size > capacity:
            fix = f"raise {what}" if what.startswith("policy.") else f"raise {what} ({_BUDGET_KEYS})"
            raise ConfigError(
                f"sequence packing: sequence {i} is {size} tokens long, more than {what} allows in one micro-batch "
                f"({capacity} tokens); {fix} to at least {size}"
            )
    return _add_bins(_PACKERS[name](sizes, capacity, seed), min_bin_count, bin_count_multiple)
