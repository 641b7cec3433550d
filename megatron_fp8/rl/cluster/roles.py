"""Where each GRPO process runs: colocated ranks, or separate trainer and rollout ranks, and their process groups.

Placement (:func:`placement_from`): colocated by default (every rank trains and rolls out on its own engine).
Separate ranks come from the config, ``policy.generation.colocated.enabled: false`` with
``resources.{gpus_per_node, num_nodes}`` (rollout ranks = their product), or from the launcher:
``slurm/grpo.sbatch`` with ``ROLLOUT_TASKS=N`` sets ``MFP8_ROLE=trainer|rollout`` per task (the last ``N`` tasks
roll out) and leaves ``ROLLOUT_TASKS`` in every task's environment. Given both, they must agree.

Process groups (:func:`join_groups`), because Megatron-Core builds its parallel groups over the *whole*
default world (``torch.distributed.get_world_size()``), rollout ranks must not be in the trainers' default group:

* one ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` for all ``WORLD_SIZE`` processes (global rank 0 hosts it; under
  torchrun its agent already does);
* trainers: the default group (gloo) over the trainer ranks only (``PrefixStore("mfp8/trainers")``), which
  :func:`megatron_fp8.megatron.megatron_parallel` and the data-parallel helpers of
  :mod:`megatron_fp8.rl.cluster.distributed` then use unchanged;
* rollout ranks: their own default group (``PrefixStore("mfp8/rollout")``);
* the *link*: trainer rank 0 and every rollout rank, ranked ``0`` (trainer rank 0) and ``1 + rollout_index``;
  a gloo group for the control messages (:func:`send_control`, :func:`recv_control`) and a group of the refit
  transport's backend (``refit.transport``: ``auto`` = NCCL with CUDA, else gloo) carrying one
  :class:`~megatron_fp8.refit.transport.torch_dist.TorchDistTransport` (sender: link rank 0) for the whole run.

On leaving :func:`join_groups`, trainer rank 0 tells every rollout rank to stop (:class:`Shutdown`, then the
transport's orderly close), so the rollout ranks' serve loop (:func:`megatron_fp8.rl.cluster.remote.serve_rollout`)
returns.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import itertools
import logging
import os
import pickle
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from megatron_fp8.config.schema import RunConfig
from megatron_fp8.errors import ConfigError, RefitError, TransportClosedError, TransportTimeoutError
from megatron_fp8.launch_env import env_int, launch_place, launcher_hosts_store
from megatron_fp8.refit.transport.torch_dist import TorchDistTransport
from megatron_fp8.rl.cluster.devices import DeviceAssignment, bind_device

if TYPE_CHECKING:
    # not imported at run time: torch builds without distributed support lack these names
    from torch.distributed import ProcessGroup, Store, Work

logger = logging.getLogger(__name__)

Role = Literal["colocated", "trainer", "rollout"]
ROLES: tuple[Role, ...] = ("colocated", "trainer", "rollout")
"""``MFP8_ROLE`` values (``slurm/common.sh`` sets one per task)."""

TORCH_CHECKED = "2.13"
"""The torch version whose private process-group API :func:`identity_group` was checked against."""

_CONTROL_TAG = 0x4354  # point-to-point tag of control messages on the link ("CT")
_CONTROL_MAGIC = 0x4D465038  # "MFP8"
_CLOSE_WAIT_S = 30.0  # how long shutdown waits for a rollout rank's answer, seconds


@dataclass(frozen=True)
class Placement:
    """This process's place in a GRPO run.

    Attributes:
        role: ``"colocated"`` (trains and rolls out on its own engine), ``"trainer"`` or ``"rollout"``.
        rank: global rank (``RANK``), ``0 <= rank < world_size``.
        world_size: every process of the run (``WORLD_SIZE``).
        trainer_ranks: global ranks that train (all of them when colocated), ascending, starting at 0.
        rollout_ranks: global ranks that only generate (the last ones; empty when colocated).
    """

    role: Role
    rank: int
    world_size: int
    trainer_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if tuple(self.trainer_ranks) + tuple(self.rollout_ranks) != tuple(range(self.world_size)):
            raise ConfigError(
                f"placement of rank {self.rank}: trainer ranks {self.trainer_ranks} then rollout ranks "
                f"{self.rollout_ranks} must be 0..{self.world_size - 1} in order (the rollout ranks are the last ones)"
            )
        mine = "rollout" if self.rank in self.rollout_ranks else "trainer"
        if self.role not in ROLES or (self.role != "colocated" and self.role != mine) or not self.trainer_ranks:
            raise ConfigError(
                f"placement of rank {self.rank}: role {self.role!r} with trainer ranks {self.trainer_ranks} and "
                f"rollout ranks {self.rollout_ranks} is inconsistent (at least one trainer; a rank's role is where "
                "it sits)"
            )
        if (self.role == "colocated") != (not self.rollout_ranks):
            raise ConfigError(f"placement of rank {self.rank}: colocated means no rollout ranks, and only then")

    @property
    def separate(self) -> bool:
        """Trainer and rollout ranks are separate processes."""
        return self.role != "colocated"

    @property
    def trainer_rank(self) -> int | None:
        """This rank among the trainers (its rank in the trainers' default group); ``None`` on a rollout rank."""
        return self.trainer_ranks.index(self.rank) if self.rank in self.trainer_ranks else None

    @property
    def rollout_index(self) -> int | None:
        """This rank among the rollout ranks; ``None`` on a trainer."""
        return self.rollout_ranks.index(self.rank) if self.rank in self.rollout_ranks else None

    @property
    def link_size(self) -> int:
        """Members of the link: trainer rank 0 and every rollout rank."""
        return 1 + len(self.rollout_ranks)

    @property
    def link_rank(self) -> int | None:
        """This rank on the link: 0 for trainer rank 0, ``1 + rollout_index`` for a rollout rank, else ``None``."""
        if self.role == "rollout":
            return 1 + self.rollout_ranks.index(self.rank)
        return 0 if self.separate and self.rank == self.trainer_ranks[0] else None

    def describe(self) -> str:
        """One line for logs, e.g. ``rank 2 of 3: rollout 0 of 1 (trainers 0-1)``."""
        if not self.separate:
            return f"rank {self.rank} of {self.world_size}: colocated (trains and rolls out)"
        where = (
            f"trainer {self.trainer_rank} of {len(self.trainer_ranks)}"
            if self.role == "trainer"
            else f"rollout {self.rollout_index} of {len(self.rollout_ranks)}"
        )
        return (
            f"rank {self.rank} of {self.world_size}: {where} (trainers {self.trainer_ranks[0]}-"
            f"{self.trainer_ranks[-1]}, rollout {self.rollout_ranks[0]}-{self.rollout_ranks[-1]})"
        )


def _configured_rollout_ranks(config: RunConfig) -> int | None:
    """Rollout ranks the config asks for (``None``: colocated, or resources left unset)."""
    col = config.policy.generation.colocated
    if col.enabled:
        return None
    res = col.resources
    if res.gpus_per_node is None:
        if res.num_nodes is not None:
            raise ConfigError(
                "policy.generation.colocated.resources.num_nodes is set but gpus_per_node is not: the rollout ranks "
                "are gpus_per_node x num_nodes; set gpus_per_node"
            )
        return None
    nodes = 1 if res.num_nodes is None else res.num_nodes
    if res.gpus_per_node < 1 or nodes < 1:
        raise ConfigError(
            f"policy.generation.colocated.resources: gpus_per_node={res.gpus_per_node}, num_nodes={res.num_nodes}; "
            "both must be >= 1 (rollout ranks = their product)"
        )
    return res.gpus_per_node * nodes


def placement_from(config: RunConfig, env: Mapping[str, str] = os.environ) -> Placement:
    """This process's :class:`Placement`, from the config and the launcher's environment.

    Args:
        config: the run configuration (``policy.generation.colocated``, ``grpo.num_prompts_per_step``).
        env: the environment (``RANK``, ``WORLD_SIZE``, ``MFP8_ROLE``, ``ROLLOUT_TASKS``).

    Returns:
        Colocated when neither the config (``colocated.enabled: false``) nor ``MFP8_ROLE`` (``trainer`` /
        ``rollout``) asks for separate ranks; else the last ``n`` ranks roll out, ``n`` from
        ``resources.gpus_per_node x num_nodes`` or ``ROLLOUT_TASKS``.

    Raises:
        ConfigError: the two sources disagree (count, or this rank's role), the count is unknown, no trainer
            would be left, a role other than :data:`ROLES`, or ``grpo.num_prompts_per_step`` not divisible by the
            trainer ranks; each message names the rank and the fix.
    """
    place = launch_place(env)  # RANK in [0, WORLD_SIZE), WORLD_SIZE >= 1, or a one-line error naming them
    world, rank = place.world_size, place.rank
    env_role = env.get("MFP8_ROLE") or None
    if env_role is not None and env_role not in ROLES:
        raise ConfigError(f"rank {rank}: MFP8_ROLE={env_role!r} is not one of {', '.join(ROLES)} (slurm/common.sh)")
    from_config = _configured_rollout_ranks(config)
    config_split = not config.policy.generation.colocated.enabled
    env_split = env_role in ("trainer", "rollout")
    if not config_split and not env_split:
        return Placement("colocated", rank, world, tuple(range(world)), ())
    if config_split and env_role == "colocated":
        raise ConfigError(
            f"rank {rank}: policy.generation.colocated.enabled is false, but the launcher started colocated tasks "
            "(MFP8_ROLE=colocated: slurm/grpo.sbatch without ROLLOUT_TASKS). Set ROLLOUT_TASKS to the number of "
            "rollout ranks, or set policy.generation.colocated.enabled=true"
        )
    from_env = (env_int("ROLLOUT_TASKS", default=0, env=env) or None) if env_split else None
    if from_config is not None and from_env is not None and from_config != from_env:
        raise ConfigError(
            f"rank {rank}: policy.generation.colocated.resources ask for {from_config} rollout rank(s) "
            f"(gpus_per_node x num_nodes), but ROLLOUT_TASKS={from_env}; make them agree"
        )
    n_rollout = from_config if from_config is not None else from_env
    if n_rollout is None:
        raise ConfigError(
            f"rank {rank}: separate rollout ranks asked for ("
            + ("policy.generation.colocated.enabled=false" if config_split else f"MFP8_ROLE={env_role}")
            + ") but their number is unknown: set policy.generation.colocated.resources.gpus_per_node (and "
            "num_nodes), or launch through slurm/grpo.sbatch with ROLLOUT_TASKS=N"
        )
    if not 0 < n_rollout < world:
        raise ConfigError(
            f"rank {rank}: {n_rollout} rollout rank(s) in a run of WORLD_SIZE={world} process(es): at least one "
            f"trainer and one rollout rank are needed; launch more than {n_rollout} processes or fewer rollout ranks"
        )
    n_trainers = world - n_rollout
    role: Role = "rollout" if rank >= n_trainers else "trainer"
    if env_split and env_role != role:
        raise ConfigError(
            f"rank {rank}: MFP8_ROLE={env_role} but with {n_rollout} rollout rank(s) of {world} this rank is a "
            f"{role} (the last {n_rollout} ranks roll out); make ROLLOUT_TASKS and the config agree"
        )
    prompts = config.grpo.num_prompts_per_step
    if prompts % n_trainers:
        raise ConfigError(
            f"grpo.num_prompts_per_step={prompts} is not divisible by the {n_trainers} trainer rank(s) "
            f"(WORLD_SIZE={world} minus {n_rollout} rollout rank(s)); each trainer rank rolls out whole prompt groups"
        )
    return Placement(role, rank, world, tuple(range(n_trainers)), tuple(range(n_trainers, world)))


def refit_backend(transport: str) -> str:
    """The process-group backend of the refit between separate ranks (``refit.transport``).

    Raises:
        ConfigError: a transport that cannot join separate processes through a process group.
    """
    if transport == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if transport in ("gloo", "nccl"):
        return transport
    raise ConfigError(
        f"refit.transport={transport!r} cannot reach separate rollout ranks (policy.generation.colocated.enabled="
        "false / ROLLOUT_TASKS); use auto, gloo or nccl"
    )


# ----------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class Groups:
    """The process groups of separate trainer and rollout ranks (see the module docstring).

    Attributes:
        placement: this process's placement.
        store: the run's ``TCPStore`` (kept alive while the groups are).
        trainers: the trainers' world (the default group) on a trainer rank, else ``None``.
        rollout: the rollout ranks' world (the default group) on a rollout rank, else ``None``.
        link: gloo group of trainer rank 0 and the rollout ranks (control messages); ``None`` off the link.
        refit: group of the same members with the refit backend; ``None`` off the link.
        transport: the refit transport over ``refit`` (sender: link rank 0), one for the whole run; ``None``
            off the link.
        refit_backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: deadline of every wait on the link and of each process group, seconds.
    """

    placement: Placement
    store: Store
    trainers: ProcessGroup | None
    rollout: ProcessGroup | None
    link: ProcessGroup | None
    refit: ProcessGroup | None
    transport: TorchDistTransport | None
    refit_backend: str
    timeout_s: float


def identity_group(
    store: Store, *, name: str, rank: int, size: int, backend: str, timeout: datetime.timedelta
) -> ProcessGroup:
    """A process group of ``size`` processes that need not share a default group, ranked ``0..size-1``.

    Its members meet through ``store`` (prefixed with ``name``); every member calls this with its own ``rank``.
    The group's "global" ranks are its own ranks (identity), so ``dist.broadcast(src=0, group=g)``,
    ``dist.isend(dst=r, group=g)`` and ``dist.get_process_group_ranks(g)`` speak link ranks. The group is
    registered under the tag ``name`` only (never the default tag), so nothing that looks groups up by ranks
    (functional collectives) can mistake it for one of Megatron's.

    Private torch API, checked with torch 2.13 (:data:`TORCH_CHECKED`): ``torch.distributed`` offers no public
    way to build a group of processes that are not all in one default world;
    ``distributed_c10d._new_process_group_helper`` builds one from a store, and ``_world.pg_group_ranks`` holds
    the rank map the functional API reads. ``tests/rl/cluster/test_remote.py::test_private_torch_api_guard`` fails when
    either changes.

    Raises:
        ConfigError: the private API is not what was checked (another torch version); the message says what to do.
    """
    from torch.distributed import distributed_c10d as c10d

    helper = getattr(c10d, "_new_process_group_helper", None)
    world = getattr(c10d, "_world", None)
    expected = {"group_size", "group_rank", "global_ranks_in_group", "backend", "store", "group_name", "timeout"}
    params = set(inspect.signature(helper).parameters) if callable(helper) else set()
    if not expected <= params or not isinstance(getattr(world, "pg_group_ranks", None), dict):
        raise ConfigError(
            f"torch {torch.__version__}: torch.distributed's private _new_process_group_helper / _world.pg_group_ranks "
            f"are not the ones megatron_fp8.rl.cluster.roles.identity_group was checked with (torch {TORCH_CHECKED}); "
            "separate trainer and rollout ranks cannot be set up. Run colocated (unset ROLLOUT_TASKS, "
            "policy.generation.colocated.enabled=true) or use torch " + TORCH_CHECKED
        )
    if not 0 <= rank < size or dist.get_rank() >= size:  # the helper checks the default rank against the identity
        raise ConfigError(
            f"identity_group {name!r}: rank {rank} (default-group rank {dist.get_rank()}) must be below its size {size}"
        )
    pg, _ = helper(
        group_size=size,
        group_rank=rank,
        global_ranks_in_group=list(range(size)),
        backend=dist.Backend(backend),
        store=dist.PrefixStore(f"{name}/", store),
        group_name=name,
        timeout=timeout,
        pg_tag=name,
    )
    world.pg_group_ranks[pg] = {r: r for r in range(size)}
    return pg


def _gather_over_store(store: Store, placement: Placement) -> Callable[[DeviceAssignment], list[DeviceAssignment]]:
    """Every process's device assignment, through the store (no group holds all processes)."""

    def gather(mine: DeviceAssignment) -> list[DeviceAssignment]:
        store.set(f"mfp8/devices/{placement.rank}", pickle.dumps(mine))
        return [pickle.loads(store.get(f"mfp8/devices/{r}")) for r in range(placement.world_size)]

    return gather


@contextlib.contextmanager
def join_groups(
    placement: Placement, *, timeout_s: float, transport: str = "auto", env: Mapping[str, str] = os.environ
) -> Iterator[Groups]:
    """Join the process groups of a separate placement for the whole run; leave them on exit.

    Every process selects its GPU first and checks, over all processes, that no two of a node share one
    (:func:`megatron_fp8.rl.cluster.devices.bind_device`). On exit trainer rank 0 stops the rollout ranks
    (:func:`shutdown_rollout_ranks`), then every group is destroyed.

    Args:
        placement: a separate placement (:func:`placement_from`).
        timeout_s: deadline of the rendezvous, of each process group and of every wait on the link, seconds
            (long enough for a rollout rank to wait through a training step).
        transport: ``refit.transport`` (:func:`refit_backend`).
        env: the environment (``MASTER_ADDR``, ``MASTER_PORT``).

    Yields:
        The :class:`Groups`.

    Raises:
        ConfigError: a colocated placement (use :func:`megatron_fp8.rl.cluster.distributed.data_parallel_from_env`),
            no rendezvous in the environment, an unusable transport, or two ranks of a node on one GPU.
    """
    if not placement.separate:
        raise ConfigError(
            f"rank {placement.rank}: join_groups is for separate trainer and rollout ranks; colocated ranks join "
            "with megatron_fp8.rl.cluster.distributed.data_parallel_from_env()"
        )
    backend = refit_backend(transport)
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
    if missing:
        raise ConfigError(
            f"rank {placement.rank}: WORLD_SIZE={placement.world_size} but {', '.join(missing)} not set: launch "
            "through slurm/grpo.sbatch (or torchrun), which set the rendezvous"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        env_int("MASTER_PORT", default=0, env=env),
        placement.world_size,
        is_master=placement.rank == 0 and not launcher_hosts_store(env),  # under torchrun its agent serves it
        timeout=timeout,
        wait_for_workers=False,
    )
    bind_device(_gather_over_store(store, placement))
    own = "trainers" if placement.role == "trainer" else "rollout"
    own_rank = placement.trainer_rank if placement.role == "trainer" else placement.rollout_index
    own_size = len(placement.trainer_ranks if placement.role == "trainer" else placement.rollout_ranks)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"mfp8/{own}", store), rank=own_rank, world_size=own_size, timeout=timeout
    )
    link = refit = None
    groups: Groups | None = None
    reason: str | None = None
    try:
        if placement.link_rank is not None:
            kwargs = {"rank": placement.link_rank, "size": placement.link_size, "timeout": timeout}
            link = identity_group(store, name="mfp8_link", backend="gloo", **kwargs)
            refit = identity_group(store, name="mfp8_refit", backend=backend, **kwargs)
        groups = Groups(
            placement=placement,
            store=store,
            trainers=dist.group.WORLD if placement.role == "trainer" else None,
            rollout=dist.group.WORLD if placement.role == "rollout" else None,
            link=link,
            refit=refit,
            transport=TorchDistTransport(src=0, group=refit, timeout=timeout_s) if refit is not None else None,
            refit_backend=backend,
            timeout_s=float(timeout_s),
        )
        logger.info("GRPO placement: %s; refit over %s", placement.describe(), backend)
        yield groups
    except BaseException as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if groups is not None and placement.link_rank == 0:
            shutdown_rollout_ranks(groups, reason=reason)
        for group in (refit, link):
            if group is not None:
                dist.destroy_process_group(group)
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- control messages on the link


