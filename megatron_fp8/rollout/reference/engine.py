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
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_fp8.errors import ConfigError, RefitError, WeightStreamError
from megatron_fp8.quant import quantize_blockwise
from megatron_fp8.quant.formats import FLOAT_INPUT_DTYPES, FP8_DTYPE, FP8_MAX, KV_CACHE_DTYPES
from megatron_fp8.rollout.reference.config import (
    ParamSpec,
    ReferenceModelConfig,
    ReferenceQuantConfig,
    canonical_kv_scale_name,
    check_fp8_names,
    default_fp8_names,
    ignored_layers_for,
    kv_scale_names,
    model_config_from_hf,
    param_specs,
    quant_config_from_hf,
    scale_shape,
)
from megatron_fp8.rollout.reference.linear import bf16_linear, w8a8_block_fp8_linear
from megatron_fp8.vocab import FINISH_REASONS, SCALE_SUFFIX

logger = logging.getLogger(__name__)

_CHECKPOINT_FILE = "model.safetensors"


@dataclass(frozen=True)
class GenerationResult:
    """Output of :meth:`ReferenceFP8Engine.generate` (reference FP8 engine: a CPU emulator and
    oracle of vLLM's FP8 W8A8 blockwise numerics, NOT a serving engine; on GPU use vLLM).

    Attributes:
        token_ids: per sequence, the generated (response) token ids, EOS included.
        logprobs: per sequence, float32 ``[len(token_ids[i])]`` log-probabilities of
            the generated tokens under the engine's distribution: ``log_softmax(logits / T)``
            for ``temperature = T > 0`` (before top-p truncation), ``log_softmax(logits)``
            for greedy decoding.
        finish_reasons: per sequence, one of :data:`megatron_fp8.vocab.FINISH_REASONS`.
    """

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[torch.Tensor, ...]
    finish_reasons: tuple[str, ...]


class StagedUpdate:
    """A validated, not yet applied weight update (reference FP8 engine: a CPU emulator and oracle of
    vLLM's FP8 W8A8 blockwise numerics, NOT a serving engine; on GPU use vLLM).

    Produced by :meth:`ReferenceFP8Engine.stage`; apply it with
    :meth:`ReferenceFP8Engine.commit` or drop it with :meth:`ReferenceFP8Engine.abort`.

    Attributes:
        names: the stream names it carries (weights, ``_scale_inv``, KV scales), canonicalized.
        state: ``"open"``, ``"committed"`` or ``"aborted"``.
    """

    __slots__ = ("_engine_id", "_updates", "_version", "names", "state")

    def __init__(self, *, engine_id: int, version: int, updates: dict[str, torch.Tensor], names: frozenset[str]):
        self._engine_id = engine_id
        self._version = version
        self._updates = updates
        self.names = names
        self.state = "open"

    def __repr__(self) -> str:
        return f"StagedUpdate({len(self.names)} tensors, state={self.state!r})"


