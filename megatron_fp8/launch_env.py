"""The launcher's environment (torchrun, srun, ``slurm/grpo.sbatch``): its integers read and checked in one place.

A value a launcher did not write (``WORLD_SIZE=abc``, ``RANK=5`` of 2 processes, a negative ``LOCAL_RANK``) is a
:class:`~megatron_fp8.errors.ConfigError` of one line naming the variable, its value and the fix, never a
``ValueError`` deep inside a run. :func:`find_free_port` picks a rendezvous port no outgoing connection takes. No
torch: a shared leaf (``docs/architecture.md``).
"""

from __future__ import annotations

import os
import random
import socket
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


def launcher_hosts_store(env: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher itself serves the store at ``MASTER_ADDR:MASTER_PORT`` (torchrun's agent does).

    torchrun tells its workers so with ``TORCHELASTIC_USE_AGENT_STORE=True`` (torch
    ``distributed/elastic/agent/server/local_elastic_agent.py``); a rank that then binds the port as well fails to,
    and torch logs an ``[E ...] The server socket ... has failed to bind`` line before going on as a client.
    """
    env = os.environ if env is None else env
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_RENDEZVOUS_PORTS = (20000, 32768)
"""Where :func:`find_free_port` looks: above ``slurm/common.sh``'s ``10000 + job id % 10000`` and below Linux's
default ephemeral range (32768-60999), from which the kernel hands every outgoing connection its local port."""


def _ephemeral_low() -> int:
    """The first port the kernel hands out on its own (Linux: ``ip_local_port_range``; elsewhere 32768)."""
    try:
        with open(_EPHEMERAL_RANGE, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _RENDEZVOUS_PORTS[1]


def find_free_port(host: str = "127.0.0.1", *, tries: int = 64) -> int:
    """A TCP port on ``host`` that is free now and that the kernel does not hand out on its own.

    A port from ``bind(0)`` is an ephemeral one: once the probe closes it, any process's next outgoing
    connection may take it as its local port before the rendezvous binds it (``EADDRINUSE`` on a busy
    machine). This one is drawn at random from :data:`_RENDEZVOUS_PORTS`, below the ephemeral range, and
    checked bindable; only another explicit pick can race it.

    Args:
        host: the address the port will be bound on.
        tries: random candidates to probe before falling back to ``bind(0)``.

    Returns:
        Port number.
    """
    low, high = _RENDEZVOUS_PORTS[0], min(_RENDEZVOUS_PORTS[1], _ephemeral_low())
    rng = random.SystemRandom()
    for _ in range(tries if high - low >= 1024 else 0):
        port = rng.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def find_free_ports(count: int, host: str = "127.0.0.1") -> tuple[int, ...]:
    """``count`` distinct ports from :func:`find_free_port` (two stores, or a daemon and its controller)."""
    ports: list[int] = []
    while len(ports) < count:
        if (port := find_free_port(host)) not in ports:
            ports.append(port)
    return tuple(ports)
