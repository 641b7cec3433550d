"""The launcher's environment (torchrun, srun, ``slurm/grpo.sbatch``): its integers read and checked in one place.

A value a launcher did not write (``WORLD_SIZE=abc``, ``RANK=5`` of 2 processes, a negative ``LOCAL_RANK``) is a
:class:`~megatron_fp8.errors.ConfigError` of one line naming the variable, its value and the fix, never a
``ValueError`` deep inside a run. No torch: a shared leaf (``docs/architecture.md``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_fp8.errors import ConfigError

_SET_BY = "torchrun and srun (through slurm/grpo.sbatch) set it"


def env_int(name: str, *, default: int, minimum: int = 0, env: Mapping[str, str] | None = None) -> int:
    """The integer in environment variable ``name`` (``default`` when unset or empty).

    Raises:
        ConfigError: not a whole number, or below ``minimum``; the message names the variable and its value.
    """
    env = os.environ if env is None else env
    raw = env.get(name, "").strip()
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={raw!r} is not a whole number; {_SET_BY}: unset it to run one process"
        ) from None
    if value < minimum:
        raise ConfigError(f"environment variable {name}={value} must be >= {minimum}; {_SET_BY}: unset it or fix it")
    return value


@dataclass(frozen=True)
class LaunchPlace:
    """Where the launcher put this process.

    Attributes:
        rank: ``RANK`` (0 when unset), in ``[0, world_size)``.
        world_size: ``WORLD_SIZE`` (1 when unset), >= 1.
        local_rank: ``LOCAL_RANK`` (0 when unset), >= 0.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def launch_place(env: Mapping[str, str] | None = None) -> LaunchPlace:
    """``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, checked together.

    Raises:
        ConfigError: a value is not a whole number, ``WORLD_SIZE < 1``, or ``RANK`` is not below ``WORLD_SIZE``.
    """
    world = env_int("WORLD_SIZE", default=1, minimum=1, env=env)
    rank = env_int("RANK", default=0, env=env)
    local_rank = env_int("LOCAL_RANK", default=0, env=env)
    if rank >= world:
        raise ConfigError(
            f"environment variables RANK={rank} and WORLD_SIZE={world}: a rank must be below the process count; "
            f"{_SET_BY}: unset both to run one process"
        )
    return LaunchPlace(rank=rank, world_size=world, local_rank=local_rank)
