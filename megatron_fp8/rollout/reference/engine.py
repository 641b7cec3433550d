"""Reference FP8 engine: an emulator and oracle of vLLM's FP8 W8A8 blockwise numerics for CPU machines.

This is NOT a serving engine; on GPU use vLLM. vLLM's FP8 kernels do not run on
CPUs without AMX, so the refit and rollout tests need something that computes
what vLLM computes in FP8, holds its weights the way vLLM does, and accepts
the same weight stream. :class:`ReferenceFP8Engine` is that, for Qwen3 dense
and Qwen3-MoE models (HF config semantics):

* weights keyed by unfused HF names; the FP8 manifest (``fp8_names``) says
  which linear weights are held as float8_e4m3fn + float32 128x128 block
  ``scale_inv``; everything else (embeddings, norms, router, lm_head, layers in
  ``ignored_layers``) is bfloat16;
* FP8 linears run vLLM's dynamic W8A8 blockwise GEMM
  (:mod:`megatron_fp8.rollout.reference.linear`): activations quantized per token
  in groups of 128, per-K-block float32 partial sums scaled by
  ``sa[m, kb] * sw[n // 128, kb]``, bfloat16 output;
* :meth:`ReferenceFP8Engine.load_weights` accepts vLLM's refit stream
  (FP8 weight + ``name + "_scale_inv"``, BF16 for the rest, a BF16 tensor for an
  FP8 name is quantized on arrival with :func:`megatron_fp8.quant.quantize_blockwise`,
  KV scales ``model.layers.{i}.self_attn.attn.{q,k,v}_scale``), validates the
  whole stream before touching anything, and then updates the stored tensors
  in place (``copy_``), never rebinding them;
* ``kv_cache_dtype="fp8"`` emulates an FP8 KV cache: K (after RoPE) and V are
  stored as ``fp8(clamp(x / scale, +-448))`` with the per-layer ``k_scale`` /
  ``v_scale`` and read back as ``q * scale``; attention always reads the cache;
* :meth:`~ReferenceFP8Engine.generate` (greedy or seeded sampling with top-p,
  per-token logprobs) and :meth:`~ReferenceFP8Engine.score` (teacher-forced
  logprobs) run a batched forward with a KV cache and per-sequence lengths.

Numerics of the non-GEMM parts follow vLLM / HF in bfloat16: RMSNorm in float32
(``weight * x_normed.to(bf16)``), RoPE with cos/sin rounded to bfloat16 and the
rotation computed in float32 and rounded once, attention softmax and products in
float64 over bfloat16 (or dequantized FP8) q/k/v with one rounding of the output,
SiLU-and-mul in float32 rounded once, router softmax / top-k in float32, MoE
routing weights applied to the float32 expert output. Every per-token result is
independent of the batch and of prefill vs decode, so a generated token's
logprob equals :meth:`score` of the finished sequence.

The engine is a facade over three parts: :mod:`~megatron_fp8.rollout.reference.weights`
(the weight store and refit versions), :mod:`~megatron_fp8.rollout.reference.forward`
(the model forward) and :mod:`~megatron_fp8.rollout.reference.sampler` (sampling,
generation loop, logprobs).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.quant.formats import KV_CACHE_DTYPES
from megatron_fp8.rollout.reference import sampler
from megatron_fp8.rollout.reference.config import (
    JsonMapping,
    ReferenceModelConfig,
    ReferenceQuantConfig,
    model_config_from_hf,
)
from megatron_fp8.rollout.reference.forward import ReferenceForward
from megatron_fp8.rollout.reference.sampler import GenerationResult
from megatron_fp8.rollout.reference.weights import (
    StagedUpdate,
    WeightSnapshot,
    WeightStore,
    checkpoint_items,
    read_hf_config,
    safetensors_files,
    save_fp8_checkpoint,
)
from megatron_fp8.vocab import FINISH_REASONS

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # typing only: transformers is optional at runtime

logger = logging.getLogger(__name__)


class ReferenceFP8Engine:
    """Reference FP8 engine for Qwen3 / Qwen3-MoE: an emulator and oracle of vLLM's FP8 W8A8
    blockwise numerics for CPU machines. NOT a serving engine; on GPU use vLLM.

    Args:
        hf_config: ``transformers`` config object or ``config.json`` dict
            (``model_type`` ``qwen3`` or ``qwen3_moe``).
        quantization: vLLM's FP8 ``quantization_config`` dict
            (``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "ignored_layers": [...]}``) or ``None`` for BF16.
        fp8_names: the FP8 manifest (HF weight names held in FP8). ``None``: derive
            it from ``ignored_layers`` as vLLM does. Must be empty without quantization.
        kv_cache_dtype: a key of :data:`KV_CACHE_DTYPES`.
        activation_scale_format: ``"fp32"`` (Hopper) or ``"ue8m0"`` activation scales.
        weight_cache: keep a float64 copy of each FP8 weight between forward
            passes (8 bytes per element, dropped at every commit): several times
            faster for generation; turn it off for models too big for that.

    Raises:
        ConfigError: unsupported model / quantization / KV-cache dtype.
        ManifestError: an ``fp8_names`` entry that vLLM would not hold in FP8.

    Weights start unloaded (zeros); load them with :meth:`load_weights` or build
    the engine with :meth:`from_hf_checkpoint`. Forward passes refuse to run
    until every weight has been loaded once.

    Attributes:
        model_config: the model.
        kv_cache_dtype: the KV-cache dtype name.
        weights: the :class:`~megatron_fp8.rollout.reference.weights.WeightStore`.
        model: the :class:`~megatron_fp8.rollout.reference.forward.ReferenceForward` over it.
    """

    def __init__(
        self,
        hf_config: JsonMapping | PretrainedConfig,
        *,
        quantization: JsonMapping | None = None,
        fp8_names: Iterable[str] | None = None,
        kv_cache_dtype: str = "auto",
        activation_scale_format: str = "fp32",
        weight_cache: bool = True,
    ):
        self.model_config: ReferenceModelConfig = model_config_from_hf(hf_config)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; valid names: {sorted(KV_CACHE_DTYPES)}")
        self.kv_cache_dtype = kv_cache_dtype
        self.weights = WeightStore(
            self.model_config,
            quantization=quantization,
            fp8_names=fp8_names,
            activation_scale_format=activation_scale_format,
            weight_cache=weight_cache,
        )
        self._tensors = self.weights.tensors  # the live storage (same dict), for fault-planting tests
        self.model = ReferenceForward(self.weights, kv_cache_dtype=kv_cache_dtype)
        held = (
            f"{len(self.fp8_names)} FP8 weights of {len(self.weights.specs)} (W8A8 blockwise)"
            if self.fp8_names
            else f"{len(self.weights.specs)} weights, none in FP8 (BF16 rollout)"
        )
        logger.info(
            "reference engine (the CPU emulator of vLLM, not a server): %s, %s, kv_cache_dtype=%s",
            self.model_config.model_type,
            held,
            kv_cache_dtype,
        )

    # ------------------------------------------------------------------ weights

    @property
    def quant_config(self) -> ReferenceQuantConfig | None:
        """The FP8 quantization, or ``None`` for a BF16 engine."""
        return self.weights.quant_config

    @property
    def fp8_names(self) -> frozenset[str]:
        """The FP8 manifest: HF weight names held as float8_e4m3fn + ``_scale_inv``."""
        return self.weights.fp8_names

    @property
    def version(self) -> int:
        """Number of updates committed so far (0 before the first load)."""
        return self.weights.version

    def expected_names(self) -> list[str]:
        """Every name the stream may carry: weights, ``_scale_inv`` of FP8 weights, KV scales."""
        return self.weights.expected_names()

    def missing_weights(self) -> list[str]:
        """Weights never loaded so far (KV scales default to 1.0 and are never missing)."""
        return self.weights.missing_weights()

    def stage(self, items: Iterable[tuple[str, torch.Tensor]]) -> StagedUpdate:
        """Validate a weight stream completely and prepare the new tensors, changing nothing.

        See :meth:`WeightStore.stage <megatron_fp8.rollout.reference.weights.WeightStore.stage>`
        for the accepted stream format.

        Returns:
            an open :class:`StagedUpdate`.

        Raises:
            WeightStreamError: unknown or duplicate name, wrong dtype or shape,
                FP8 weight without scales (or scales without weight), non-finite values.
        """
        return self.weights.stage(items)

    def commit(self, staged: StagedUpdate) -> frozenset[str]:
        """Apply a staged update in place; see :meth:`WeightStore.commit <megatron_fp8.rollout.reference.weights.WeightStore.commit>`."""
        return self.weights.commit(staged)

    def abort(self, staged: StagedUpdate) -> None:
        """Drop a staged update without applying it (idempotent for aborted updates)."""
        self.weights.abort(staged)

    def snapshot(self, names: Iterable[str]) -> WeightSnapshot:
        """Copies of the stored tensors ``names`` and the version counter (see :meth:`WeightStore.snapshot`)."""
        return self.weights.snapshot(names)

    def restore(self, snap: WeightSnapshot) -> None:
        """Copy a snapshot back in place and reset the version counter (see :meth:`WeightStore.restore`)."""
        self.weights.restore(snap)

    def load_weights(self, items: Iterable[tuple[str, torch.Tensor]]) -> frozenset[str]:
        """All-or-nothing :meth:`stage` + :meth:`commit` of a weight stream (see :meth:`stage`).

        Returns:
            the weight names (not scales) that were updated.
        """
        return self.commit(self.stage(items))

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stored tensors, live (do not modify), in stream format and checkpoint order.

        Yields ``(name, tensor)``: FP8 weights as float8_e4m3fn followed by their
        ``_scale_inv``, BF16 weights, then the float32 KV scales.
        """
        return self.weights.named_weights()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of everything :meth:`named_weights` yields."""
        return {n: t.clone() for n, t in self.named_weights()}

    # --------------------------------------------------------------- checkpoints

    @classmethod
    def from_hf_checkpoint(
        cls,
        path: str | Path,
        *,
        quantization: JsonMapping | None | str = "auto",
        fp8_names: Iterable[str] | None = None,
        kv_cache_dtype: str = "auto",
        activation_scale_format: str = "fp32",
        weight_cache: bool = True,
    ) -> ReferenceFP8Engine:
        """Build an engine from an HF safetensors checkpoint folder.

        Args:
            path: folder with ``config.json`` and ``*.safetensors`` (sharded with an index or not).
            quantization: ``"auto"`` uses the checkpoint's ``quantization_config``
                (BF16 when it has none); a dict quantizes a BF16 checkpoint at
                load time; ``None`` forces BF16.
            fp8_names: FP8 manifest; ``None`` derives it from ``ignored_layers``.
            kv_cache_dtype: a key of :data:`KV_CACHE_DTYPES`.
            activation_scale_format: ``"fp32"`` or ``"ue8m0"``.
            weight_cache: see :class:`ReferenceFP8Engine`.

        Raises:
            ConfigError: missing config, unsupported settings, or weights the checkpoint lacks.
            WeightStreamError: a checkpoint tensor with an unknown name, wrong shape or dtype.
        """
        folder = Path(path)
        cfg = read_hf_config(folder)
        if quantization == "auto":
            quantization = cfg.get("quantization_config")
        elif isinstance(quantization, str):
            raise ConfigError(f"quantization={quantization!r}; valid values: 'auto', a quantization_config dict, None")
        files = safetensors_files(folder)
        engine = cls(
            cfg,
            quantization=quantization,
            fp8_names=fp8_names,
            kv_cache_dtype=kv_cache_dtype,
            activation_scale_format=activation_scale_format,
            weight_cache=weight_cache,
        )
        engine.load_weights(checkpoint_items(files))
        missing = engine.missing_weights()
        if missing:
            raise ConfigError(f"{folder}: checkpoint lacks {len(missing)} weights, e.g. {missing[:4]}")
        return engine

    def save_fp8_checkpoint(self, path: str | Path) -> Path:
        """Write an FP8 HF checkpoint (``config.json`` + ``model.safetensors``) that :meth:`from_hf_checkpoint` loads.

        See :func:`megatron_fp8.rollout.reference.weights.save_fp8_checkpoint` for the layout, the result
        (the checkpoint folder) and the errors (a BF16 or not fully loaded engine).
        """
        return save_fp8_checkpoint(self.weights, path)

    # ------------------------------------------------------------ generate/score

    def score(
        self,
        input_ids: Sequence[Sequence[int]] | torch.Tensor,
        *,
        response_start: int | Sequence[int],
        temperature: float = 1.0,
    ) -> list[torch.Tensor]:
        """Teacher-forced log-probabilities of the response tokens (float32, one tensor per sequence).

        See :func:`megatron_fp8.rollout.reference.sampler.score` for the arguments and the result.
        """
        return sampler.score(self.model, input_ids, response_start=response_start, temperature=temperature)

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        eos_token_id: int | Iterable[int] | None = None,
    ) -> GenerationResult:
        """Generate continuations with a batched KV cache; see :func:`megatron_fp8.rollout.reference.sampler.generate`."""
        return sampler.generate(
            self.model,
            prompt_token_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            eos_token_id=eos_token_id,
        )


__all__ = [
    "FINISH_REASONS",
    "KV_CACHE_DTYPES",
    "GenerationResult",
    "ReferenceFP8Engine",
    "StagedUpdate",
    "WeightSnapshot",
]
