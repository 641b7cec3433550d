"""The refit applier of a real ``vllm.LLM``: the trainer-side half of the vLLM refit.

:class:`VllmApplier` implements the two-phase :class:`~megatron_fp8.refit.RefitApplier`
protocol for an engine carrying
:class:`~megatron_fp8.rollout.vllm.worker_extension.FP8RefitWorkerExtension`: the
whole version is handed to every worker at commit (``collective_rpc``), where it is
validated, loaded with vLLM's layerwise reload and read back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from megatron_fp8.refit.buckets import TensorMeta
from megatron_fp8.refit.verify import VerifyReport

if TYPE_CHECKING:  # vLLM's engine, for annotations only (vLLM is optional at import time)
    from vllm import LLM

logger = logging.getLogger(__name__)


class VllmApplier:
    """Applies refits to a real ``vllm.LLM`` through the worker extension.

    Tensors of a version are collected as they arrive and handed to every
    worker at commit (``collective_rpc("mfp8_apply", ...)``): in-process on CPU,
    pickled to worker processes otherwise. Each worker validates, loads in place
    with vLLM's layerwise reload and verifies before it reports the version.
    """

    def __init__(
        self,
        llm: LLM,
        *,
        fp8_names: Sequence[str] | None,
        verify: bool = True,
        block_size: tuple[int, int] = (128, 128),
    ):
        self.llm = llm
        self.verify_enabled = verify
        self._items: list[tuple[str, torch.Tensor]] = []
        self.last_verify: VerifyReport | None = None
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
            self.last_verify = VerifyReport(
                version=version,
                checked=worst["checked"],
                max_rel_error=worst["max_rel_error"],
                worst=worst["worst"],
            )
        self.serving_version = version
        self._items = []

    def abort(self, version: int, reason: str) -> None:
        logger.warning("refit v%d aborted before reaching vLLM: %s", version, reason)
        self._items = []
