"""Weight store of the reference FP8 engine: what it holds, and how a refit version gets in.

Part of :mod:`megatron_fp8.rollout.reference`, an emulator and oracle of vLLM's
FP8 W8A8 blockwise numerics for CPU machines; NOT a serving engine (on GPU use vLLM).

:class:`WeightStore` turns the parameter specs of a model into held tensors
keyed by unfused HF name: FP8 weights (the manifest ``fp8_names``) as
float8_e4m3fn ``[N, K]`` plus float32 block ``scale_inv``
``[ceil(N/bn), ceil(K/bk)]``, everything else as bfloat16, and one float32
scalar KV-cache scale per layer and kind (default 1.0). A refit version goes
in as a whole: :meth:`WeightStore.stage` validates the complete stream and
prepares the new tensors without touching anything; :meth:`WeightStore.commit`
copies them into the held tensors in place (``copy_``, never rebinding);
:meth:`WeightStore.abort` drops them. :meth:`WeightStore.snapshot` /
:meth:`WeightStore.restore` copy out and back the tensors a commit will overwrite
(the refit applier's rollback). :func:`read_hf_config`,
:func:`safetensors_files`, :func:`checkpoint_items` and
:func:`save_fp8_checkpoint` read and write HF safetensors checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_fp8.errors import ConfigError, RefitError, WeightStreamError
from megatron_fp8.quant import quantize_blockwise
from megatron_fp8.quant.formats import FLOAT_INPUT_DTYPES, FP8_DTYPE
from megatron_fp8.rollout.reference.config import (
    JsonMapping,
    ParamSpec,
    ReferenceModelConfig,
    ReferenceQuantConfig,
    canonical_kv_scale_name,
    check_fp8_names,
    default_fp8_names,
    ignored_layers_for,
    kv_scale_names,
    param_specs,
    quant_config_from_hf,
    scale_shape,
)
from megatron_fp8.vocab import SCALE_SUFFIX

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "model.safetensors"
"""File name :func:`save_fp8_checkpoint` writes (one unsharded safetensors file)."""


class StagedUpdate:
    """A validated, not yet applied weight update (reference FP8 engine: a CPU emulator and oracle of
    vLLM's FP8 W8A8 blockwise numerics, NOT a serving engine; on GPU use vLLM).

    Produced by :meth:`WeightStore.stage` (``ReferenceFP8Engine.stage``); apply it with
    :meth:`WeightStore.commit` or drop it with :meth:`WeightStore.abort`.

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

    @property
    def targets(self) -> frozenset[str]:
        """The stored tensors a commit of this update overwrites (weights, ``_scale_inv``, KV scales)."""
        return frozenset(self._updates)


class WeightSnapshot:
    """Copies of some stored tensors and the store's version, taken before a commit to restore it on failure.

    Made by :meth:`WeightStore.snapshot`; memory: the bytes of the copied tensors (CPU).

    Attributes:
        version: the store's version when taken.
        tensors: name -> a private copy of the stored tensor.
        nbytes: total bytes of the copies.
    """

    __slots__ = ("_engine_id", "_loaded", "nbytes", "tensors", "version")

    def __init__(self, *, engine_id: int, version: int, loaded: frozenset[str], tensors: dict[str, torch.Tensor]):
        self._engine_id = engine_id
        self._loaded = loaded
        self.version = version
        self.tensors = tensors
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors.values())


