"""Validation rows held out of the training file: NeMo-RL's ``split_validation_size``, drawn as NeMo-RL draws them.

NeMo-RL's ``RawDataset.split_train_validation`` calls Hugging Face ``Dataset.train_test_split(test_size, seed=seed)``:
a fraction in ``(0, 1)`` holds out ``ceil(size * n)`` rows, a size ``>= 1`` that many rows (``int(size)``); the
draw is ``numpy.random.default_rng(seed).permutation(n)``, the first rows of the permutation are the validation rows
and the rest, in permutation order, the training rows. :func:`hold_out` computes the same indices without the
``datasets`` library, so the same file and seed hold out the same rows as NeMo-RL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_fp8.errors import ConfigError


@dataclass(frozen=True)
class HeldOut:
    """A training file's rows split into training and held-out validation rows.

    Attributes:
        train: the rows trained on (permutation order when rows were held out, else file order).
        validation: the held-out rows (empty when nothing is held out).
        size: the ``split_validation_size`` asked for.
        seed: the seed of the draw.
    """

    train: list[dict[str, Any]]
    validation: list[dict[str, Any]]
    size: float
    seed: int


def held_out_count(size: float, n: int, *, key: str) -> int:
    """How many of ``n`` rows ``split_validation_size = size`` holds out (Hugging Face ``train_test_split``'s rule).

    Args:
        size: ``0`` = none, a fraction in ``(0, 1)`` (rounded up), or a row count ``>= 1`` (a whole number).
        n: rows in the file (after ``max_samples``).
        key: the config key, for messages.

    Raises:
        ConfigError: a negative size, a count that is not whole, or a hold-out that leaves no training row.
    """
    if size < 0 or not math.isfinite(size):
        raise ConfigError(f"{key}={size!r}: expected 0 (none), a fraction in (0, 1) or a row count >= 1")
    if size == 0:
        return 0
    if size >= 1 and size != int(size):
        raise ConfigError(f"{key}={size!r}: a size >= 1 is a row count and must be whole (a fraction is in (0, 1))")
    count = math.ceil(size * n) if size < 1 else int(size)
    if count >= n:
        raise ConfigError(
            f"{key}={size!r} holds out {count} of the file's {n} rows, leaving none to train on; lower it "
            "(or give a larger file)"
        )
    return count


def hold_out(rows: list[dict[str, Any]], *, size: float, seed: int, key: str) -> HeldOut:
    """Split ``rows`` into training and validation rows as NeMo-RL does (module docstring).

    Args:
        rows: the training file's rows, in file order.
        size: ``split_validation_size``.
        seed: the draw's seed.
        key: the config key of ``size``, for messages.

    Raises:
        ConfigError: as :func:`held_out_count`.
    """
    count = held_out_count(size, len(rows), key=key)
    if count == 0:
        return HeldOut(train=list(rows), validation=[], size=size, seed=seed)
    order = np.random.default_rng(seed).permutation(len(rows))
    return HeldOut(
        train=[rows[i] for i in order[count:]], validation=[rows[i] for i in order[:count]], size=size, seed=seed
    )
