"""Separate rollout ranks: the trainer's :class:`RemoteRollout` and the rollout ranks' :func:`serve_rollout`.

With ``policy.generation.colocated.enabled: false`` (or ``ROLLOUT_TASKS`` in ``slurm/grpo.sbatch``) the last ranks
only generate (:mod:`megatron_fp8.rl.cluster.roles`). Trainer rank 0 drives them over the *link* (trainer rank 0 + the
rollout ranks): small pickled control messages on a gloo group (requests numbered, every answer a
:class:`~megatron_fp8.rl.cluster.roles.Reply` naming its request), and every refit through one
:class:`~megatron_fp8.refit.transport.torch_dist.TorchDistTransport` (``refit.transport``: NCCL on GPUs, gloo on
CPU) with the refit's guarantees unchanged: :class:`~megatron_fp8.refit.sender.RefitSender` on trainer rank 0,
a :class:`~megatron_fp8.refit.receiver.RefitReceiver` into each rollout engine's applier, each receiver's outcome
back to the sender; a version one rollout rank refused raises on the trainer, and that rank keeps serving its
last good version.

Several trainer (data-parallel) ranks: every trainer rank calls the same methods at the same points (they are
collective over the trainers' world). ``generate``: trainer rank 0 gathers every trainer rank's prompts, splits
each rank's list evenly (contiguous) over the rollout ranks, sends them, collects the answers and scatters each
trainer rank its own :class:`~megatron_fp8.rollout.engines.Rollout`. Prompt ``j`` of a list keeps seed
``seed + j`` (a part starting at ``j0`` is sent with seed ``seed + j0``), so the responses are those of one
engine generating the whole list: bit-identical to the colocated engine with one rollout rank (and with
several, for a batch-invariant engine such as the CPU reference one). ``refit``: trainer rank 0 sends the
stream; every other trainer rank consumes its own stream (the export's collectives need every rank) and
reports zero payload bytes, so the sum of refit bytes over trainer ranks is what was sent once.

Usage (the GRPO driver)::

    placement = placement_from(config)
    with join_groups(placement, timeout_s=1200, transport=config.refit.transport) as groups:
        if placement.role == "rollout":
            serve_rollout(config, placement, groups, build_engine=lambda setup: build_engine(setup, config))
            return
        remote = RemoteRollout.start(  # per arm, on every trainer rank
            ArmSetup(arm="fp8", model_path=str(path), manifest=manifest, quantization_config=qcfg),
            config=config,
            groups=groups,
        )
        rollout = remote.generate(prompts, max_new_tokens=16, temperature=1.0, seed=7, eos_token_id=eos)
        done = remote.refit(stream)  # RefitDone; raises RefitRefusedError when a rollout rank refused it
        remote.close()  # the arm's engines close; leaving join_groups stops the rollout ranks
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megatron_fp8.config.schema import RunConfig
from megatron_fp8.errors import ConfigError, MegatronFP8Error, RefitError, TransportTimeoutError
from megatron_fp8.layout import even_split
from megatron_fp8.refit.sender import RefitSender
from megatron_fp8.refit.wire import RefitVersion
from megatron_fp8.rl.cluster.messages import (
    ArmSetup,
    GenerateRequest,
    Request,
    Shared,
    WireRollout,
    describe_error,
    rebuild_error,
)
from megatron_fp8.rl.cluster.roles import (
    Groups,
    next_seq,
    recv_reply,
    refit_backend,
    send_control,
)
from megatron_fp8.rl.cluster.rollout_server import serve_rollout
from megatron_fp8.rl.state.results import RefitDone, least_checked_prefix_cache
from megatron_fp8.rollout.engines import Rollout

__all__ = ["ArmSetup", "GenerateRequest", "RemoteRollout", "serve_rollout"]  # the last from rollout_server

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- trainer side


@dataclass(frozen=True)
class GenerationTiming:
    """What the last :meth:`RemoteRollout.generate` cost each side.

    Attributes:
        age: versions the generating weights were behind the rollout ranks' newest when it was collected (0: the
            newest; 1: asked before the last refit, ``grpo.async_grpo``).
        rollout_seconds: the rollout ranks' generation time (the slowest rank), seconds.
        wait_seconds: the trainer's time waiting for the answer (the whole generation when asked synchronously;
            what was left of it when submitted ahead), seconds.
    """

    age: int = 0
    rollout_seconds: float = 0.0
    wait_seconds: float = 0.0


@dataclass(frozen=True)
class _Pending:
    """A generation sent and not yet read (trainer rank 0)."""

    seq: int
    plan: dict[int, list[tuple[int, int, GenerateRequest]]]
    requests: tuple[GenerateRequest, ...]
    version: int


def _request(
    prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, seed: int, eos_token_id: int
) -> GenerateRequest:
    return GenerateRequest(
        tuple(tuple(int(t) for t in p) for p in prompts), max_new_tokens, temperature, seed, eos_token_id
    )


class RemoteRollout:
    """An arm's engines on the rollout ranks, as the trainer ranks use them (built by :meth:`start`).

    Meets what the GRPO phases use of a :class:`~megatron_fp8.rollout.engines.RolloutEngine` (``name``,
    ``precision``, :meth:`generate`, :meth:`weight_scale_format`, :meth:`close`) and of a refit target
    (:meth:`refit`, :meth:`close`). Every method is collective over the trainer ranks.

    Attributes:
        name: the rollout engine's name (``reference-fp8``, ``vllm-bf16``, ...).
        precision: ``"bf16"`` or ``"fp8"``.
        setup: what the rollout ranks built the engine from.
        collective_generate: every trainer rank must call :meth:`generate`, with an empty list when it has
            nothing to ask (callers that may skip it check this).
    """

    collective_generate = True
    engine_ranks = 1  # each trainer rank asks for its own samples
    stream_on_device = False
    """The refit stream is exported to the host (the link's transport sends host buckets)."""

    def __init__(self, *, setup: ArmSetup, config: RunConfig, groups: Groups):
        self.name, self.precision, self.setup = "", "", setup
        self._groups, self._placement = groups, groups.placement
        self._is_root = self._placement.trainer_rank == 0
        self._sender: RefitSender | None = None
        if self._is_root:
            if groups.transport is None:
                raise ConfigError("trainer rank 0 holds no refit transport: join_groups built no link")
            self._sender = RefitSender(
                groups.transport,
                bucket_bytes=config.refit.bucket_size_mb << 20,
                timeout=config.refit.timeout_s,
                versions=RefitVersion(),
            )
        self._version = 0
        self._pending: _Pending | None = None
        self._ready: dict[tuple[GenerateRequest, ...], tuple[list[WireRollout], float, int]] = {}
        self.last_generation = GenerationTiming()
        self._scale_format: str | None = None
        self._closed = False
        self._broken: str | None = None

    @classmethod
    def start(cls, setup: ArmSetup, *, config: RunConfig, groups: Groups) -> RemoteRollout:
        """Build the arm's engine on every rollout rank (each with ``build_engine`` of :func:`serve_rollout`).

        Args:
            setup: the arm, the model folder, the FP8 manifest and quantization config.
            config: the run configuration (``refit.bucket_size_mb``, ``refit.timeout_s``, ``refit.transport``).
            groups: the process groups (:func:`megatron_fp8.rl.cluster.roles.join_groups`).

        Raises:
            ConfigError: not a trainer rank, ``refit.transport`` not the backend the groups were built with,
                or the rollout ranks built different engines.
            MegatronFP8Error: a rollout rank failed to build the engine (its error type where it is one of
                :mod:`megatron_fp8.errors`; the message names the rank).
        """
        p = groups.placement
        if p.role != "trainer":
            raise ConfigError(f"rank {p.rank} is a {p.role} rank; RemoteRollout runs on the trainer ranks")
        wanted = refit_backend(config.refit.transport)
        if wanted != groups.refit_backend:
            raise ConfigError(
                f"refit.transport={config.refit.transport!r} means {wanted}, but the link's refit group was built "
                f"with {groups.refit_backend}: pass transport=config.refit.transport to join_groups"
            )
        remote = cls(setup=setup, config=config, groups=groups)

        def build() -> tuple[str, str]:
            answers = set(remote._ask("start_arm", setup, what=f"building the {setup.arm} engine"))
            if len(answers) != 1:
                raise ConfigError(f"the rollout ranks built different engines for arm {setup.arm}: {sorted(answers)}")
            return answers.pop()  # type: ignore[return-value]

        remote.name, remote.precision = remote._same(build)  # type: ignore[misc]
        logger.info("arm %s: %s on %d rollout rank(s)", setup.arm, remote.name, len(p.rollout_ranks))
        return remote

    # -- collectives over the trainer ranks, and requests to the rollout ranks (trainer rank 0)

    def _check_usable(self) -> None:
        if self._closed:
            raise ConfigError(f"the remote {self.name} engine of arm {self.setup.arm} was closed; start a new one")
        if self._broken is not None:
            raise RefitError(f"the link to the rollout ranks is unusable after an earlier failure ({self._broken})")

    def _on_root(self, work: Callable[[list[object]], list[object]], mine: object = None) -> object:
        """Gather every trainer rank's ``mine`` on trainer rank 0, run ``work`` there (one result per trainer rank)
        and hand each trainer rank its result; an error of ``work`` is raised on every trainer rank."""
        n = len(self._placement.trainer_ranks)
        everyone: list[object] = [None] * n
        if n > 1:
            dist.gather_object(mine, everyone if self._is_root else None, dst=0, group=self._groups.trainers)
        else:
            everyone[0] = mine
        failure, shared = None, None
        if self._is_root:
            try:
                shared = [Shared(value=v) for v in work(everyone)]
            except Exception as exc:
                failure, shared = exc, [Shared(error=describe_error(exc))] * n
        box: list[object] = [shared[0] if shared is not None and n == 1 else None]
        if n > 1:
            dist.scatter_object_list(box, shared, src=0, group=self._groups.trainers)
        if failure is not None:
            raise failure
        got = box[0]
        assert isinstance(got, Shared)
        if got.error is not None:
            if got.error[0] == "TransportTimeoutError":  # the link broke: every trainer rank refuses from now on
                self._broken = got.error[1]
            raise rebuild_error(*got.error)
        return got.value

    def _same(self, work: Callable[[], object]) -> object:
        """``work()`` on trainer rank 0, its value on every trainer rank (its error raised on every one)."""
        return self._on_root(lambda everyone: [work()] * len(everyone))

    def _send_all(self, kind: str, seq: int, bodies: dict[int, object]) -> None:
        """Trainer rank 0: request ``seq`` of ``kind`` to each link rank of ``bodies``, with its body."""
        for link_rank, body in bodies.items():
            try:
                send_control(self._groups, Request(kind, seq, body), to=link_rank)
            except TransportTimeoutError as exc:
                self._broken = str(exc)
                raise

    def _collect(self, seq: int, link_ranks: Sequence[int], *, what: str) -> list[object]:
        """Trainer rank 0: the answer of each of ``link_ranks`` to request ``seq`` (already sent), in that order.

        Raises:
            MegatronFP8Error: the first error answered (every answer is read first, to stay in step).
            TransportTimeoutError: a rollout rank did not answer within the link's deadline.
        """
        values, failure = [], None
        for link_rank in link_ranks:
            try:
                reply = recv_reply(self._groups, sender=link_rank, seq=seq)
            except TransportTimeoutError as exc:
                self._broken = str(exc)
                raise
            if reply.error is not None and failure is None:
                index = link_rank - 1
                where = f"rollout rank {index} (global rank {self._placement.rollout_ranks[index]}), {what}"
                failure = rebuild_error(reply.error[0], f"{where}: {reply.error[1]}")
            values.append(reply.value)
        if failure is not None:
            raise failure
        return values

    def _ask(self, kind: str, body: object = None, *, what: str) -> list[object]:
        """Trainer rank 0: one request to every rollout rank; their answers, in rollout order (a generation in
        flight is collected first)."""
        self._settle()
        seq, ranks = next_seq(), range(1, self._placement.link_size)
        self._send_all(kind, seq, dict.fromkeys(ranks, body))
        return self._collect(seq, ranks, what=what)

    # -- the engine surface

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        eos_token_id: int,
    ) -> Rollout:
        """Sample one response per prompt on the rollout ranks (prompt ``j`` seeded with ``seed + j``).

        Collective over the trainer ranks: every trainer rank calls it (with its own prompts, possibly none). When the
        same requests were :meth:`submit` ted, their answer is collected (generated by the version the rollout ranks
        held then: :attr:`last_generation` says how many versions ago); otherwise they are asked now.

        Raises:
            EngineNotServingError: a rollout engine holds no good version.
            MegatronFP8Error: a rollout rank failed (its error, naming the rank).
            TransportTimeoutError: a rollout rank did not answer within the link's deadline (it died).
        """
        self._check_usable()
        mine = _request(prompts, max_new_tokens, temperature, seed, eos_token_id)
        wire = self._on_root(self._generate_for, mine)  # type: ignore[arg-type]
        assert isinstance(wire, WireRollout)
        self.last_generation = GenerationTiming(age=wire.age, rollout_seconds=wire.seconds, wait_seconds=wire.wait)
        return wire.rollout()

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        eos_token_id: int,
    ) -> None:
        """Ask the rollout ranks for these samples now and return at once (``grpo.async_grpo``): they generate with
        the version they hold while the trainers train; :meth:`generate` with the same arguments collects them.

        Collective over the trainer ranks, as :meth:`generate`. One request is in flight at a time: a second
        :meth:`submit`, a refit or any other request first collects the one in flight (its answer is kept for its
        :meth:`generate`); the rollout ranks answer in order, so a refit always follows the generation asked before.
        """
        self._check_usable()
        mine = _request(prompts, max_new_tokens, temperature, seed, eos_token_id)
        self._on_root(self._submit_for, mine)

    def _submit_for(self, requests: list[GenerateRequest]) -> list[None]:
        """Trainer rank 0: send every trainer rank's request; the answer is read later (:meth:`_settle`)."""
        self._settle()
        self._pending = self._send_generate(tuple(requests))
        return [None] * len(requests)

    def _send_generate(self, requests: tuple[GenerateRequest, ...]) -> _Pending:
        """Trainer rank 0: every trainer rank's request split over the rollout ranks, sent."""
        plan: dict[int, list[tuple[int, int, GenerateRequest]]] = {}
        for r, req in enumerate(requests):
            for k, (a, b) in enumerate(even_split(len(req.prompts), len(self._placement.rollout_ranks))):
                if b > a:
                    plan.setdefault(1 + k, []).append((r, a, replace(req, prompts=req.prompts[a:b], seed=req.seed + a)))
        seq = next_seq()
        self._send_all("generate", seq, {lr: tuple(item[2] for item in items) for lr, items in plan.items()})
        return _Pending(seq=seq, plan=plan, requests=requests, version=self._version)

    def _settle(self) -> None:
        """Trainer rank 0: collect the request in flight, if any, and keep its answer for its :meth:`generate`."""
        pending, self._pending = self._pending, None
        if pending is not None:
            t0 = time.perf_counter()
            wires = self._finish(pending)
            self._ready[pending.requests] = (wires, time.perf_counter() - t0, pending.version)

    def _generate_for(self, requests: list[GenerateRequest]) -> list[WireRollout]:
        """Trainer rank 0: every trainer rank's answer: submitted earlier, or asked and awaited now."""
        key = tuple(requests)
        self._settle()
        if key not in self._ready:
            t0 = time.perf_counter()
            wires = self._finish(self._send_generate(key))
            self._ready[key] = (wires, time.perf_counter() - t0, self._version)
        wires, waited, version = self._ready.pop(key)
        return [replace(w, age=self._version - version, wait=waited) for w in wires]

    def _finish(self, pending: _Pending) -> list[WireRollout]:
        """Trainer rank 0: the rollout ranks' answers to ``pending``, put together per trainer rank."""
        answers = self._collect(pending.seq, list(pending.plan), what="generating")
        pieces: list[list[tuple[int, WireRollout]]] = [[] for _ in pending.requests]
        for items, answer in zip(pending.plan.values(), answers, strict=True):
            for (r, a, _), wire in zip(items, answer, strict=True):  # type: ignore[call-overload]
                pieces[r].append((a, wire))
        busy = max((w.seconds for answer in answers for w in answer), default=0.0)  # type: ignore[attr-defined]
        out = []
        for parts in pieces:
            wires = [w for _, w in sorted(parts, key=lambda x: x[0])]
            out.append(
                WireRollout(
                    token_ids=tuple(t for w in wires for t in w.token_ids),
                    logprobs=tuple(b for w in wires for b in w.logprobs),
                    dtypes=tuple(d for w in wires for d in w.dtypes),
                    finished=tuple(f for w in wires for f in w.finished),
                    engine=wires[0].engine if wires else self.name,
                    seconds=busy,
                )
            )
        return out

    def weight_scale_format(self) -> str:
        """The FP8 weight-scale format the rollout engines hold (asked once; collective over the trainer ranks).

        Raises:
            ConfigError: the rollout ranks hold different formats.
        """
        self._check_usable()
        if self._scale_format is None:

            def ask() -> str:
                formats = set(self._ask("scale_format", what="reporting its weight-scale format"))
                if len(formats) != 1:
                    raise ConfigError(f"the rollout ranks hold different FP8 weight-scale formats: {sorted(formats)}")
                return str(formats.pop())

            self._scale_format = str(self._same(ask))
        return self._scale_format

    def refit(self, stream: Iterable[tuple[str, torch.Tensor]]) -> RefitDone:
        """Send one weight version to every rollout rank; return when every one committed and verified it.

        Trainer rank 0 sends ``stream`` (one :class:`~megatron_fp8.refit.sender.RefitSender` version through the
        link's transport); every other trainer rank consumes its own stream and reports zero payload bytes.

        Args:
            stream: ``(hf_name, tensor)`` pairs (BF16, or FP8 + ``*_scale_inv`` per the manifest); consumed once.

        Returns:
            The :class:`RefitDone`: payload bytes per class, seconds (stream production included), the committed
            version and the rollout ranks' worst post-commit relative error (``nan`` when none verified).

        Raises:
            RefitRefusedError: a rollout rank refused the version or rolled its engine back (it keeps serving its
                last good version); ``reason`` is its reason.
            TransportTimeoutError: a rollout rank took no bucket or sent no outcome within ``refit.timeout_s``.
            RefitError, NonFiniteError, ManifestError: the stream or the transport failed (the version was
                abandoned; nothing of it was applied).
        """
        self._check_usable()
        self._version += 1
        version = self._version
        if not self._is_root:
            for _ in stream:  # the export may be collective over the trainer ranks: take part in it
                pass
        done = self._same(lambda: self._send_version(stream, version))
        assert isinstance(done, RefitDone)
        return done if self._is_root else replace(done, payload_bytes=dict.fromkeys(done.payload_bytes, 0))

    def _send_version(self, stream: Iterable[tuple[str, torch.Tensor]], version: int) -> RefitDone:
        """Trainer rank 0: announce version ``version``, send it, and read every rollout rank's answer."""
        assert self._sender is not None
        self._settle()  # the generation asked before this version finishes first (the rollout ranks answer in order)
        seq, ranks = next_seq(), range(1, self._placement.link_size)
        self._send_all("refit", seq, dict.fromkeys(ranks, version))
        t0 = time.perf_counter()
        try:
            report = self._sender.send(stream, version=version)
        except TransportTimeoutError as exc:
            self._broken = str(exc)  # a rollout rank died or stalled: its answer may never come
            raise
        except Exception:
            try:  # every rollout rank answers (its refusal, or the abort): read them to stay in step
                self._collect(seq, ranks, what=f"refit version {version}")
            except MegatronFP8Error as answered:
                logger.debug("refit v%d: the rollout ranks answered: %s", version, answered)
            raise
        answers = self._collect(seq, ranks, what=f"committing refit version {version}")
        err = max((e for _, e, _ in answers if math.isfinite(e)), default=math.nan)  # type: ignore[misc]
        caches = least_checked_prefix_cache([c for _, _, c in answers])  # type: ignore[misc]
        return RefitDone(dict(report.payload_bytes), time.perf_counter() - t0, version, err, prefix_cache=caches)

    def close(self) -> None:
        """Close the arm's engine on every rollout rank (idempotent; failures are logged, not raised)."""
        if self._closed:
            return
        self._closed = True
        if self._is_root and self._broken is None:
            try:
                self._ask("end_arm", what=f"closing the {self.setup.arm} engine")
            except MegatronFP8Error as exc:
                logger.warning("arm %s: closing the rollout engines: %s", self.setup.arm, exc)