_SEQ = itertools.count(1)


def next_seq() -> int:
    """A fresh request number (trainer rank 0 numbers its requests; answers echo it)."""
    return next(_SEQ)


@dataclass(frozen=True)
class Shutdown:
    """Trainer rank 0 -> rollout rank: stop serving (the rollout rank answers, then its serve loop returns).

    Attributes:
        seq: request number.
        reason: why, when the trainer stops on an error (``None``: the run is over).
    """

    seq: int
    reason: str | None = None


@dataclass(frozen=True)
class Reply:
    """Rollout rank -> trainer rank 0: the answer to request ``seq``.

    Attributes:
        seq: the request's number.
        value: the answer (plain data), ``None`` on error.
        error: ``(exception type name, message)`` when the request failed on the rollout rank.
    """

    seq: int
    value: object = None
    error: tuple[str, str] | None = None


def _require_link(groups: Groups) -> ProcessGroup:
    if groups.link is None:
        raise ConfigError(
            f"rank {groups.placement.rank} is not on the link (trainer rank 0 and the rollout ranks); only those "
            "exchange control messages"
        )
    return groups.link


def _peer(groups: Groups, link_rank: int) -> str:
    p = groups.placement
    if link_rank == 0:
        return f"trainer rank 0 (global rank {p.trainer_ranks[0]})"
    return f"rollout rank {link_rank - 1} (global rank {p.rollout_ranks[link_rank - 1]})"


