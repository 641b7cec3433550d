"""The refit applier of the CPU reference FP8 engine (an emulator and oracle, not a serving engine).

Implements the two-phase :class:`~megatron_fp8.refit.RefitApplier` protocol
(``begin`` / ``stage`` / ``commit`` / ``abort``) and verifies after every commit
that the engine holds what was sent.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.quant import dequantize_blockwise
from megatron_fp8.refit.buckets import TensorMeta
from megatron_fp8.refit.verify import VerifyReport, relative_error
from megatron_fp8.rollout.reference.engine import ReferenceFP8Engine
from megatron_fp8.vocab import SCALE_SUFFIX

logger = logging.getLogger(__name__)


class ReferenceEngineApplier:
    """Applies refits to a :class:`~megatron_fp8.rollout.reference.engine.ReferenceFP8Engine`.

    Args:
        engine: the reference engine.
        verify: read back after each commit and compare with what was sent.
        block_size: FP8 weight block size (for dequantizing in verification).
    """

    def __init__(self, engine: ReferenceFP8Engine, *, verify: bool = True, block_size: tuple[int, int] = (128, 128)):
        self.engine = engine
        self.verify_enabled = verify
        self.block_size = block_size
        self._items: list[tuple[str, torch.Tensor]] = []
        self._version: int | None = None
        self.last_verify: VerifyReport | None = None
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

    def verify(self, version: int, sent: dict[str, torch.Tensor]) -> VerifyReport:
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
        return VerifyReport(version=version, checked=checked, max_rel_error=worst, worst=worst_name)
