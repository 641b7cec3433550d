"""One GPU per rank: select ``cuda:LOCAL_RANK`` (or the one GPU Slurm bound to the task) and check it is nobody else's.

Two launch layouts give each rank its own GPU (``slurm/common.sh``, ``GPU_BIND``):

* ``srun --gpus-per-task=1`` (``GPU_BIND=task``, the default): each task sees exactly one device, index 0;
* every task sees all the node's GPUs (``GPU_BIND=none``): the rank takes index ``LOCAL_RANK``.

:func:`assign_device` turns (local rank, the devices the task sees) into a :class:`DeviceAssignment`: a pure
function, so the logic is tested without a GPU. :func:`check_distinct` then compares the assignments gathered
from every rank: two ranks on one host holding the same device identity (the GPU's UUID when CUDA is usable,
else the ``CUDA_VISIBLE_DEVICES`` entry, which is what a launch without GPUs, or a test, can fake) is an error
that names both ranks, the host and the device. :func:`bind_device` does all of it for the running process,
including ``torch.cuda.set_device``.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from megatron_fp8.errors import ConfigError
from megatron_fp8.launch_env import env_int

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceAssignment:
    """The GPU one rank uses.

    Attributes:
        rank: global rank.
        host: host name (ranks are compared per host).
        local_rank: rank on its host (``LOCAL_RANK``).
        index: CUDA device index within what the task sees (``cuda:index``); ``None`` for a CPU rank.
        device_id: identity of the physical device: GPU UUID, else the ``CUDA_VISIBLE_DEVICES`` entry; ``None``
            for a CPU rank.
        visible: the devices the task sees (UUIDs or ``CUDA_VISIBLE_DEVICES`` entries), in index order.
    """

    rank: int
    host: str
    local_rank: int
    index: int | None
    device_id: str | None
    visible: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict."""
        out = asdict(self)
        out["visible"] = list(self.visible)
        return out


def visible_from_env(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The ``CUDA_VISIBLE_DEVICES`` entries, ``None`` when unset (every GPU visible), ``()`` when empty."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def assign_device(*, rank: int, local_rank: int, host: str, visible: Sequence[str]) -> DeviceAssignment:
    """Choose this rank's device from what it sees (pure).

    Args:
        rank: global rank.
        local_rank: rank on this host.
        host: host name.
        visible: identities of the devices this task sees, in CUDA index order (empty: a CPU rank).

    Returns:
        Index 0 when the task sees one device (Slurm bound one GPU to it), else index ``local_rank``.

    Raises:
        ConfigError: the task sees several devices but fewer than ``local_rank + 1``.
    """
    visible = tuple(visible)
    if not visible:
        return DeviceAssignment(rank, host, local_rank, None, None, ())
    if len(visible) == 1:
        index = 0
    elif local_rank < len(visible):
        index = local_rank
    else:
        raise ConfigError(
            f"rank {rank} (LOCAL_RANK={local_rank}) on {host} sees {len(visible)} GPU(s) ({', '.join(visible)}): "
            "fewer than its local rank + 1. Start at most one task per GPU (--ntasks-per-node <= "
            "--gpus-per-node) and let slurm/common.sh bind them (GPU_BIND=task: srun --gpus-per-task=1)"
        )
    return DeviceAssignment(rank, host, local_rank, index, visible[index], visible)


def check_distinct(assignments: Sequence[DeviceAssignment]) -> None:
    """Fail when two ranks on one host use the same device.

    Raises:
        ConfigError: names the host, the device and both ranks, and the remedy.
    """
    owner: dict[tuple[str, str], DeviceAssignment] = {}
    for a in sorted(assignments, key=lambda a: a.rank):
        if a.device_id is None:
            continue
        first = owner.setdefault((a.host, a.device_id), a)
        if first is not a:
            raise ConfigError(
                f"rank {a.rank} (LOCAL_RANK={a.local_rank}) on {a.host} would use GPU {a.device_id} (cuda:{a.index}), "
                f"already used by rank {first.rank} (LOCAL_RANK={first.local_rank}): every rank needs its own GPU. "
                f"Rank {a.rank} sees {', '.join(a.visible)}. Launch through slurm/grpo.sbatch (srun "
                "--gpus-per-task=1, or GPU_BIND=none with LOCAL_RANK set per task), with no more tasks per node "
                "than GPUs"
            )


def _torch_visible() -> tuple[str, ...] | None:
    """UUIDs of the CUDA devices torch sees, ``None`` when CUDA is not usable here."""
    import torch

    if not torch.cuda.is_available():
        return None
    ids = []
    for i in range(torch.cuda.device_count()):
        uuid = getattr(torch.cuda.get_device_properties(i), "uuid", None)
        ids.append(f"GPU-{uuid}" if uuid is not None else f"cuda:{i}")
    return tuple(ids)


def local_assignment(env: Mapping[str, str] | None = None) -> DeviceAssignment:
    """This process's assignment from ``RANK``/``LOCAL_RANK`` and the devices it sees (no side effects).

    With CUDA usable, the devices are torch's (identified by UUID); without, the ``CUDA_VISIBLE_DEVICES`` entries
    (a CPU run has none).
    """
    env = os.environ if env is None else env
    rank = env_int("RANK", default=0, env=env)  # the device binding needs no WORLD_SIZE
    local_rank = env_int("LOCAL_RANK", default=0, env=env)
    visible = _torch_visible()
    if visible is None:
        visible = visible_from_env(env) or ()
    return assign_device(rank=rank, local_rank=local_rank, host=socket.gethostname(), visible=visible)


def bind_device(
    gather: Callable[[DeviceAssignment], Sequence[DeviceAssignment]] | None = None,
    env: Mapping[str, str] | None = None,
) -> DeviceAssignment:
    """Select this rank's GPU (``torch.cuda.set_device``) and check, over all ranks, that it is its own.

    Args:
        gather: collects every rank's assignment (e.g. ``torch.distributed.all_gather_object``); ``None`` for a
            single process.
        env: environment to read (default ``os.environ``).

    Returns:
        This rank's assignment.

    Raises:
        ConfigError: see :func:`assign_device` and :func:`check_distinct`.
    """
    mine = local_assignment(env)
    everyone = list(gather(mine)) if gather is not None else [mine]
    check_distinct(everyone)
    if mine.index is not None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(mine.index)
    if mine.index is None:
        logger.debug("rank %d on %s: CPU (no CUDA device)", mine.rank, mine.host)
    else:
        logger.info("rank %d on %s: cuda:%s (%s)", mine.rank, mine.host, mine.index, mine.device_id)
    return mine


def gather_with_process_group(mine: DeviceAssignment) -> list[DeviceAssignment]:
    """All ranks' assignments over the default ``torch.distributed`` group (collective)."""
    import torch.distributed as dist

    out: list[DeviceAssignment | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return [a for a in out if a is not None]
