"""The rollout ranks' side of separate rollout (:func:`serve_rollout`): build each arm's engine, generate, receive
each refit into the engine's applier, answer trainer rank 0 (:class:`megatron_fp8.rl.cluster.remote.RemoteRollout`)
until it says stop.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from megatron_fp8.config.schema import RunConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.refit.receiver import RefitReceiver
from megatron_fp8.refit.wire import RefitVersion
from megatron_fp8.rl.cluster.messages import ArmSetup, GenerateRequest, Request, WireRollout
from megatron_fp8.rl.cluster.roles import (
    Groups,
    Placement,
    Reply,
    Shutdown,
    recv_control,
    send_control,
    take_transport_close,
)
from megatron_fp8.rollout.engines import RolloutEngine

__all__ = ["serve_rollout"]

logger = logging.getLogger(__name__)


class _RolloutServer:
    """One rollout rank's engine, refit receiver and request handlers (``on_<kind>``)."""

    def __init__(self, config: RunConfig, groups: Groups, build_engine: Callable[[ArmSetup], RolloutEngine]):
        self.config, self.groups, self.build_engine = config, groups, build_engine
        self.engine: RolloutEngine | None = None
        self.receiver: RefitReceiver | None = None
        self.arm = ""
        self.who = f"rollout rank {groups.placement.rollout_index} (global rank {groups.placement.rank})"

    def _engine(self) -> RolloutEngine:
        if self.engine is None:
            raise ConfigError(f"{self.who} holds no engine: the trainer must start an arm first")
        return self.engine

    def on_start_arm(self, setup: ArmSetup) -> tuple[str, str]:
        self.on_end_arm(None)
        self.arm, self.engine = setup.arm, self.build_engine(setup)
        assert self.groups.transport is not None
        wait = self.config.refit.timeout_s
        self.receiver = RefitReceiver(
            self.groups.transport,
            apply=self.engine.applier,
            timeout=wait,
            versions=RefitVersion(),
            outcome_timeout=wait,
        )
        logger.info("%s: arm %s, engine %s ready", self.who, self.arm, self.engine.name)
        return self.engine.name, self.engine.precision

    def on_generate(self, requests: tuple[GenerateRequest, ...]) -> tuple[WireRollout, ...]:
        engine, out = self._engine(), []
        for r in requests:  # each answer says how long this rank generated it (the rollout side's busy time)
            t0 = time.perf_counter()
            got = engine.generate(
                r.prompts,
                max_new_tokens=r.max_new_tokens,
                temperature=r.temperature,
                seed=r.seed,
                eos_token_id=r.eos_token_id,
            )
            out.append(WireRollout.of(got, seconds=time.perf_counter() - t0))
        return tuple(out)

    def on_refit(self, version: int) -> tuple[int, float, str | None]:
        engine, receiver, wait = self._engine(), self.receiver, self.config.refit.timeout_s
        assert receiver is not None
        report = receiver.receive(timeout=wait, first_timeout=wait)
        verify = engine.applier.last_verify
        err = float(verify.max_rel_error) if verify is not None else math.nan
        logger.debug(
            "%s: arm %s refit v%d of v%d committed (error %.3g)", self.who, self.arm, report.version, version, err
        )
        return report.version, err, engine.applier.last_prefix_cache

    def on_scale_format(self, _body: None) -> str:
        return self._engine().weight_scale_format()

    def on_end_arm(self, _body: None) -> None:
        engine, self.engine, self.receiver = self.engine, None, None
        if engine is not None:
            engine.close()
            logger.info("%s: arm %s engine closed", self.who, self.arm)

    def handle(self, msg: object) -> Reply:
        """Run one request; its answer, or its error (the server keeps serving)."""
        seq = int(getattr(msg, "seq", -1))
        handler = getattr(self, f"on_{msg.kind}", None) if isinstance(msg, Request) else None
        if handler is None:
            return Reply(seq, error=("RefitError", f"{self.who}: unknown request {msg!r:.200}"))
        try:
            return Reply(seq, value=handler(msg.body))  # type: ignore[union-attr]
        except Exception as exc:
            logger.warning("%s: %s failed: %s: %s", self.who, getattr(msg, "kind", "?"), type(exc).__name__, exc)
            return Reply(seq, error=(type(exc).__name__, str(exc)))


def serve_rollout(
    config: RunConfig, placement: Placement, groups: Groups, *, build_engine: Callable[[ArmSetup], RolloutEngine]
) -> None:
    """A rollout rank's whole run: answer trainer rank 0's requests until it says stop.

    Requests: start an arm (build its engine with ``build_engine``), generate, receive a refit (into the engine's
    applier through a :class:`~megatron_fp8.refit.receiver.RefitReceiver`, which reports the outcome to the
    sender; a refused version leaves the last good one serving), report the FP8 weight-scale format, end the
    arm (close its engine), stop. A request that fails is answered with its error and the rank keeps serving.

    Args:
        config: the run configuration (``refit.timeout_s``).
        placement: this rollout rank's placement.
        groups: the process groups (:func:`megatron_fp8.rl.cluster.roles.join_groups`).
        build_engine: builds an arm's engine from its :class:`ArmSetup` (the driver's own engine factory).

    Raises:
        ConfigError: not a rollout rank.
        TransportTimeoutError: trainer rank 0 sent nothing within ``groups.timeout_s`` or died; the message names it.
    """
    if placement.role != "rollout" or groups.link is None:
        raise ConfigError(f"rank {placement.rank} is a {placement.role} rank; serve_rollout runs on rollout ranks")
    server = _RolloutServer(config, groups, build_engine)
    logger.info("%s: serving trainer rank 0", server.who)
    try:
        while True:
            msg = recv_control(groups, sender=0)
            if isinstance(msg, Shutdown):
                server.on_end_arm(None)
                take_transport_close(groups)
                if msg.reason:
                    logger.warning("%s: the trainer stopped on an error: %s", server.who, msg.reason)
                send_control(groups, Reply(msg.seq), to=0, timeout=30.0)
                logger.info("%s: stopped", server.who)
                return
            send_control(groups, server.handle(msg), to=0)
    finally:
        server.on_end_arm(None)