def _wait(work: Work, groups: Groups, *, timeout: float, what: str) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=max(timeout, 1e-3)))
    except RuntimeError as exc:
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise TransportTimeoutError(
            f"{groups.placement.describe()}: {what} failed ({first}; deadline {timeout:.3g}s): the peer died or "
            "stalled (see its log)"
        ) from exc


def send_control(groups: Groups, message: object, *, to: int, timeout: float | None = None) -> None:
    """Send one pickled control message to link rank ``to`` (point-to-point on the gloo link).

    Raises:
        TransportTimeoutError: the peer did not take it within ``timeout`` (default ``groups.timeout_s``), seconds.
    """
    link = _require_link(groups)
    payload = pickle.dumps(message)
    head = torch.tensor([_CONTROL_MAGIC, len(payload)], dtype=torch.int64)
    body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    wait = groups.timeout_s if timeout is None else timeout
    what = f"sending {type(message).__name__} to {_peer(groups, to)}"
    for part in (head, body):
        _wait(dist.isend(part, dst=to, group=link, tag=_CONTROL_TAG), groups, timeout=wait, what=what)


def recv_control(groups: Groups, *, sender: int, timeout: float | None = None) -> object:
    """Receive one control message from link rank ``sender``.

    Raises:
        TransportTimeoutError: nothing came within ``timeout`` (default ``groups.timeout_s``) seconds, or the
            sender died; the message names it.
        RefitError: a malformed message (the two ends run different code).
    """
    link = _require_link(groups)
    wait = groups.timeout_s if timeout is None else timeout
    what = f"waiting for a control message from {_peer(groups, sender)}"
    head = torch.empty(2, dtype=torch.int64)
    _wait(dist.irecv(head, src=sender, group=link, tag=_CONTROL_TAG), groups, timeout=wait, what=what)
    magic, size = head.tolist()
    if magic != _CONTROL_MAGIC or size < 0:
        raise RefitError(
            f"malformed control message header {head.tolist()} from {_peer(groups, sender)}: both ends must run the "
            "same megatron-fp8"
        )
    body = torch.empty(size, dtype=torch.uint8)
    _wait(dist.irecv(body, src=sender, group=link, tag=_CONTROL_TAG), groups, timeout=wait, what=what)
    return pickle.loads(body.numpy().tobytes())


