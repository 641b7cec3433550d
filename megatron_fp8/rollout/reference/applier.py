"""The refit applier of the CPU reference FP8 engine (an emulator and oracle, not a serving engine).

Implements the two-phase :class:`~megatron_fp8.refit.RefitApplier` protocol
(``begin`` / ``stage`` / ``commit`` / ``abort``) with the guarantees of
:mod:`megatron_fp8.refit.applier`:

* **complete by default**: a version carries every weight of the engine, the
  ``_scale_inv`` of each FP8-manifest weight sent in FP8 (a BF16 tensor for an
  FP8 name is quantized on arrival and comes without scales), and, for an
  engine with an FP8 KV cache, either every KV-cache scale (``q``, ``k``, ``v``
  of every layer) or none (the engine keeps its scales). An engine with a BF16
  KV cache reads no KV scales and refuses them. ``lm_head.weight`` is accepted
  and skipped under tied embeddings. ``partial=True`` accepts a subset;
* **validated before the first write**: names, shapes, dtypes and the block
  grid of every scale from the metadata in :meth:`~ReferenceEngineApplier.begin`;
  scale values (zero, negative, NaN, Inf) in :meth:`~ReferenceEngineApplier.stage`;
  the whole stream again by the engine (:meth:`ReferenceFP8Engine.stage`) in
  ``commit`` before it writes;
* **never serves a failed version**: ``commit`` copies the tensors it is about
  to overwrite (:meth:`ReferenceFP8Engine.snapshot`), and restores them and the
  version counter on any failure after the first write (a mid-copy exception, a
  verification mismatch), raising :class:`~megatron_fp8.errors.RefitRolledBackError`;
  if the restore fails too, :attr:`~ReferenceEngineApplier.serving` turns
  ``False`` and the rollout path refuses to generate until a version commits;
* **exact verification**: after commit, every tensor is compared byte for byte
  with what was sent (a BF16 tensor for an FP8 slot with a deterministic
  re-quantization of it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from megatron_fp8.errors import EngineNotServingError, RefitError, RefitRolledBackError, WeightStreamError
from megatron_fp8.quant import dequantize_blockwise, quantize_blockwise
from megatron_fp8.quant.formats import FLOAT_INPUT_DTYPES, FP8_DTYPE, KV_CACHE_DTYPES
from megatron_fp8.refit.applier import check_complete, check_scale_values, first_byte_mismatch, name_list
from megatron_fp8.refit.verify import VerifyReport, relative_error
from megatron_fp8.refit.wire import TensorMeta, torch_dtype
from megatron_fp8.rollout.reference.config import canonical_kv_scale_name, scale_shape
from megatron_fp8.rollout.reference.engine import ReferenceFP8Engine
from megatron_fp8.rollout.reference.weights import WeightSnapshot
from megatron_fp8.vocab import SCALE_SUFFIX

logger = logging.getLogger(__name__)

_FP8_WEIGHT, _BLOCK_SCALE, _BF16, _KV_SCALE, _TIED = "fp8_weight", "block_scale", "bf16", "kv_scale", "tied"


@dataclasses.dataclass(frozen=True)
class _Slot:
    """What the engine expects under one stream name: its shape and its kind (one of the ``_*`` kinds above)."""

    shape: tuple[int, ...]
    kind: str


class ReferenceEngineApplier:
    """Applies refits to a :class:`~megatron_fp8.rollout.reference.engine.ReferenceFP8Engine`.

    Args:
        engine: the reference engine.
        verify: compare every tensor byte for byte with what was sent after each commit.
        block_size: FP8 weight block ``(bn, bk)``; ``None``: the engine's.
        partial: accept a version that carries a subset of what the engine expects.

    Attributes:
        engine: the engine.
        serving_version: the last version committed and verified (0: the checkpoint).
        last_verify: the report of the last verification, or ``None``.
        last_snapshot_bytes: bytes of the rollback copies the last commit held (CPU memory, freed after it).
        not_serving_reason: why :attr:`serving` is ``False``, else ``None``.
        last_prefix_cache: ``"no_cache"``: the reference engine keeps no KV blocks across requests, so a
            refit has no prefix cache to retire (:data:`megatron_fp8.vocab.PREFIX_CACHE_RESETS`).
    """

    def __init__(
        self,
        engine: ReferenceFP8Engine,
        *,
        verify: bool = True,
        block_size: tuple[int, int] | None = None,
        partial: bool = False,
    ):
        self.engine = engine
        self.verify_enabled = verify
        quant = engine.quant_config
        self.block_size = block_size or (quant.block_size if quant is not None else (128, 128))
        self.partial = partial
        self.last_verify: VerifyReport | None = None
        self.serving_version: int = 0
        self.last_snapshot_bytes = 0
        self.not_serving_reason: str | None = None
        self.last_prefix_cache: str | None = "no_cache"
        self.fp8_kv_cache = KV_CACHE_DTYPES[engine.kv_cache_dtype] == FP8_DTYPE
        self._slots = self._expected_slots()
        self._version: int | None = None
        self._metas: dict[str, TensorMeta] = {}
        self._items: dict[str, torch.Tensor] = {}

    @property
    def serving(self) -> bool:
        """Whether the engine holds a good (committed, verified or restored) version."""
        return self.not_serving_reason is None

    # ------------------------------------------------------------------ expected set

    def _expected_slots(self) -> dict[str, _Slot]:
        store = self.engine.weights
        slots: dict[str, _Slot] = {}
        for name, spec in store.specs.items():
            if name in store.fp8_names:
                slots[name] = _Slot(spec.shape, _FP8_WEIGHT)
                slots[name + SCALE_SUFFIX] = _Slot(scale_shape(spec.shape, self.block_size), _BLOCK_SCALE)
            else:
                slots[name] = _Slot(spec.shape, _BF16)
        if self.fp8_kv_cache:
            for name in store.kv_scale_names:
                slots[name] = _Slot((), _KV_SCALE)
        cfg = store.model_config
        if cfg.tie_word_embeddings and "lm_head.weight" not in slots:
            slots["lm_head.weight"] = _Slot((cfg.vocab_size, cfg.hidden_size), _TIED)
        return slots

    def expected_names(self, *, with_kv_scales: bool = True) -> list[str]:
        """The names a complete version carries when every FP8 weight is sent in FP8 (KV scales: see module doc)."""
        return [
            n
            for n, s in self._slots.items()
            if s.kind in (_FP8_WEIGHT, _BLOCK_SCALE, _BF16) or (s.kind == _KV_SCALE and with_kv_scales)
        ]

    def _extra_hint(self, announced: dict[str, torch.dtype]) -> str:
        hint = (
            "check the HF name mapping, and the FP8 manifest (a '_scale_inv' of a weight this engine holds in BF16 "
            "means the sender's manifest is stale: rebuild it from this engine)"
        )
        kv = sorted(n for n in announced if n in self.engine.weights.kv_scale_names)
        if kv and not self.fp8_kv_cache:
            hint += (
                f"; {len(kv)} of them are KV-cache scales, which only an engine with an FP8 KV cache reads (this one "
                f"has kv_cache_dtype={self.engine.kv_cache_dtype!r}): check the KV-cache dtype of trainer and engine"
            )
        return hint

    # ------------------------------------------------------------------ begin / stage

    def begin(self, version: int, metas: Sequence[TensorMeta]) -> None:
        """Check the whole version against the engine from its metadata; write nothing.

        Raises:
            WeightStreamError: a name announced twice, unknown or missing tensors (counts and first
                names), partial KV scales, a wrong shape or dtype, a block scale of the wrong grid;
                the message names the tensor, the expected and received layout and what to check.
        """
        self._reset()
        announced: dict[str, TensorMeta] = {}
        dtypes: dict[str, torch.dtype] = {}
        for m in metas:
            canon = canonical_kv_scale_name(m.name)
            if canon in announced:
                raise WeightStreamError(
                    f"refit version {version}: tensor {m.name!r} announced twice; nothing applied", name=m.name
                )
            announced[canon] = m
            dtypes[canon] = torch_dtype(m.dtype, tensor_name=m.name)
        required = [
            n
            for n, s in self._slots.items()
            if s.kind in (_FP8_WEIGHT, _BF16)
            or (s.kind == _BLOCK_SCALE and dtypes.get(n[: -len(SCALE_SUFFIX)], FP8_DTYPE) == FP8_DTYPE)
        ]
        check_complete(
            version,
            announced,
            required=required,
            allowed=self._slots,
            partial=self.partial,
            extra_hint=self._extra_hint(dtypes),
        )
        self._check_kv_all_or_none(version, announced)
        for canon, m in announced.items():
            self._check_layout(version, canon, m.name, tuple(m.shape), dtypes[canon], dtypes)
        self._version, self._metas = version, announced

    def _check_kv_all_or_none(self, version: int, announced: dict[str, TensorMeta]) -> None:
        if self.partial or not self.fp8_kv_cache:
            return
        kv_names = self.engine.weights.kv_scale_names
        missing = [n for n in kv_names if n not in announced]
        if 0 < len(missing) < len(kv_names):
            raise WeightStreamError(
                f"refit version {version} refused, nothing applied: it carries {len(kv_names) - len(missing)} of the "
                f"{len(kv_names)} KV-cache scales, missing {name_list(missing)}; a version sends every layer's q, k "
                "and v scale or none (the engine keeps its scales): check that the KV calibration recorded every "
                "layer",
                name=missing[0],
            )

    def _layout_error(self, version: int, name: str, expected: str, got: str, check: str) -> WeightStreamError:
        return WeightStreamError(
            f"refit tensor {name!r} of version {version}: expected {expected}, got {got}; {check}; nothing applied",
            name=name,
        )

    def _check_layout(
        self,
        version: int,
        canon: str,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        dtypes: dict[str, torch.dtype],
    ) -> None:
        slot = self._slots[canon]
        got = f"{shape} {dtype}"
        mapping = "check the export's HF name mapping and TP gather against this model"
        if slot.kind in (_FP8_WEIGHT, _BF16, _TIED):
            fp8 = slot.kind == _FP8_WEIGHT
            allowed = "float8_e4m3fn (with block scales) or bfloat16/float16/float32" if fp8 else "bfloat16"
            if dtype == FP8_DTYPE and not fp8:
                raise self._layout_error(
                    version,
                    name,
                    f"{slot.shape} bfloat16 (the engine holds it in BF16: not in its FP8 manifest)",
                    got,
                    "the sender's FP8 manifest is stale: rebuild it from this engine",
                )
            if dtype != FP8_DTYPE and dtype not in FLOAT_INPUT_DTYPES:
                raise self._layout_error(version, name, f"{slot.shape} {allowed}", got, "check the export's dtypes")
            if shape != slot.shape:
                raise self._layout_error(version, name, f"{slot.shape} {allowed}", got, mapping)
            if fp8 and dtype == FP8_DTYPE and canon + SCALE_SUFFIX not in dtypes:  # a partial version
                raise self._layout_error(
                    version,
                    name + SCALE_SUFFIX,
                    f"float32 {self._slots[canon + SCALE_SUFFIX].shape} block scales with the FP8 weight",
                    "none",
                    "an FP8 weight and its scales travel in the same version",
                )
            if fp8 and dtype != FP8_DTYPE and canon + SCALE_SUFFIX in dtypes:
                raise self._layout_error(
                    version,
                    name + SCALE_SUFFIX,
                    f"no block scales with a {dtype} weight (quantized on arrival)",
                    "block scales",
                    "send scales only with an FP8 weight",
                )
        elif slot.kind == _BLOCK_SCALE:
            weight = canon[: -len(SCALE_SUFFIX)]
            n, k = self._slots[weight].shape
            bn, bk = self.block_size
            if dtype != torch.float32 or shape != slot.shape:
                raise self._layout_error(
                    version,
                    name,
                    f"float32 {slot.shape} block scales (ceil({n}/{bn}) x ceil({k}/{bk}) blocks of {bn}x{bk})",
                    got,
                    "check that the sender quantizes with the engine's weight_block_size and float32 scale_inv "
                    "(quantization_config), and that the scales belong to this weight",
                )
        elif slot.kind == _KV_SCALE:
            if not dtype.is_floating_point or dtype == FP8_DTYPE or (shape and shape != (1,)):
                raise self._layout_error(
                    version, name, "a float32 scalar KV-cache scale, shape () or (1,)", got, "check the KV calibration"
                )

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        """Check one tensor against its announcement and scale values; keep a private copy (no engine write).

        Raises:
            RefitError: not announced, staged twice, a layout other than announced.
            WeightStreamError: a zero, negative, NaN or Inf block or KV-cache scale.
        """
        if self._version is None:
            raise RefitError(f"stage({name!r}) called before begin()")
        canon = canonical_kv_scale_name(name)
        meta = self._metas.get(canon)
        if meta is None or meta.name != name:
            raise RefitError(f"refit tensor {name!r} was not announced in begin() for version {self._version}")
        if canon in self._items:
            raise RefitError(f"refit tensor {name!r} staged twice in version {self._version}")
        want = torch_dtype(meta.dtype, tensor_name=name)
        if tuple(tensor.shape) != tuple(meta.shape) or tensor.dtype != want:
            raise RefitError(
                f"refit tensor {name!r}: announced {tuple(meta.shape)} {want}, staged {tuple(tensor.shape)} "
                f"{tensor.dtype}; the bucket metadata and payload disagree"
            )
        if self._slots[canon].kind in (_BLOCK_SCALE, _KV_SCALE):
            check_scale_values(name, tensor, version=self._version)
        # the receiver hands views into its bucket buffers: keep our own copies
        self._items[canon] = tensor.detach().clone()

    # ------------------------------------------------------------------ commit / abort

    def commit(self, version: int) -> None:
        """Validate (engine), snapshot, write, verify; roll back on any failure after the first write.

        Raises:
            WeightStreamError: the engine's own validation refused the stream (nothing written).
            RefitRolledBackError: a failure after the first write; the engine holds its last good
                version again, byte for byte, with its version counter unchanged.
            EngineNotServingError: the failure could not be rolled back; :attr:`serving` is ``False``.
        """
        if self._version != version:
            raise RefitError(f"commit({version}) does not match the version begun ({self._version})")
        missing = [self._metas[n].name for n in self._metas if n not in self._items]
        items, self._items = self._items, {}
        self._reset()
        if missing:
            raise RefitError(
                f"commit of version {version}: {len(missing)} announced tensor(s) never staged "
                f"({name_list(missing)}); nothing applied"
            )
        update = self.engine.stage(items.items())  # validates everything; changes nothing
        snap = self.engine.snapshot(update.targets)
        self.last_snapshot_bytes = snap.nbytes
        report: VerifyReport | None = None
        try:
            self.engine.commit(update)
            report = self.verify(version, items) if self.verify_enabled else None
        except Exception as exc:
            self._roll_back(version, snap, exc)
        self.last_verify = report
        self.serving_version = version
        self.not_serving_reason = None

    def _roll_back(self, version: int, snap: WeightSnapshot, exc: Exception) -> None:
        try:
            self.engine.restore(snap)
            held = self.engine.weights.tensors
            bad = [n for n, old in snap.tensors.items() if first_byte_mismatch(held[n], old) is not None]
            if self.engine.version != snap.version:
                bad.append(f"version counter {self.engine.version} != {snap.version}")
        except Exception as restore_exc:
            bad = [f"{type(restore_exc).__name__}: {restore_exc}"]
        if bad:
            self.not_serving_reason = (
                f"refit version {version} failed after its first write ({exc}) and restoring version "
                f"{self.serving_version} failed too ({name_list(bad)})"
            )
            logger.error("reference engine not serving: %s", self.not_serving_reason)
            raise EngineNotServingError(
                self.not_serving_reason + "; the engine serves nothing until a good version commits"
            ) from exc
        logger.warning("refit version %d rolled back to version %d: %s", version, self.serving_version, exc)
        raise RefitRolledBackError(
            f"refit version {version} rolled back: {exc}; the engine holds version {self.serving_version} again "
            f"(restored byte for byte, version counter {snap.version})"
        ) from exc

    def abort(self, version: int, reason: str) -> None:
        """Drop what was staged for ``version``; the engine keeps what it holds."""
        logger.warning("refit v%d aborted before reaching the reference engine: %s", version, reason)
        self._reset()
        self._items = {}

    def _reset(self) -> None:
        self._version, self._metas = None, {}

    # ------------------------------------------------------------------ verification

    def verify(self, version: int, sent: dict[str, torch.Tensor]) -> VerifyReport:
        """Compare the engine's tensors exactly with what was sent; raise naming the first mismatch.

        FP8 weights and their scales byte for byte; a BF16 tensor sent for an FP8 slot with its
        deterministic re-quantization (same quantizer, torch backend); BF16 tensors and KV scales
        byte for byte after the engine's cast (to bfloat16 / float32).

        Args:
            version: the version (for the report and messages).
            sent: stream name (KV scales canonical) -> the tensor sent.

        Returns:
            the :class:`VerifyReport`; ``max_rel_error`` is the FP8 quantization error of tensors
            quantized on arrival (0 for everything sent as held).

        Raises:
            RefitError: naming the tensor and the first differing element.
        """
        held = self.engine.weights.tensors
        worst, worst_name, checked = 0.0, "", 0
        for name, tensor in sent.items():
            name = canonical_kv_scale_name(name)
            kind = self._slots[name].kind if name in self._slots else _TIED
            if kind in (_TIED, _BLOCK_SCALE):
                continue  # lm_head under tied embeddings is not held; scales are checked with their weight
            err = 0.0
            if kind == _FP8_WEIGHT:
                sname = name + SCALE_SUFFIX
                scale = held[sname]
                if not bool((torch.isfinite(scale) & (scale > 0)).all()):
                    raise RefitError(f"verification failed for {sname}: zero, negative or non-finite scale held")
                if tensor.dtype == FP8_DTYPE:
                    want_q, want_s, what = tensor, sent[sname], "what was sent"
                else:
                    want_q, want_s = quantize_blockwise(tensor, block_size=self.block_size, name=name, backend="torch")
                    what = "the re-quantization of what was sent"
                    err = relative_error(dequantize_blockwise(want_q, want_s, block_size=self.block_size), tensor)
                at = first_byte_mismatch(scale, want_s)
                if at is not None:
                    raise RefitError(
                        f"verification failed for {sname}: the engine holds a different (stale) scale than {what} "
                        f"(first at flat block {at}: held {float(scale.reshape(-1)[at])!r}, "
                        f"want {float(want_s.reshape(-1)[at])!r})"
                    )
                at = first_byte_mismatch(held[name], want_q)
                if at is not None:
                    raise RefitError(
                        f"verification failed for {name}: FP8 bytes differ from {what} (first at flat index {at}: "
                        f"held code 0x{int(held[name].reshape(-1)[at : at + 1].view(torch.uint8)):02x}, want "
                        f"0x{int(want_q.reshape(-1)[at : at + 1].view(torch.uint8)):02x})"
                    )
            else:
                h = held[name]
                want = tensor.to(h.dtype).reshape(h.shape)
                at = first_byte_mismatch(h, want)
                if at is not None:
                    raise RefitError(
                        f"verification failed for {name}: the engine holds a different tensor than was sent "
                        f"(first at flat index {at}: held {float(h.reshape(-1)[at])!r}, "
                        f"want {float(want.reshape(-1)[at])!r})"
                    )
            checked += 1
            if err > worst:
                worst, worst_name = err, name
        return VerifyReport(version=version, checked=checked, max_rel_error=worst, worst=worst_name)