class WeightStore:
    """The tensors a reference FP8 engine holds, updated one whole refit version at a time.

    Args:
        model_config: the model (decides the parameter specs and KV scales).
        quantization: vLLM's FP8 ``quantization_config`` dict, or ``None`` for BF16.
        fp8_names: the FP8 manifest; ``None`` derives it from ``ignored_layers``
            as vLLM does. Must be empty without quantization.
        activation_scale_format: ``"fp32"`` or ``"ue8m0"`` activation scales.
        weight_cache: keep a float64 copy of each FP8 weight between forward
            passes (see :meth:`weight_f64`), dropped at every commit.

    Raises:
        ConfigError: unsupported quantization, or ``fp8_names`` without quantization.
        ManifestError: an ``fp8_names`` entry that vLLM would not hold in FP8.

    Attributes:
        model_config: the model.
        specs: every weight (not scales) keyed by unfused HF name, in checkpoint order.
        quant_config: the FP8 quantization, or ``None`` for a BF16 engine.
        fp8_names: the FP8 manifest.
        tensors: the live storage, name -> tensor (weights, ``_scale_inv``, KV
            scales); only :meth:`commit` writes it, in place.
        kv_scale_names: the float32 KV-cache scale names, per layer ``q``, ``k``, ``v``.
    """

    def __init__(
        self,
        model_config: ReferenceModelConfig,
        *,
        quantization: JsonMapping | None,
        fp8_names: Iterable[str] | None,
        activation_scale_format: str,
        weight_cache: bool,
    ):
        self.model_config = model_config
        self.specs: dict[str, ParamSpec] = param_specs(model_config)
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
                self.fp8_names = default_fp8_names(self.specs, self.quant_config)
            else:
                self.fp8_names = check_fp8_names(self.specs, fp8_names, self.quant_config)
        self.tensors: dict[str, torch.Tensor] = {}
        for name, spec in self.specs.items():
            if name in self.fp8_names:
                assert self.quant_config is not None
                self.tensors[name] = torch.zeros(spec.shape, dtype=FP8_DTYPE)
                self.tensors[name + SCALE_SUFFIX] = torch.ones(
                    scale_shape(spec.shape, self.quant_config.block_size), dtype=torch.float32
                )
            else:
                self.tensors[name] = torch.zeros(spec.shape, dtype=torch.bfloat16)
        self.kv_scale_names: list[str] = kv_scale_names(model_config)
        for name in self.kv_scale_names:
            self.tensors[name] = torch.ones((), dtype=torch.float32)  # vLLM's default k/v/q scale
        self._loaded: set[str] = set()
        self._version = 0
        self._weight_cache = weight_cache
        self._f64: dict[str, torch.Tensor] = {}

    @property
    def version(self) -> int:
        """Number of updates committed so far (0 before the first load)."""
        return self._version

    def expected_names(self) -> list[str]:
        """Every name the stream may carry: weights, ``_scale_inv`` of FP8 weights, KV scales."""
        out: list[str] = []
        for name in self.specs:
            out.append(name)
            if name in self.fp8_names:
                out.append(name + SCALE_SUFFIX)
        return out + list(self.kv_scale_names)

    def missing_weights(self) -> list[str]:
        """Weights never loaded so far (KV scales default to 1.0 and are never missing)."""
        return [n for n in self.specs if n not in self._loaded]

    def weight_f64(self, name: str) -> torch.Tensor | None:
        """The cached float64 copy of FP8 weight ``name`` (made on first use), or ``None`` without the cache."""
        w64 = self._f64.get(name)
        if w64 is None and self._weight_cache:
            w64 = self._f64[name] = self.tensors[name].to(torch.float64)
        return w64

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

    def _stage_kv_scale(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == FP8_DTYPE or t.numel() != 1:
            raise self._stream_error(name, f"expected a float32 scalar KV-cache scale, got {t.dtype} {tuple(t.shape)}")
        value = t.detach().to(torch.float32).reshape(())
        if not (math.isfinite(float(value)) and float(value) > 0):
            raise self._stream_error(name, f"KV-cache scale must be finite and > 0, got {float(value)}")
        return value

    def _check_scale_name(self, name: str, received: dict[str, torch.Tensor]) -> None:
        base = name[: -len(SCALE_SUFFIX)]
        if base in self.fp8_names:
            if base not in received:
                raise self._stream_error(name, f"block scales arrived without their weight {base!r}")
            return  # handled with its weight
        if base in self.specs:
            raise self._stream_error(
                name,
                f"{base!r} is held in BF16 (not in this engine's FP8 manifest); the sender's manifest "
                "is stale: rebuild it from this engine",
            )
        raise self._stream_error(name, "unknown tensor: no such weight in this model")

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
        kv_names = set(self.kv_scale_names)
        for name, t in received.items():
            if name in kv_names:
                updates[name] = self._stage_kv_scale(name, t)
            elif name.endswith(SCALE_SUFFIX):
                self._check_scale_name(name, received)
            elif name in self.specs:
                spec = self.specs[name]
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
                self.tensors[name].copy_(value)
        weights = frozenset(n for n in staged._updates if n in self.specs)
        self._loaded |= weights
        self._version += 1
        staged.state = "committed"
        staged._updates = {}
        logger.debug("reference engine: committed %d tensors (version %d)", len(staged.names), self._version)
        return weights

    def snapshot(self, names: Iterable[str]) -> WeightSnapshot:
        """Copies of the stored tensors ``names`` (e.g. :attr:`StagedUpdate.targets`) and the version counter.

        Raises:
            RefitError: an unknown name.
        """
        names = list(names)
        unknown = [n for n in names if n not in self.tensors]
        if unknown:
            raise RefitError(f"snapshot: {unknown[:5]} are not stored tensors of this engine")
        copies = {n: self.tensors[n].detach().clone() for n in names}
        return WeightSnapshot(engine_id=id(self), version=self._version, loaded=frozenset(self._loaded), tensors=copies)

    def restore(self, snap: WeightSnapshot) -> None:
        """Copy a snapshot back in place (``copy_``, never rebinding) and reset the version counter to its version.

        Raises:
            RefitError: the snapshot belongs to another engine.
        """
        if snap._engine_id != id(self):
            raise RefitError("restore: this WeightSnapshot was taken of another engine")
        self._f64.clear()
        with torch.no_grad():
            for name, value in snap.tensors.items():
                self.tensors[name].copy_(value)
        self._loaded = set(snap._loaded)
        self._version = snap.version
        logger.debug("reference engine: restored %d tensors (version %d)", len(snap.tensors), self._version)

    def abort(self, staged: StagedUpdate) -> None:
        """Drop a staged update without applying it (idempotent for aborted updates)."""
        if staged.state == "committed":
            raise RefitError("abort: this StagedUpdate was already committed")
        staged.state = "aborted"
        staged._updates = {}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stored tensors, live (do not modify), in stream format and checkpoint order.

        Yields ``(name, tensor)``: FP8 weights as float8_e4m3fn followed by their
        ``_scale_inv``, BF16 weights, then the float32 KV scales.
        """
        for name in self.expected_names():
            yield name, self.tensors[name]


# ----------------------------------------------------------------------------- checkpoints


def read_hf_config(folder: Path) -> JsonMapping:
    """The parsed ``config.json`` of an HF checkpoint folder.

    Raises:
        ConfigError: the folder has no ``config.json``.
    """
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{folder}: no config.json; expected a Hugging Face checkpoint folder")
    return json.loads(cfg_path.read_text())


def safetensors_files(folder: Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint folder, sorted (sharded with an index or not).

    Raises:
        ConfigError: there are none.
    """
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder}: no *.safetensors files")
    return files


