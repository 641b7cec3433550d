"""The rollout of one data batch: each rank's engine generates its part of its replica's samples.

The replica's samples (its problems x ``num_generations_per_prompt``) are split over the engines of its ranks
(:func:`~megatron_fp8.rl.cluster.distributed.rollout_share`) and all-gathered, so every rank of the replica trains
on the whole batch; sample ``i`` of a batch is seeded by :func:`~megatron_fp8.rl.cluster.distributed.sample_seed`
of ``(grpo.seed, batch, i)``, whichever rank generates it. With ``grpo.async_grpo`` a batch is asked for ahead
(:func:`prefetch_phase`) and collected by :func:`rollout_phase`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_fp8.rl.cluster.distributed import (
    DataParallel,
    RolloutShare,
    gather_within_replica,
    request_ranges,
    rollout_share,
    sample_seed,
)
from megatron_fp8.rl.data.task import Problem
from megatron_fp8.rl.sampling.context import GRPOContext
from megatron_fp8.rollout.engines import Rollout, RolloutEngine


class RolloutSide(Protocol):
    """What a rollout needs of an arm (:class:`~megatron_fp8.rl.driver.phases.ArmState` meets it)."""

    @property
    def engine(self) -> RolloutEngine:
        """The arm's rollout engine (or the proxy of separate rollout ranks)."""
        ...

    @property
    def dp(self) -> DataParallel:
        """This process's data-parallel place."""
        ...


@dataclass(frozen=True)
class RolloutOutcome:
    """This rank's responses of one data batch (a step's, or one dynamic-sampling round's).

    Attributes:
        problems: per response, its problem (each problem repeated ``num_generations_per_prompt`` times).
        prompt_ids: per response, the prompt token ids.
        rollout: the engine's responses and log-probabilities (the whole replica's, gathered).
        seconds: this rank's generation time, seconds.
        generated_samples: samples this rank's engine generated (its part of the replica's).
        generated_tokens: response tokens this rank's engine generated.
        age: updates the generating weights were behind the trainer's (``grpo.async_grpo``: 0 or 1).
        busy_seconds: the engine's generation time (the rollout ranks' own, when separate), seconds.
        wait_seconds: the trainer's time waiting for these samples, seconds.
    """

    problems: tuple[Problem, ...]
    prompt_ids: tuple[list[int], ...]
    rollout: Rollout
    seconds: float
    generated_samples: int = 0
    generated_tokens: int = 0
    age: int = 0
    busy_seconds: float = 0.0
    wait_seconds: float = 0.0


@dataclass(frozen=True)
class _StepRequests:
    """What this rank asks its engine for at one step (:func:`rollout_phase`, :func:`prefetch_phase`)."""

    problems: tuple[Problem, ...]
    prompts: tuple[list[int], ...]
    share: RolloutShare
    lengths: list[int]
    own: int
    merged: bool
    requests: list[tuple[tuple[list[int], ...], int]]


def _step_requests(side: RolloutSide, ctx: GRPOContext, batch: int, count: int) -> _StepRequests:
    """This rank's requests of data batch ``batch`` (``count`` prompts): its engine's part of the replica's samples
    (one per replica it holds, or one for consecutive replicas), each with the batch index of its first sample."""
    g = ctx.config.grpo
    step_problems = ctx.problems.step_problems(step=batch, count=count)
    problems = side.dp.shard(step_problems)
    first = side.dp.shard_start(len(step_problems)) * g.num_generations_per_prompt  # the replica's first sample
    prompt_ids = [ctx.tokenizer.encode(p.prompt, add_special_tokens=False) for p in problems]
    flat_prompts = tuple(ids for ids in prompt_ids for _ in range(g.num_generations_per_prompt))
    flat_problems = tuple(p for p in problems for _ in range(g.num_generations_per_prompt))
    share = rollout_share(len(flat_prompts), side.dp, engine_ranks=side.engine.engine_ranks)
    ranges, own = request_ranges(
        side.dp, share, n_problems=len(step_problems), generations=g.num_generations_per_prompt
    )  # the samples (step indices) this rank's engine generates: its part, or the same part of each of its replicas
    source, base = (flat_prompts, first) if share.span == 1 else (_step_prompts(ctx, step_problems), 0)
    merged = len(ranges) > 1 and all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    asked = [(ranges[0][0], ranges[-1][1])] if merged else ranges  # consecutive replicas: one request
    requests = [(source[lo - base : hi - base], lo) for lo, hi in asked]  # (prompts, first sample's index)
    return _StepRequests(flat_problems, flat_prompts, share, [hi - lo for lo, hi in ranges], own, merged, requests)


