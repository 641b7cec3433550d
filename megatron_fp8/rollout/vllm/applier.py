"""The refit applier of a real ``vllm.LLM``: the trainer-side half of the vLLM refit.

:class:`VllmApplier` implements the two-phase :class:`~megatron_fp8.refit.RefitApplier`
protocol for an engine carrying
:class:`~megatron_fp8.rollout.vllm.worker_extension.FP8RefitWorkerExtension`:

* ``begin`` checks the version's metadata (names, shapes, dtypes, completeness) against
  the refit set the engine reported (``mfp8_expected``) and refuses before anything is
  staged; ``partial=True`` is the explicit opt-in to partial versions;
* ``stage`` keeps a copy of each tensor (the receiver hands views of its buckets);
* ``commit`` hands the whole version to every worker (``collective_rpc("mfp8_apply")``),
  which validates it again (values included) before its first write, loads it, verifies
  it exactly, and on a failure after the first write rolls back (native reload) or stops
  serving (in-place fallback); see the worker extension's docstring for the guarantees
  and their memory cost. If some TP workers committed and another failed, the committed
  ones are reverted (``mfp8_revert``).

:attr:`VllmApplier.serving` and :attr:`VllmApplier.serving_version` mirror the workers:
the rollout engine refuses to generate while ``serving`` is ``False``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.refit.buckets import TensorMeta
from megatron_fp8.refit.verify import VerifyReport
from megatron_fp8.rollout.vllm.expected import ExpectedTensor, validate_metas

if TYPE_CHECKING:  # vLLM's engine, for annotations only (vLLM is optional at import time)
    from vllm import LLM

logger = logging.getLogger(__name__)


class VllmApplier:
    """Applies refits to a real ``vllm.LLM`` through the worker extension.

    Args:
        llm: the engine (built with the worker extension).
        fp8_names: the FP8 manifest (HF weight names the engine holds in FP8), or ``None``.
        verify: compare what the engine holds with what was sent after every load (exact).
        block_size: ``(rows, cols)`` of one FP8 weight block.
        partial: accept versions that carry only some of the engine's tensors (every shard
            of a fused module they touch); default: every version must be complete.

    Attributes:
        last_verify: the last committed version's verification report (``max_rel_error`` 0: exact).
        last_timings: seconds of the last commit per phase: ``validate``, ``load``, ``verify``
            (the worst worker), and ``rollback_bytes``: host bytes kept to restore it.
    """

    def __init__(
        self,
        llm: LLM,
        *,
        fp8_names: Sequence[str] | None,
        verify: bool = True,
        block_size: tuple[int, int] = (128, 128),
        partial: bool = False,
    ):
        self.llm = llm
        self.verify_enabled = verify
        self.partial = partial
        self._items: list[tuple[str, torch.Tensor]] = []
        self._pending: int | None = None
        self.last_verify: VerifyReport | None = None
        self.last_timings: dict[str, float] = {}
        self.last_unverified: tuple[str, ...] = ()
        llm.collective_rpc(
            "mfp8_configure",
            kwargs={
                "fp8_names": list(fp8_names) if fp8_names is not None else None,
                "block_size": tuple(block_size),
                "partial": partial,
            },
        )
        specs = llm.collective_rpc("mfp8_expected")[0]
        self.expected: dict[str, ExpectedTensor] = {
            d["name"]: ExpectedTensor(
                name=d["name"],
                shape=tuple(d["shape"]),
                dtypes=tuple(d["dtypes"]),
                kind=d["kind"],
                group=d["group"],
                required=bool(d["required"]),
            )
            for d in specs
        }
        self._serving, self._serving_version = True, 0
        self._refresh_status()

    @property
    def serving(self) -> bool:
        """Whether every worker holds a good, verified version (``False``: the engine must not generate)."""
        return self._serving

    @property
    def serving_version(self) -> int:
        """The version every worker serves (the last good one)."""
        return self._serving_version

    def _refresh_status(self) -> None:
        try:
            statuses = self.llm.collective_rpc("mfp8_status")
        except Exception as exc:  # an engine that cannot answer must not serve
            logger.error("mfp8_status failed: %s; marking the engine not serving", exc)
            self._serving = False
            return
        versions = {int(s["version"]) for s in statuses}
        self._serving = all(bool(s["serving"]) for s in statuses) and len(versions) == 1
        self._serving_version = min(versions)

    def begin(self, version: int, metas: Sequence[TensorMeta]) -> None:
        """Refuse the version unless its metadata matches the engine's refit set (nothing is staged)."""
        self._items, self._pending = [], None
        if version <= self._serving_version:
            raise RefitError(
                f"refit version {version} is not newer than the engine's version {self._serving_version}; "
                "versions must increase monotonically"
            )
        validate_metas(((m.name, tuple(m.shape), m.dtype) for m in metas), self.expected, partial=self.partial)
        self._pending = version

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        """Keep a copy of one tensor (the receiver's bucket buffers are reused)."""
        if self._pending is None:
            raise RefitError(f"stage({name!r}) called before a successful begin()")
        self._items.append((name, tensor.clone()))

    def commit(self, version: int) -> None:
        """Apply the staged version on every worker; see the module docstring for what a failure leaves."""
        if self._pending != version:
            raise RefitError(f"commit({version}) does not match the version begun ({self._pending})")
        items, self._items, self._pending = self._items, [], None
        try:
            results = self.llm.collective_rpc(
                "mfp8_apply", args=(version, items), kwargs={"verify": self.verify_enabled}
            )
        except Exception:
            self._after_failure(version)
            raise
        self.llm.collective_rpc("mfp8_release", args=(version,))
        reports = [r["verify"] for r in results if r.get("verify")]
        if reports:
            self.last_verify = VerifyReport(**max(reports, key=lambda r: r["max_rel_error"]))
        self.last_unverified = tuple(sorted({n for r in results for n in r.get("unverified", [])}))
        self.last_timings = {
            key: max(float(r.get(key, 0.0)) for r in results)
            for key in ("validate_s", "load_s", "verify_s", "rollback_bytes")
        }
        self._refresh_status()

    def _after_failure(self, version: int) -> None:
        """Revert workers that committed ``version`` while another failed it; then re-read the status."""
        try:
            self.llm.collective_rpc("mfp8_revert", args=(version,))
        except Exception as exc:
            logger.error("reverting refit v%d on the workers failed: %s", version, exc)
        self._refresh_status()

    def abort(self, version: int, reason: str) -> None:
        """Drop what was staged (the workers were not touched by this applier's begin/stage)."""
        logger.warning("refit v%d aborted: %s", version, reason)
        self._items, self._pending = [], None
