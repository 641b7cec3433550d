"""What trainer rank 0 and the rollout ranks exchange (:mod:`megatron_fp8.rl.cluster.remote`,
:mod:`megatron_fp8.rl.cluster.rollout_server`): picklable requests and answers, rollouts as raw bytes, errors as
``(type name, message, fields)`` rebuilt as the same :mod:`megatron_fp8.errors` type on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bridge_mappings.manifest import Manifest
from megatron_fp8 import errors
from megatron_fp8.errors import MegatronFP8Error, RefitError, RefitRefusedError
from megatron_fp8.rollout.engines import Rollout

__all__ = ["ArmSetup", "GenerateRequest", "Request", "Shared", "WireRollout", "describe_error", "rebuild_error"]


@dataclass(frozen=True)
class ArmSetup:
    """What a rollout rank needs to build an arm's engine (picklable, sent once per arm).

    Attributes:
        arm: the arm's name (a key of :data:`megatron_fp8.vocab.ARMS`).
        model_path: the HF checkpoint folder the engine loads (a path every rollout rank can read).
        manifest: vLLM's FP8 manifest (FP8 arms), else ``None``.
        quantization_config: vLLM's FP8 ``quantization_config`` dict (FP8 arms), else ``None``.
    """

    arm: str
    model_path: str
    manifest: Manifest | None = None
    quantization_config: dict | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """One list of prompts to sample, as :meth:`RolloutEngine.generate` takes it.

    Attributes:
        prompts: token ids per prompt.
        max_new_tokens: response length limit, tokens.
        temperature: sampling temperature.
        seed: prompt ``j`` is sampled with seed ``seed + j``.
        eos_token_id: end-of-sequence id.
    """

    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    temperature: float
    seed: int
    eos_token_id: int


@dataclass(frozen=True)
class WireRollout:
    """A :class:`Rollout` as plain data: log-probabilities as their raw bytes (bit-exact, any dtype); ``seconds``: the
    rollout rank's generation time; ``age`` and ``wait`` (set by trainer rank 0): versions behind, and its wait."""

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[bytes, ...]
    dtypes: tuple[str, ...]
    finished: tuple[bool, ...]
    engine: str
    seconds: float = 0.0
    age: int = 0
    wait: float = 0.0

    @classmethod
    def of(cls, r: Rollout, *, seconds: float = 0.0) -> WireRollout:
        lps = [lp.detach().cpu().contiguous() for lp in r.logprobs]
        return cls(
            token_ids=tuple(tuple(int(t) for t in ids) for ids in r.token_ids),
            logprobs=tuple(lp.reshape(-1).view(torch.uint8).numpy().tobytes() for lp in lps),
            dtypes=tuple(str(lp.dtype).removeprefix("torch.") for lp in lps),
            finished=tuple(bool(f) for f in r.finished),
            engine=r.engine,
            seconds=seconds,
        )

    def rollout(self) -> Rollout:
        def tensor(raw: bytes, dtype: str) -> torch.Tensor:
            dt = getattr(torch, dtype)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt) if raw else torch.empty(0, dtype=dt)

        lps = tuple(tensor(b, d) for b, d in zip(self.logprobs, self.dtypes, strict=True))
        return Rollout(token_ids=self.token_ids, logprobs=lps, finished=self.finished, engine=self.engine)


@dataclass(frozen=True)
class Request:
    """Trainer rank 0 -> rollout rank: request ``seq`` of ``kind`` (a ``_RolloutServer.on_<kind>`` handler)."""

    kind: str
    seq: int
    body: object = None


@dataclass(frozen=True)
class Shared:
    """What trainer rank 0 hands the other trainer ranks: a value, or the error it raised."""

    value: object = None
    error: tuple[str, str, dict] | None = None  # (type name, message, RefitRefusedError's fields)


def describe_error(exc: BaseException) -> tuple[str, str, dict]:
    """``exc`` as plain data for :func:`rebuild_error`: (type name, message, :class:`RefitRefusedError`'s fields)."""
    fields = {}
    if isinstance(exc, RefitRefusedError):
        fields = {"version": exc.version, "outcome": exc.outcome, "reason": exc.reason}
    return type(exc).__name__, str(exc), fields


def rebuild_error(name: str, message: str, fields: dict | None = None) -> MegatronFP8Error:
    """The error another process raised, as the same :mod:`megatron_fp8.errors` type where it is one."""
    cls = getattr(errors, name, None)
    if cls is RefitRefusedError and fields:
        return RefitRefusedError(message, **fields)
    if isinstance(cls, type) and issubclass(cls, MegatronFP8Error) and cls is not RefitRefusedError:
        try:
            return cls(message)
        except TypeError:
            pass
    return RefitError(message) if cls is RefitRefusedError else MegatronFP8Error(f"{name}: {message}")