class _KVCache:
    """Per-layer K/V storage ``[B, kv_heads, max_len, head_dim]`` in the cache dtype."""

    def __init__(self, cfg: ReferenceModelConfig, batch: int, max_len: int, dtype: torch.dtype):
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.max_len = max_len


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _as_token_lists(seqs: Sequence[Sequence[int]] | torch.Tensor, what: str) -> list[list[int]]:
    if isinstance(seqs, torch.Tensor):
        if seqs.dim() != 2:
            raise ConfigError(
                f"{what}: expected a list of token-id lists or a 2-D tensor, got shape {tuple(seqs.shape)}"
            )
        return [list(map(int, row)) for row in seqs.tolist()]
    out = [list(map(int, s)) for s in seqs]
    if not out:
        raise ConfigError(f"{what}: no sequences given")
    return out


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
    """

    def __init__(
        self,
        hf_config: Any,
        *,
        quantization: Mapping[str, Any] | None = None,
        fp8_names: Iterable[str] | None = None,
        kv_cache_dtype: str = "auto",
        activation_scale_format: str = "fp32",
        weight_cache: bool = True,
    ):
        self.model_config: ReferenceModelConfig = model_config_from_hf(hf_config)
        self._specs: dict[str, ParamSpec] = param_specs(self.model_config)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; valid names: {sorted(KV_CACHE_DTYPES)}")
        self.kv_cache_dtype = kv_cache_dtype
        self.quant_config: ReferenceQuantConfig | None
        if quantization is None:
            manifest = frozenset(fp8_names or ())
            if manifest:
                raise ConfigError(
                    f"fp8_names has {len(manifest)} entries but quantization is None (BF16 engine); pass the FP8 "
                    "quantization_config as well"
                )
            self.quant_config = None
            self.fp8_names: frozenset[str] = frozenset()
        else:
            self.quant_config = quant_config_from_hf(quantization, activation_scale_format=activation_scale_format)
            if fp8_names is None:
                self.fp8_names = default_fp8_names(self._specs, self.quant_config)
            else:
                self.fp8_names = check_fp8_names(self._specs, fp8_names, self.quant_config)
        self._tensors: dict[str, torch.Tensor] = {}
        for name, spec in self._specs.items():
            if name in self.fp8_names:
                assert self.quant_config is not None
                self._tensors[name] = torch.zeros(spec.shape, dtype=FP8_DTYPE)
                self._tensors[name + SCALE_SUFFIX] = torch.ones(
                    scale_shape(spec.shape, self.quant_config.block_size), dtype=torch.float32
                )
            else:
                self._tensors[name] = torch.zeros(spec.shape, dtype=torch.bfloat16)
        self._kv_scale_names = kv_scale_names(self.model_config)
        for name in self._kv_scale_names:
            self._tensors[name] = torch.ones((), dtype=torch.float32)  # vLLM's default k/v/q scale
        self._loaded: set[str] = set()
        self._version = 0
        self._weight_cache = weight_cache
        self._f64: dict[str, torch.Tensor] = {}
        hd = self.model_config.head_dim
        self._inv_freq = 1.0 / (self.model_config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        logger.info(
            "reference FP8 engine (CPU emulator of vLLM W8A8 blockwise, not a server): %s, %d FP8 weights of %d, "
            "kv_cache_dtype=%s",
            self.model_config.model_type,
            len(self.fp8_names),
            len(self._specs),
            kv_cache_dtype,
        )

    # ------------------------------------------------------------------ weights

    @property
    def version(self) -> int:
        """Number of updates committed so far (0 before the first load)."""
        return self._version

    def expected_names(self) -> list[str]:
        """Every name the stream may carry: weights, ``_scale_inv`` of FP8 weights, KV scales."""
        out: list[str] = []
        for name in self._specs:
            out.append(name)
            if name in self.fp8_names:
                out.append(name + SCALE_SUFFIX)
        return out + list(self._kv_scale_names)

    def missing_weights(self) -> list[str]:
        """Weights never loaded so far (KV scales default to 1.0 and are never missing)."""
        return [n for n in self._specs if n not in self._loaded]

    def _stream_error(self, name: str, message: str) -> WeightStreamError:
        return WeightStreamError(f"weight stream item {name!r}: {message}; nothing was applied", name=name)

    def _check_float(self, name: str, t: torch.Tensor, shape: tuple[int, ...], held: str) -> None:
        if t.dtype not in FLOAT_INPUT_DTYPES:
            raise self._stream_error(
                name,
                f"expected a bfloat16 (or float16/float32) tensor because the engine holds it in {held}, got {t.dtype}",
            )
        if tuple(t.shape) != shape:
            raise self._stream_error(name, f"expected shape {shape}, got {tuple(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise self._stream_error(name, "holds NaN or Inf")

    def _stage_fp8(
        self, name: str, t: torch.Tensor, scale: torch.Tensor | None, spec: ParamSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.quant_config is not None
        block = self.quant_config.block_size
        s_shape = scale_shape(spec.shape, block)
        if t.dtype == FP8_DTYPE:
            if tuple(t.shape) != spec.shape:
                raise self._stream_error(name, f"expected shape {spec.shape}, got {tuple(t.shape)}")
            if scale is None:
                raise self._stream_error(
                    name,
                    f"an FP8 weight arrived without {name + SCALE_SUFFIX!r} (float32 {s_shape}); send both "
                    "in the same update",
                )
            sname = name + SCALE_SUFFIX
            if scale.dtype != torch.float32 or tuple(scale.shape) != s_shape:
                raise self._stream_error(
                    sname, f"expected float32 {s_shape} block scales, got {scale.dtype} {tuple(scale.shape)}"
                )
            if not bool((torch.isfinite(scale) & (scale > 0)).all()):
                raise self._stream_error(sname, "block scales must be finite and > 0 (zero blocks use 1.0)")
            if bool(torch.isnan(t.to(torch.float32)).any()):
                raise self._stream_error(name, "FP8 weight holds NaN codes")
            return t.detach().clone(), scale.detach().clone()
        if scale is not None:
            raise self._stream_error(
                name + SCALE_SUFFIX,
                f"block scales arrived with a {t.dtype} weight; send scales only with an "
                "FP8 weight (a BF16 weight is quantized on arrival)",
            )
        self._check_float(name, t, spec.shape, "FP8 (quantized on arrival)")
        q, s = quantize_blockwise(t.detach(), block_size=block, name=name, backend="torch")
        return q, s

    def stage(self, items: Iterable[tuple[str, torch.Tensor]]) -> StagedUpdate:
        """Validate a weight stream completely and prepare the new tensors, changing nothing.

        Args:
            items: ``(name, tensor)`` pairs as vLLM's ``load_weights`` receives them.
                FP8 names: float8_e4m3fn ``[N, K]`` plus ``name + "_scale_inv"``
                float32 ``[ceil(N/128), ceil(K/128)]``, or a bfloat16/float16/float32
                ``[N, K]`` tensor (quantized here). Other weights: bfloat16 (float16 /
                float32 are cast). KV scales (``...self_attn.attn.{q,k,v}_scale`` or
                the checkpoint spelling ``...self_attn.{q,k,v}_scale``): float32, one
                element, finite and > 0. With tied embeddings ``lm_head.weight`` is
                skipped, as vLLM does.

        Returns:
            an open :class:`StagedUpdate`.

        Raises:
            WeightStreamError: unknown or duplicate name, wrong dtype or shape,
                FP8 weight without scales (or scales without weight), non-finite
                values; the message names the tensor, what was expected and what came.
        """
        received: dict[str, torch.Tensor] = {}
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                raise self._stream_error(name, f"expected a torch.Tensor, got {type(tensor).__name__}")
            canon = canonical_kv_scale_name(name)
            if canon in received:
                raise self._stream_error(name, "appears twice in one update")
            received[canon] = tensor
        if self.model_config.tie_word_embeddings and received.pop("lm_head.weight", None) is not None:
            logger.debug("tie_word_embeddings: skipping lm_head.weight (vLLM does the same)")
        updates: dict[str, torch.Tensor] = {}
        kv_names = set(self._kv_scale_names)
        for name, t in received.items():
            if name in kv_names:
                if not t.is_floating_point() or t.dtype == FP8_DTYPE or t.numel() != 1:
                    raise self._stream_error(
                        name, f"expected a float32 scalar KV-cache scale, got {t.dtype} {tuple(t.shape)}"
                    )
                value = t.detach().to(torch.float32).reshape(())
                if not (math.isfinite(float(value)) and float(value) > 0):
                    raise self._stream_error(name, f"KV-cache scale must be finite and > 0, got {float(value)}")
                updates[name] = value
            elif name.endswith(SCALE_SUFFIX):
                base = name[: -len(SCALE_SUFFIX)]
                if base in self.fp8_names:
                    if base not in received:
                        raise self._stream_error(name, f"block scales arrived without their weight {base!r}")
                    continue  # handled with its weight
                if base in self._specs:
                    raise self._stream_error(
                        name,
                        f"{base!r} is held in BF16 (not in this engine's FP8 manifest); the sender's manifest "
                        "is stale: rebuild it from this engine",
                    )
                raise self._stream_error(name, "unknown tensor: no such weight in this model")
            elif name in self._specs:
                spec = self._specs[name]
                if name in self.fp8_names:
                    q, s = self._stage_fp8(name, t, received.get(name + SCALE_SUFFIX), spec)
                    updates[name], updates[name + SCALE_SUFFIX] = q, s
                else:
                    if t.dtype == FP8_DTYPE:
                        raise self._stream_error(
                            name,
                            "arrived in FP8 but the engine holds it in BF16 (not in its FP8 manifest); the "
                            "sender's manifest is stale: rebuild it from this engine",
                        )
                    self._check_float(name, t, spec.shape, "BF16")
                    updates[name] = t.detach().to(torch.bfloat16)
            else:
                raise self._stream_error(
                    name,
                    f"unknown tensor: not a weight, FP8 scale or KV scale of this {self.model_config.model_type} "
                    "model (vLLM would reject it too)",
                )
        return StagedUpdate(engine_id=id(self), version=self._version, updates=updates, names=frozenset(received))

    def commit(self, staged: StagedUpdate) -> frozenset[str]:
        """Apply a staged update in place (``copy_`` into the stored tensors).

        Returns:
            the weight names (not scales) that were updated.

        Raises:
            RefitError: the update belongs to another engine, was already
                committed or aborted, or another update was committed after it
                was staged (stage again).
        """
        if staged._engine_id != id(self):
            raise RefitError("commit: this StagedUpdate was staged by another engine")
        if staged.state != "open":
            raise RefitError(f"commit: this StagedUpdate is already {staged.state}")
        if staged._version != self._version:
            raise RefitError(
                f"commit: staged at engine version {staged._version} but the engine is at {self._version}; stage again"
            )
        self._f64.clear()
        with torch.no_grad():
            for name, value in staged._updates.items():
                self._tensors[name].copy_(value)
        weights = frozenset(n for n in staged._updates if n in self._specs)
        self._loaded |= weights
        self._version += 1
        staged.state = "committed"
        staged._updates = {}
        logger.debug("reference engine: committed %d tensors (version %d)", len(staged.names), self._version)
        return weights

    def abort(self, staged: StagedUpdate) -> None:
        """Drop a staged update without applying it (idempotent for aborted updates)."""
        if staged.state == "committed":
            raise RefitError("abort: this StagedUpdate was already committed")
        staged.state = "aborted"
        staged._updates = {}

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
        for name in self.expected_names():
            yield name, self._tensors[name]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of everything :meth:`named_weights` yields."""
        return {n: t.clone() for n, t in self.named_weights()}

    # --------------------------------------------------------------- checkpoints

    @classmethod
    def from_hf_checkpoint(
        cls,
        path: str | Path,
        *,
        quantization: Mapping[str, Any] | None | str = "auto",
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
        from safetensors import safe_open

        folder = Path(path)
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{folder}: no config.json; expected a Hugging Face checkpoint folder")
        cfg = json.loads(cfg_path.read_text())
        if quantization == "auto":
            quantization = cfg.get("quantization_config")
        elif isinstance(quantization, str):
            raise ConfigError(f"quantization={quantization!r}; valid values: 'auto', a quantization_config dict, None")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{folder}: no *.safetensors files")
        engine = cls(
            cfg,
            quantization=quantization,
            fp8_names=fp8_names,
            kv_cache_dtype=kv_cache_dtype,
            activation_scale_format=activation_scale_format,
            weight_cache=weight_cache,
        )

        def items() -> Iterator[tuple[str, torch.Tensor]]:
            for f in files:
                with safe_open(str(f), framework="pt") as handle:
                    for key in handle.keys():
                        yield key, handle.get_tensor(key)

        engine.load_weights(items())
        missing = engine.missing_weights()
        if missing:
            raise ConfigError(f"{folder}: checkpoint lacks {len(missing)} weights, e.g. {missing[:4]}")
        return engine

    def save_fp8_checkpoint(self, path: str | Path) -> Path:
        """Write an FP8 HF checkpoint (``config.json`` + ``model.safetensors``) that :meth:`from_hf_checkpoint` loads.

        FP8 weights are saved as float8_e4m3fn with ``weight_scale_inv``, other
        weights in bfloat16, the KV scales under ``...self_attn.attn.{q,k,v}_scale``;
        ``config.json`` gets a ``quantization_config`` whose ``ignored_layers``
        reproduce this engine's FP8 manifest.

        Returns:
            the checkpoint folder.

        Raises:
            ConfigError: the engine is BF16 (nothing FP8 to save) or not fully loaded.
        """
        from safetensors.torch import save_file

        if self.quant_config is None:
            raise ConfigError(
                "save_fp8_checkpoint: this engine is BF16 (quantization=None); build it with an FP8 config"
            )
        missing = self.missing_weights()
        if missing:
            raise ConfigError(f"save_fp8_checkpoint: {len(missing)} weights were never loaded, e.g. {missing[:4]}")
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        cfg = {k: v for k, v in self.model_config.raw.items() if k != "quantization_config"}
        quant = self.quant_config.to_hf()
        quant["ignored_layers"] = list(ignored_layers_for(self._specs, self.fp8_names))
        cfg["quantization_config"] = quant
        cfg.setdefault("torch_dtype", "bfloat16")
        tensors = {n: t.detach().clone().contiguous() for n, t in self.named_weights()}
        save_file(tensors, str(folder / _CHECKPOINT_FILE), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
        logger.info("reference engine: saved FP8 checkpoint with %d tensors to %s", len(tensors), folder)
        return folder

    # ------------------------------------------------------------------ forward

    def _w(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def _linear(self, x: torch.Tensor, name: str, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        bias_name = name[: -len("weight")] + "bias"
        bias = self._tensors.get(bias_name)
        if name in self.fp8_names:
            assert self.quant_config is not None
            w64 = self._f64.get(name)
            if w64 is None and self._weight_cache:
                w64 = self._f64[name] = self._tensors[name].to(torch.float64)
            return w8a8_block_fp8_linear(
                x,
                self._tensors[name],
                self._tensors[name + SCALE_SUFFIX],
                block_size=self.quant_config.block_size,
                bias=bias,
                activation_scale_format=self.quant_config.activation_scale_format,
                out_dtype=out_dtype,
                name=name,
                weight_f64=w64,
            )
        lead = x.shape[:-1]
        y = bf16_linear(x.reshape(-1, x.shape[-1]), self._tensors[name], bias=bias, out_dtype=out_dtype, name=name)
        return y.view(*lead, y.shape[-1])

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freqs = pos.to(torch.float32)[..., None] * self._inv_freq  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(torch.bfloat16).to(torch.float32)[:, :, None, :]
        sin = emb.sin().to(torch.bfloat16).to(torch.float32)[:, :, None, :]
        xf = x.to(torch.float32)
        return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)

    def _cache_write(self, store: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, scale: torch.Tensor) -> None:
        b, t = pos.shape
        bidx = torch.arange(b)[:, None].expand(b, t)
        if store.dtype == FP8_DTYPE:
            values = (values.to(torch.float32) / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        store[bidx, :, pos] = values

    @staticmethod
    def _cache_read(store: torch.Tensor, length: int, scale: torch.Tensor) -> torch.Tensor:
        vals = store[:, :, :length].to(torch.float64)
        if store.dtype == FP8_DTYPE:
            vals = vals * scale.to(torch.float64)
        return vals

    def _attention(self, i: int, x: torch.Tensor, pos: torch.Tensor, cache: _KVCache) -> torch.Tensor:
        cfg = self.model_config
        b, t, _ = x.shape
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        a = f"model.layers.{i}.self_attn"
        q = self._linear(x, f"{a}.q_proj.weight").view(b, t, nh, hd)
        k = self._linear(x, f"{a}.k_proj.weight").view(b, t, nkv, hd)
        v = self._linear(x, f"{a}.v_proj.weight").view(b, t, nkv, hd)
        q = self._rope(_rms_norm(q, self._w(f"{a}.q_norm.weight"), cfg.rms_norm_eps), pos)
        k = self._rope(_rms_norm(k, self._w(f"{a}.k_norm.weight"), cfg.rms_norm_eps), pos)
        k_scale, v_scale = self._w(f"{a}.attn.k_scale"), self._w(f"{a}.attn.v_scale")
        self._cache_write(cache.k[i], k, pos, k_scale)
        self._cache_write(cache.v[i], v, pos, v_scale)
        length = int(pos.max()) + 1
        keys = self._cache_read(cache.k[i], length, k_scale).repeat_interleave(nh // nkv, dim=1)  # [B, nh, S, hd]
        vals = self._cache_read(cache.v[i], length, v_scale).repeat_interleave(nh // nkv, dim=1)
        scores = q.to(torch.float64).transpose(1, 2) @ keys.transpose(2, 3) * (hd**-0.5)  # [B, nh, T, S]
        allowed = torch.arange(length)[None, None, :] <= pos[:, :, None]  # [B, T, S]
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ vals  # [B, nh, T, hd]
        out = out.transpose(1, 2).reshape(b, t, nh * hd).to(torch.bfloat16)
        return self._linear(out, f"{a}.o_proj.weight")

    def _mlp(self, prefix: str, x: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        g = self._linear(x, f"{prefix}.gate_proj.weight")
        u = self._linear(x, f"{prefix}.up_proj.weight")
        act = (torch.nn.functional.silu(g.to(torch.float32)) * u.to(torch.float32)).to(torch.bfloat16)
        return self._linear(act, f"{prefix}.down_proj.weight", out_dtype=out_dtype)

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg = self.model_config
        lead, h = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, h)
        router_logits = self._linear(x2, f"model.layers.{i}.mlp.gate.weight")  # bf16 [M, E]
        probs = torch.softmax(router_logits.to(torch.float32), dim=-1)
        top_w, top_i = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
        if cfg.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = torch.zeros((x2.shape[0], h), dtype=torch.float32)
        for e in range(cfg.num_experts):
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self._mlp(f"model.layers.{i}.mlp.experts.{e}", x2[rows], out_dtype=torch.float32)
            out.index_add_(0, rows, (y * top_w[rows, slot, None]).to(torch.bfloat16).to(torch.float32))
        return out.to(torch.bfloat16).view(*lead, h)

    def _hidden(self, ids: torch.Tensor, pos: torch.Tensor, cache: _KVCache) -> torch.Tensor:
        cfg = self.model_config
        h = self._w("model.embed_tokens.weight")[ids]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            h = h + self._attention(
                i, _rms_norm(h, self._w(f"{p}.input_layernorm.weight"), cfg.rms_norm_eps), pos, cache
            )
            x = _rms_norm(h, self._w(f"{p}.post_attention_layernorm.weight"), cfg.rms_norm_eps)
            h = h + (self._moe(i, x) if cfg.is_moe_layer(i) else self._mlp(f"{p}.mlp", x))
        return _rms_norm(h, self._w("model.norm.weight"), cfg.rms_norm_eps)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        name = "model.embed_tokens.weight" if self.model_config.tie_word_embeddings else "lm_head.weight"
        return self._linear(hidden, name)

    def _check_ready(self, seqs: list[list[int]], extra: int, what: str) -> None:
        missing = self.missing_weights()
        if missing:
            raise ConfigError(
                f"{what}: {len(missing)} weights were never loaded (e.g. {missing[:3]}); call load_weights or "
                "from_hf_checkpoint first"
            )
        vocab = self.model_config.vocab_size
        for j, s in enumerate(seqs):
            if not s:
                raise ConfigError(f"{what}: sequence {j} is empty")
            bad = [tok for tok in s if not 0 <= tok < vocab]
            if bad:
                raise ConfigError(f"{what}: sequence {j} has token ids {bad[:4]} outside [0, {vocab})")
            if len(s) + extra > self.model_config.max_position_embeddings:
                raise ConfigError(
                    f"{what}: sequence {j} needs {len(s) + extra} positions, max_position_embeddings is "
                    f"{self.model_config.max_position_embeddings}"
                )

    def _prefill(self, seqs: list[list[int]], cache_len: int) -> tuple[torch.Tensor, _KVCache]:
        lens = [len(s) for s in seqs]
        t = max(lens)
        ids = torch.zeros((len(seqs), t), dtype=torch.long)
        for j, s in enumerate(seqs):
            ids[j, : len(s)] = torch.tensor(s, dtype=torch.long)
        pos = torch.arange(t)[None, :].expand(len(seqs), t)
        cache = _KVCache(self.model_config, len(seqs), cache_len, KV_CACHE_DTYPES[self.kv_cache_dtype])
        with torch.no_grad():
            return self._hidden(ids, pos, cache), cache

    # ------------------------------------------------------------ generate/score

    @torch.no_grad()
    def score(
        self,
        input_ids: Sequence[Sequence[int]] | torch.Tensor,
        *,
        response_start: int | Sequence[int],
        temperature: float = 1.0,
    ) -> list[torch.Tensor]:
        """Teacher-forced log-probabilities of the response tokens.

        Args:
            input_ids: per sequence, prompt + response token ids (lengths may differ),
                or a ``[B, L]`` tensor.
            response_start: index of the first response token (int for all, or one per
                sequence), at least 1.
            temperature: logits are divided by it before ``log_softmax`` (> 0; use
                1.0 to compare with greedy :meth:`generate`).

        Returns:
            per sequence a float32 tensor ``[len - response_start]``: ``log p(x_t | x_<t)``.
        """
        seqs = _as_token_lists(input_ids, "score")
        starts = [int(response_start)] * len(seqs) if isinstance(response_start, int) else list(response_start)
        if len(starts) != len(seqs):
            raise ConfigError(f"score: {len(starts)} response_start values for {len(seqs)} sequences")
        if not temperature > 0:
            raise ConfigError(f"score: temperature must be > 0, got {temperature}")
        self._check_ready(seqs, 0, "score")
        for j, (s, rs) in enumerate(zip(seqs, starts, strict=True)):
            if not 1 <= rs <= len(s):
                raise ConfigError(f"score: response_start={rs} for sequence {j} of length {len(s)}; need 1..len")
        hidden, _ = self._prefill(seqs, max(len(s) for s in seqs))
        out: list[torch.Tensor] = []
        for j, (s, rs) in enumerate(zip(seqs, starts, strict=True)):
            logits = self._logits(hidden[j, rs - 1 : len(s) - 1]).to(torch.float32) / temperature
            lp = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(s[rs:], dtype=torch.long)
            out.append(lp.gather(1, targets[:, None])[:, 0] if targets.numel() else lp.new_zeros(0))
        return out

    @staticmethod
    def _pick(
        logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lf = logits.to(torch.float32)
        if temperature == 0.0:
            tok = lf.argmax(dim=-1)
            return tok, torch.log_softmax(lf, dim=-1).gather(1, tok[:, None])[:, 0]
        scaled = lf / temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        probs = logprobs.exp()
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1)  # ascending, as vLLM's top-p
            drop = sorted_p.cumsum(dim=-1) <= 1.0 - top_p
            drop[:, -1] = False  # always keep the most likely token
            probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
        assert generators is not None
        toks = []
        for row, g in zip(probs, generators, strict=True):
            noise = torch.empty_like(row).exponential_(generator=g)
            toks.append(int((row / noise).argmax()))  # Gumbel-max in exponential form, as vLLM samples
        tok = torch.tensor(toks, dtype=torch.long)
        return tok, logprobs.gather(1, tok[:, None])[:, 0]

    @torch.no_grad()
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
        """Generate continuations with a batched KV cache.

        Args:
            prompt_token_ids: per sequence the prompt token ids (lengths may differ).
            max_new_tokens: tokens to generate per sequence at most (>= 1).
            temperature: 0.0 for greedy decoding, > 0 to sample from ``softmax(logits / T)``.
            top_p: nucleus sampling mass in (0, 1] (sampling only).
            seed: sequence ``j`` samples from ``torch.Generator().manual_seed(seed + j)``,
                so a result does not depend on the rest of the batch.
            eos_token_id: token id(s) that finish a sequence (kept in the output).

        Returns:
            :class:`GenerationResult`.
        """
        seqs = _as_token_lists(prompt_token_ids, "generate")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if temperature < 0:
            raise ConfigError(f"generate: temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ConfigError(f"generate: top_p must be in (0, 1], got {top_p}")
        eos = (
            set() if eos_token_id is None else ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
        )
        self._check_ready(seqs, max_new_tokens, "generate")
        b = len(seqs)
        lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)
        hidden, cache = self._prefill(seqs, int(lens.max()) + max_new_tokens)
        logits = self._logits(hidden[torch.arange(b), lens - 1])
        generators = [torch.Generator().manual_seed(seed + j) for j in range(b)] if temperature > 0 else None
        tokens: list[list[int]] = [[] for _ in range(b)]
        lps: list[list[float]] = [[] for _ in range(b)]
        reasons: list[str | None] = [None] * b
        for step in range(max_new_tokens):
            tok, lp = self._pick(logits, temperature, top_p, generators)
            for j in range(b):
                if reasons[j] is not None:
                    continue
                tokens[j].append(int(tok[j]))
                lps[j].append(float(lp[j]))
                if int(tok[j]) in eos:
                    reasons[j] = "stop"
                elif len(tokens[j]) == max_new_tokens:
                    reasons[j] = "length"
            if all(r is not None for r in reasons):
                break
            pos = (lens + step)[:, None]
            logits = self._logits(self._hidden(tok[:, None], pos, cache)[:, 0])
        return GenerationResult(
            token_ids=tuple(tuple(t) for t in tokens),
            logprobs=tuple(torch.tensor(v, dtype=torch.float32) for v in lps),
            finish_reasons=tuple(r or "length" for r in reasons),
        )


__all__ = [
    "FINISH_REASONS",
    "KV_CACHE_DTYPES",
    "GenerationResult",
    "ReferenceFP8Engine",
    "StagedUpdate",
]