def _asks(side: RolloutSide, prompts: Sequence[Sequence[int]]) -> bool:
    """Whether this rank calls its engine for ``prompts`` (a remote engine: every trainer rank calls, even empty)."""
    return bool(prompts) or getattr(side.engine, "collective_generate", False)


def _sampling(ctx: GRPOContext, batch: int, start: int) -> dict[str, object]:
    gen = ctx.config.policy.generation
    seed = sample_seed(ctx.config.grpo.seed, batch, start)
    return {
        "max_new_tokens": gen.max_new_tokens,
        "temperature": gen.temperature,
        "seed": seed,
        "eos_token_id": ctx.eos_id,
    }


def prefetch_phase(side: RolloutSide, ctx: GRPOContext, *, batch: int, count: int) -> None:
    """``grpo.async_grpo``: ask the separate rollout ranks for data batch ``batch``'s samples now, with the version
    they hold; :func:`rollout_phase` of that batch collects them (one version behind the trainer by then). A no-op for an engine
    that cannot take a request ahead (colocated)."""
    submit = getattr(side.engine, "submit", None)
    if submit is None:
        return
    for mine, start in _step_requests(side, ctx, batch, count).requests:
        if _asks(side, mine):
            submit(mine, **_sampling(ctx, batch, start))


def rollout_phase(side: RolloutSide, ctx: GRPOContext, *, batch: int, count: int) -> RolloutOutcome:
    """Roll out this replica's problems of data batch ``batch`` (``count`` prompts; the same for every arm), each
    rank's engine its own part. A step draws batch ``step`` of ``num_prompts_per_step`` prompts; with dynamic sampling
    each generation round draws the next batch of ``num_prompts_per_step x batch_multiplier``.

    The replica's samples (its problems x ``num_generations_per_prompt``) are split over the engines of its ranks
    (:func:`~megatron_fp8.rl.cluster.distributed.rollout_share`) and all-gathered, so every rank of the replica trains
    on the whole batch while each engine generated only its part; an engine holding whole replicas generates all of
    their samples in one request and each rank keeps its replica's. Sample ``i`` of the batch (problem-major, over all
    replicas) is seeded with :func:`sample_seed`, so a sample does not depend on which rank generated it. Samples a
    :func:`prefetch_phase` asked for earlier are collected (their age recorded).
    """
    asked = _step_requests(side, ctx, batch, count)
    t0 = time.perf_counter()
    results: list[list[tuple[tuple[int, ...], torch.Tensor, bool]]] = []
    engine_name, age, busy, wait = side.engine.name, 0, 0.0, 0.0
    for mine, start in asked.requests:  # every rank of an engine makes the same requests, in the same order
        if _asks(side, mine):
            got = side.engine.generate(mine, **_sampling(ctx, batch, start))
            results.append(list(zip(got.token_ids, got.logprobs, got.finished, strict=True)))
            engine_name = got.engine
            timing = getattr(side.engine, "last_generation", None)  # a remote engine says what each side spent
            if timing is not None:
                age, busy, wait = max(age, timing.age), busy + timing.rollout_seconds, wait + timing.wait_seconds
        else:
            results.append([])
    seconds = time.perf_counter() - t0
    generated = sum(len(t) for result in results for t, _, _ in result)
    asked_samples = sum(len(mine) for mine, _ in asked.requests)
    at = sum(asked.lengths[: asked.own])
    part = results[0][at : at + asked.lengths[asked.own]] if asked.merged else results[asked.own]
    whole = gather_within_replica(part, asked.share)  # the replica's ranks train on the same samples
    rollout = Rollout(
        token_ids=tuple(t for t, _, _ in whole),
        logprobs=tuple(lp for _, lp, _ in whole),
        finished=tuple(f for _, _, f in whole),
        engine=engine_name,
    )
    if getattr(side.engine, "last_generation", None) is None:  # in process: the engine's time is the wait
        busy, wait = seconds, seconds
    return RolloutOutcome(asked.problems, asked.prompts, rollout, seconds, asked_samples, generated, age, busy, wait)


def _step_prompts(ctx: GRPOContext, step_problems: Sequence[Problem]) -> tuple[list[int], ...]:
    """Every sample's prompt of the step, problem-major (what an engine holding several replicas draws from)."""
    g = ctx.config.grpo
    prompts = [ctx.tokenizer.encode(p.prompt, add_special_tokens=False) for p in step_problems]
    return tuple(ids for ids in prompts for _ in range(g.num_generations_per_prompt))
