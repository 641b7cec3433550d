"""Refit appliers: the engine side of :class:`~megatron_fp8.refit.RefitReceiver`.

Each applier implements the two-phase :class:`~megatron_fp8.refit.RefitApplier`
protocol (``begin`` / ``stage`` / ``commit`` / ``abort``) for one kind of engine,
and verifies after every commit that the engine holds what was sent:

* :class:`VllmApplier` — a real ``vllm.LLM`` carrying
  :class:`~megatron_fp8.vllm.worker_extension.FP8RefitWorkerExtension`; the
  whole version is handed to every worker at commit (``collective_rpc``), where
  it is validated, loaded with vLLM's layerwise reload and read back.
* :class:`ReferenceEngineApplier` — the CPU reference FP8 engine (an emulator
  and oracle, not a serving engine).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.quant import dequantize_blockwise
from megatron_fp8.quant.formats import SCALE_SUFFIX
from megatron_fp8.refit.buckets import TensorMeta

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """What the post-refit read-back found.

    Attributes:
        version: the engine version verified.
        checked: tensors compared.
        max_rel_weight_error: largest relative error between what the engine holds
            (dequantized for FP8) and what the trainer sent before quantization,
            when known, else what was sent.
        worst: name of that tensor.
    """

    version: int
    checked: int
    max_rel_weight_error: float
    worst: str


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float32 (0-safe denominator)."""
    a, b = a.to(torch.float32), b.to(torch.float32)
    return float((a - b).norm()) / max(float(b.norm()), 1e-30)


class ReferenceEngineApplier:
    """Applies refits to a :class:`~megatron_fp8.vllm.reference_engine.ReferenceFP8Engine`.

    Args:
        engine: the reference engine.
        verify: read back after each commit and compare with what was sent.
        block_size: FP8 weight block size (for dequantizing in verification).
    """

    def __init__(self, engine: Any, *, verify: bool = True, block_size: tuple[int, int] = (128, 128)):
        self.engine = engine
        self.verify_enabled = verify
        self.block_size = block_size
        self._items: list[tuple[str, torch.Tensor]] = []
        self._version: int | None = None
        self.last_verify: VerifyResult | None = None
        self.serving_version: int = 0

    def begin(self, version: int, metas: Sequence[TensorMeta]) -> None:
        self._version = version
        self._items = []

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        # the receiver hands views into its bucket buffers: keep our own copies
        self._items.append((name, tensor.clone()))

    def commit(self, version: int) -> None:
        staged = self.engine.stage(self._items)  # validates everything; changes nothing
        self.engine.commit(staged)
        if self.verify_enabled:
            self.last_verify = self.verify(version, dict(self._items))
        self.serving_version = version
        self._items = []

    def abort(self, version: int, reason: str) -> None:
        logger.warning("refit v%d aborted before reaching the reference engine: %s", version, reason)
        self._items = []

    def verify(self, version: int, sent: dict[str, torch.Tensor]) -> VerifyResult:
        """Compare the engine's tensors with what was sent; raise naming the first mismatch."""
        held = dict(self.engine.named_weights())
        worst, worst_name, checked = 0.0, "", 0
        for name, tensor in sent.items():
            if name.endswith(SCALE_SUFFIX):
                continue
            if name not in held:
                continue  # e.g. lm_head skipped under tied embeddings
            h = held[name]
            if h.dtype == torch.float8_e4m3fn:
                scale = held[name + SCALE_SUFFIX]
                if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
                    raise RefitError(f"verification failed for {name}_scale_inv: zero, negative or non-finite scale")
                if tensor.dtype == torch.float8_e4m3fn:
                    sent_scale = sent[name + SCALE_SUFFIX]
                    if not torch.equal(scale, sent_scale):
                        raise RefitError(
                            f"verification failed for {name}_scale_inv: the engine holds a different "
                            "(stale) scale than was sent"
                        )
                    if not torch.equal(h.view(torch.uint8), tensor.view(torch.uint8)):
                        raise RefitError(f"verification failed for {name}: FP8 bytes differ from what was sent")
                    err = 0.0
                else:
                    err = relative_error(dequantize_blockwise(h, scale, block_size=self.block_size), tensor)
                    if not math.isfinite(err) or err > 0.07:  # FP8 e4m3 rounding is <= 2**-4 relative
                        raise RefitError(
                            f"verification failed for {name}: relative error {err:.3g} after "
                            "quantization on arrival exceeds FP8 rounding"
                        )
            else:
                err = relative_error(h, tensor.to(h.dtype))
                if not math.isfinite(err) or err > 0:
                    raise RefitError(
                        f"verification failed for {name}: the engine holds a different tensor "
                        f"(relative error {err:.3g})"
                    )
            checked += 1
            if err > worst:
                worst, worst_name = err, name
        return VerifyResult(version=version, checked=checked, max_rel_weight_error=worst, worst=worst_name)


class VllmApplier:
    """Applies refits to a real ``vllm.LLM`` through the worker extension.

    Tensors of a version are collected as they arrive and handed to every
    worker at commit (``collective_rpc("mfp8_apply", ...)``): in-process on CPU,
    pickled to worker processes otherwise. Each worker validates, loads in place
    with vLLM's layerwise reload and verifies before it reports the version.
    """

    def __init__(
        self,
        llm: Any,
        *,
        fp8_names: Sequence[str] | None,
        verify: bool = True,
        block_size: tuple[int, int] = (128, 128),
    ):
        self.llm = llm
        self.verify_enabled = verify
        self._items: list[tuple[str, torch.Tensor]] = []
        self.last_verify: VerifyResult | None = None
        self.serving_version: int = 0
        llm.collective_rpc(
            "mfp8_configure",
            kwargs={"fp8_names": list(fp8_names) if fp8_names is not None else None, "block_size": tuple(block_size)},
        )

    def begin(self, version: int, metas: Sequence[TensorMeta]) -> None:
        self._items = []

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        self._items.append((name, tensor.clone()))

    def commit(self, version: int) -> None:
        results = self.llm.collective_rpc(
            "mfp8_apply", args=(version, self._items), kwargs={"verify": self.verify_enabled}
        )
        reports = [r["verify"] for r in results if r.get("verify")]
        if reports:
            worst = max(reports, key=lambda r: r["max_rel_error"])
            self.last_verify = VerifyResult(
                version=version,
                checked=worst["checked"],
                max_rel_weight_error=worst["max_rel_error"],
                worst=worst["worst"],
            )
        self.serving_version = version
        self._items = []

    def abort(self, version: int, reason: str) -> None:
        logger.warning("refit v%d aborted before reaching vLLM: %s", version, reason)
        self._items = []