def checkpoint_items(files: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of the given safetensors files, file by file, as stored."""
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)


def save_fp8_checkpoint(store: WeightStore, path: str | Path) -> Path:
    """Write an FP8 HF checkpoint (``config.json`` + ``model.safetensors``) of a fully loaded store.

    FP8 weights are saved as float8_e4m3fn with ``weight_scale_inv``, other
    weights in bfloat16, the KV scales under ``...self_attn.attn.{q,k,v}_scale``;
    ``config.json`` gets a ``quantization_config`` whose ``ignored_layers``
    reproduce the store's FP8 manifest.

    Returns:
        the checkpoint folder.

    Raises:
        ConfigError: the store is BF16 (nothing FP8 to save) or not fully loaded.
    """
    if store.quant_config is None:
        raise ConfigError("save_fp8_checkpoint: this engine is BF16 (quantization=None); build it with an FP8 config")
    missing = store.missing_weights()
    if missing:
        raise ConfigError(f"save_fp8_checkpoint: {len(missing)} weights were never loaded, e.g. {missing[:4]}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in store.model_config.raw.items() if k != "quantization_config"}
    quant = store.quant_config.to_hf()
    quant["ignored_layers"] = list(ignored_layers_for(store.specs, store.fp8_names))
    cfg["quantization_config"] = quant
    cfg.setdefault("torch_dtype", "bfloat16")
    tensors = {n: t.detach().clone().contiguous() for n, t in store.named_weights()}
    save_file(tensors, str(folder / CHECKPOINT_FILE), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
    logger.info("reference engine: saved FP8 checkpoint with %d tensors to %s", len(tensors), folder)
    return folder