def recv_reply(groups: Groups, *, sender: int, seq: int, timeout: float | None = None) -> Reply:
    """The :class:`Reply` to request ``seq`` from link rank ``sender`` (answers to earlier requests are skipped).

    Raises:
        TransportTimeoutError: see :func:`recv_control`.
        RefitError: something other than a reply came.
    """
    while True:
        reply = recv_control(groups, sender=sender, timeout=timeout)
        if not isinstance(reply, Reply):
            raise RefitError(f"{_peer(groups, sender)} sent {type(reply).__name__}, expected a Reply to request {seq}")
        if reply.seq == seq:
            return reply
        logger.debug("skipping a late reply to request %d from %s", reply.seq, _peer(groups, sender))


def shutdown_rollout_ranks(groups: Groups, *, reason: str | None) -> None:
    """Trainer rank 0: stop every rollout rank (best effort, logged; never raises).

    Sends :class:`Shutdown` to each, closes the refit transport (the rollout ranks take its close), then waits
    up to 30 s for each answer.
    """
    seq = next_seq()
    reached = []
    for link_rank in range(1, groups.placement.link_size):
        try:
            send_control(groups, Shutdown(seq, reason), to=link_rank, timeout=_CLOSE_WAIT_S)
            reached.append(link_rank)
        except RefitError as exc:
            logger.warning("could not tell %s to stop: %s", _peer(groups, link_rank), exc)
    if groups.transport is not None:
        groups.transport.close()
    for link_rank in reached:
        try:
            recv_reply(groups, sender=link_rank, seq=seq, timeout=_CLOSE_WAIT_S)
        except RefitError as exc:
            logger.warning("%s did not confirm it stopped: %s", _peer(groups, link_rank), exc)


def take_transport_close(groups: Groups) -> None:
    """Rollout rank, on :class:`Shutdown`: take the refit transport's orderly close (logged when it never comes)."""
    if groups.transport is None:
        return
    try:
        groups.transport.recv(timeout=_CLOSE_WAIT_S)
    except TransportClosedError:
        return
    except RefitError as exc:
        logger.debug("rollout rank %s: no orderly transport close (%s)", groups.placement.rollout_index, exc)
        return
    logger.warning("rollout rank %s: a refit bucket arrived during shutdown; ignored", groups.placement.rollout_index)
