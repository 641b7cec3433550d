"""The refit applier of a real ``vllm.LLM``: the trainer-side half of the vLLM refit.

:class:`VllmApplier` implements the two-phase :class:`~megatron_fp8.refit.RefitApplier`
protocol for an engine carrying
:class:`~megatron_fp8.rollout.vllm.worker_extension.FP8RefitWorkerExtension`:

* ``begin`` checks the version's metadata (names, shapes, dtypes, completeness) against
  the refit set the engine reported (``mfp8_expected``) and refuses before anything is
  staged; ``partial=True`` is the explicit opt-in to partial versions;
* ``stage`` keeps each tensor until the commit on :attr:`VllmApplier.staging_device`: the device of the engine's
  worker when that worker runs in this process (colocated on a GPU: the version stays on the GPU, staged in the
  memory the sleeping KV cache gave back, and the worker loads and verifies it there, with no host crossing); the
  host when the workers run in other processes (``collective_rpc`` serializes its arguments). The receiver stages the
  version there for it (:func:`megatron_fp8.refit.applier.staging_device`); a tensor it is not told it owns is
  copied there;
* ``commit`` hands the whole version to every worker (``collective_rpc("mfp8_apply")``),
  which validates it again (values included) before its first write, loads it, verifies
  it exactly, and on a failure after the first write rolls back (native reload) or stops
  serving (in-place fallback); see the worker extension's docstring for the guarantees
  and their memory cost. If some TP workers committed and another failed, the committed
  ones are reverted (``mfp8_revert``); for an engine sharded over several processes (vLLM's
  ``external_launcher``, each process applying its own shard) the shards agree over ``shard_group``
  before the version counts as committed.

**The prefix cache is retired with the weights.** vLLM reuses KV blocks across requests
(prefix caching, on by default); blocks computed with the previous weights must not serve the
new version. ``commit`` therefore

1. before its first write, empties the cache: vLLM refuses while a request holds blocks, and
   then the version is refused with nothing written (a refit needs an idle engine); with
   verification on, it prefills a probe prompt of two full blocks, cached under the old weights;
2. after the load, empties the cache again and, with verification on, prefills the probe once
   more, which must get ``num_cached_tokens == 0``;
3. on a failure after the first write (the worker's rollback, a reset refused, a probe served
   from the cache), reverts the workers and empties the cache; if that cannot be done the engine
   stops serving until a refit commits on an idle engine.

Within a version the cache stays on: the samples of one prompt share its blocks.
:attr:`VllmApplier.last_prefix_cache` records what the last commit did (a key of
:data:`megatron_fp8.vocab.PREFIX_CACHE_RESETS`).

:attr:`VllmApplier.serving` and :attr:`VllmApplier.serving_version` mirror the workers:
the rollout engine refuses to generate while ``serving`` is ``False``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from megatron_fp8.errors import EngineNotServingError, RefitError, RefitRolledBackError
from megatron_fp8.layout import ShardPlan, ShardSlice
from megatron_fp8.refit.buckets import TensorMeta
from megatron_fp8.refit.verify import VerifyReport
from megatron_fp8.rollout.vllm import adapter, prefix_cache
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
        shard_group: the process group of an engine sharded over several processes (vLLM's
            ``external_launcher``: each process applies its own shard); a version is committed only when every
            shard committed it, else every shard reverts. ``None``: one process holds every worker. With a group,
            each process's versions carry only its shard's parts (:attr:`shard_plan`) when every shard can take
            them (not with ``partial``).

    Attributes:
        last_verify: the last committed version's verification report (``max_rel_error`` 0: exact).
        last_timings: seconds of the last commit per phase: ``validate``, ``load``, ``verify``
            (the worst worker), ``rollback_bytes``: host bytes kept to restore it, ``rollback_copy_bytes``: of
            those, the bytes copied to the host from a version staged on the engine's device, and
            ``snapshot_bytes``: the copy of its own weights an engine loaded in place took before the first write
            (on their device; dropped once every shard committed).
        shard_plan: what this process's shard takes of each tensor (:class:`~megatron_fp8.layout.ShardPlan`): the
            trainer sends only these parts (``None``: full tensors; the worker slices its part).
        last_prefix_cache: how the last commit retired the prefix cache (a key of
            :data:`megatron_fp8.vocab.PREFIX_CACHE_RESETS`; ``None`` before the first commit).
        kv_cache_asleep: set by the colocated sleep schedule (:mod:`megatron_fp8.rollout.sleep`) while the engine's
            KV cache is given back: a commit then runs no probe request (it would run on unmapped KV memory), and
            there is nothing to probe (vLLM's ``sleep`` empties the prefix cache and drops the KV blocks).
    """

    def __init__(
        self,
        llm: LLM,
        *,
        fp8_names: Sequence[str] | None,
        verify: bool = True,
        block_size: tuple[int, int] = (128, 128),
        partial: bool = False,
        shard_group: torch.distributed.ProcessGroup | None = None,
    ):
        self.llm = llm
        self.shard_group = shard_group
        self.verify_enabled = verify
        self.partial = partial
        self._items: list[tuple[str, torch.Tensor]] = []
        self._pending: int | None = None
        self._values_checked: int | None = None  # the version whose NaN/Inf check the receiver did
        self.last_verify: VerifyReport | None = None
        self.last_timings: dict[str, float] = {}
        self.last_unverified: tuple[str, ...] = ()
        self.last_prefix_cache: str | None = None
        self.kv_cache_asleep = False
        self._stale_cache: str | None = None  # why blocks of an older version may still be cached
        self._caches = prefix_cache.cached_block_size(llm) is not None  # fixed for the engine's life
        self._probe = prefix_cache.probe_prompt(llm)
        self._staging = adapter.in_process_worker_device(llm) or torch.device("cpu")
        llm.collective_rpc(
            "mfp8_configure",
            kwargs={
                "fp8_names": list(fp8_names) if fp8_names is not None else None,
                "block_size": tuple(block_size),
                "partial": partial,
            },
        )
        self.shard_plan = self._agree_on_shard_plan(fp8_names, block_size) if shard_group is not None else None
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
        if any(e.kind == "kv_scale" for e in self.expected.values()):  # FP8 KV cache: refitted every step
            llm.collective_rpc("mfp8_check_kv_scales", kwargs={"per_step": True})
        self._serving, self._serving_version = True, 0
        self._refresh_status()

    def _agree_on_shard_plan(self, fp8_names: Sequence[str] | None, block_size: tuple[int, int]) -> ShardPlan | None:
        """Switch the workers to versions of their parts when every shard of the engine can take them (one
        all-reduce over :attr:`shard_group`, so that all shards send alike); the plan, or ``None`` (full tensors)."""
        found = None if self.partial else self.llm.collective_rpc("mfp8_shard_plan")[0]
        if self._over_shards(int(found is None))[0]:
            logger.info("refit: every shard of this engine is sent full tensors (a shard cannot take only its part)")
            return None
        self.llm.collective_rpc(
            "mfp8_configure",
            kwargs={
                "fp8_names": list(fp8_names) if fp8_names is not None else None,
                "block_size": tuple(block_size),
                "partial": False,
                "shard_local": True,
            },
        )
        plan = ShardPlan(
            rank=int(found["rank"]),
            size=int(found["size"]),
            slices={n: ShardSlice(*map(int, v)) for n, v in found["slices"].items()},
        )
        logger.info(
            "refit: engine rank %d of %d takes its part of %d tensors (the trainer sends only those)",
            plan.rank,
            plan.size,
            len(plan.slices),
        )
        return plan

    @property
    def serving(self) -> bool:
        """Whether every worker holds a good, verified version (``False``: the engine must not generate)."""
        return self._serving

    @property
    def not_serving_reason(self) -> str | None:
        """Why the engine does not serve, when it is the prefix cache (``None`` otherwise)."""
        return self._stale_cache

    @property
    def serving_version(self) -> int:
        """The version every worker serves (the last good one)."""
        return self._serving_version

    def _refresh_status(self) -> None:
        try:
            statuses = self.llm.collective_rpc("mfp8_status")
        except Exception as exc:  # an engine that cannot answer must not serve
            logger.error("mfp8_status failed: %s; marking the engine not serving", exc)
            statuses = [{"version": self._serving_version, "serving": False}]
        versions = {int(s["version"]) for s in statuses}
        serving = all(bool(s["serving"]) for s in statuses) and len(versions) == 1 and self._stale_cache is None
        if self.shard_group is not None:  # the engine serves only when every shard does, on one version
            low, high, down = self._over_shards(-min(versions), max(versions), int(not serving))
            serving, versions = not down and -low == high, {-low}
        self._serving = serving
        self._serving_version = min(versions)

    def _over_shards(self, *values: int) -> list[int]:
        """The largest of each of ``values`` over the engine's shards (one all-reduce over :attr:`shard_group`)."""
        box = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(box, op=torch.distributed.ReduceOp.MAX, group=self.shard_group)
        return box.tolist()

    def begin(self, version: int, metas: Sequence[TensorMeta]) -> None:
        """Refuse the version unless its metadata matches the engine's refit set (nothing is staged)."""
        self._items, self._pending, self._values_checked = [], None, None
        if version <= self._serving_version:
            raise RefitError(
                f"refit version {version} is not newer than the engine's version {self._serving_version}; "
                "versions must increase monotonically"
            )
        validate_metas(((m.name, tuple(m.shape), m.dtype) for m in metas), self.expected, partial=self.partial)
        self._pending = version

    @property
    def staging_device(self) -> torch.device:
        """Where a version is kept until its commit (:func:`megatron_fp8.refit.applier.staging_device`): the engine
        worker's device when the worker runs in this process, else the host."""
        return self._staging

    accepts_checked_values = True
    """The receiver checks the version's values for NaN/Inf on the buckets' device
    (:func:`megatron_fp8.refit.applier.accepts_checked_values`), so the workers do not read every byte of the
    host-staged version on the CPU for it; they still check names, shapes, dtypes and every scale."""

    def values_checked(self, version: int) -> None:
        """The receiver found no NaN/Inf in any tensor of ``version`` (called between ``begin`` and ``commit``)."""
        if self._pending != version:
            raise RefitError(f"values_checked({version}) does not match the version begun ({self._pending})")
        self._values_checked = version

    def stage(self, name: str, tensor: torch.Tensor, *, owned: bool = False) -> None:
        """Keep one tensor on :attr:`staging_device` until the commit.

        Args:
            name: its HF name.
            tensor: the values (any device).
            owned: ``tensor`` is a view of memory holding this version alone, on :attr:`staging_device` (the
                receiver's staging): kept as it is. Otherwise it is copied there (bucket buffers may be reused).

        Raises:
            RefitError: before ``begin``, or an owned tensor on another device.
        """
        if self._pending is None:
            raise RefitError(f"stage({name!r}) called before a successful begin()")
        if owned and tensor.device.type != self._staging.type:
            raise RefitError(
                f"stage({name!r}, owned=True) was handed a {tensor.device} tensor; this engine stages on "
                f"{self._staging} (the receiver stages there for it)"
            )
        self._items.append((name, tensor if owned else tensor.detach().to(self._staging, copy=True)))

    def commit(self, version: int) -> None:
        """Apply the staged version on every worker; see the module docstring for what a failure leaves."""
        if self._pending != version:
            raise RefitError(f"commit({version}) does not match the version begun ({self._pending})")
        items, self._items, self._pending = self._items, [], None
        checked, self._values_checked = self._values_checked == version, None
        probe = self._idle_engine(version)
        error: Exception | None = None
        try:
            results = self.llm.collective_rpc(
                "mfp8_apply", args=(version, items), kwargs={"verify": self.verify_enabled, "values_checked": checked}
            )
        except Exception as exc:
            error = exc
        if self.shard_group is not None and self._over_shards(int(error is not None))[0] and error is None:
            error = RefitError(
                f"refit version {version}: another shard of this engine failed it (see that rank's log); this shard "
                "reverts to the version every shard holds"
            )
        if error is not None:
            self._after_failure(version, error)
            raise error
        self.last_prefix_cache = self._retire_prefix_cache(version, probe)
        self.llm.collective_rpc("mfp8_release", args=(version,))
        reports = [r["verify"] for r in results if r.get("verify")]
        if reports:
            self.last_verify = VerifyReport(**max(reports, key=lambda r: r["max_rel_error"]))
        self.last_unverified = tuple(sorted({n for r in results for n in r.get("unverified", [])}))
        self.last_timings = {
            key: max(float(r.get(key, 0.0)) for r in results)
            for key in ("validate_s", "load_s", "verify_s", "rollback_bytes", "rollback_copy_bytes", "snapshot_bytes")
        }
        self._refresh_status()

    def _idle_engine(self, version: int) -> list[int] | None:
        """Before the first write: empty the prefix cache, and cache the probe prompt under the current weights.

        Returns:
            The probe prompt to check after the load (``None``: no probe).

        Raises:
            RefitError: vLLM refused the reset (a request holds KV blocks); nothing was written.
        """
        if not self._caches:
            return None
        if prefix_cache.reset_prefix_cache(self.llm) is False:
            raise RefitError(
                f"refit version {version} refused before any write: vLLM cannot empty its prefix cache while a "
                f"request holds KV blocks, and blocks of version {self._serving_version} must not serve the new "
                "weights; refit an idle engine (let every request finish or abort it first)"
            )
        if self._stale_cache is not None:
            logger.info("prefix cache emptied: the engine may serve again once a version commits")
            self._stale_cache = None
        if not self.verify_enabled or self._probe is None or self.kv_cache_asleep:
            return None
        prefix_cache.cached_prompt_tokens(self.llm, self._probe)
        return self._probe

    def _retire_prefix_cache(self, version: int, probe: list[int] | None) -> str:
        """After the load: empty the prefix cache and probe it; undo the version when that fails.

        Returns:
            A key of :data:`megatron_fp8.vocab.PREFIX_CACHE_RESETS`.

        Raises:
            RefitRolledBackError: the cache could not be emptied or the probe hit it; the workers were
                reverted to the previous version and its cache emptied.
            EngineNotServingError: the same, and the revert or the reset failed too.
        """
        if not self._caches:
            return "no_cache"
        if prefix_cache.reset_prefix_cache(self.llm) is False:
            self._undo(version, "vLLM could not empty its prefix cache after the load (a request held KV blocks)")
        if probe is None:
            return "slept" if self.kv_cache_asleep else "reset_unprobed"
        cached = prefix_cache.cached_prompt_tokens(self.llm, probe)
        if cached:
            self._undo(
                version,
                f"after emptying the prefix cache, a probe prompt of {len(probe)} tokens was still served "
                f"{cached} cached tokens computed with the previous weights",
            )
        return "reset"

    def _undo(self, version: int, reason: str) -> None:
        """Revert every worker's commit of ``version`` and empty the prefix cache; always raises."""
        error = RefitError(f"refit version {version} failed after its load: {reason}")
        self._after_failure(version, error)
        if not self._serving or self._serving_version >= version:
            raise EngineNotServingError(
                f"{error}; reverting the workers to the previous version failed too, so this engine refuses to "
                "generate until a good version commits"
            )
        raise RefitRolledBackError(
            f"{error}; the engine was restored to version {self._serving_version} (verified exactly), its prefix "
            "cache emptied, and it keeps serving that version"
        )

    def _after_failure(self, version: int, error: Exception) -> None:
        """Revert workers that committed ``version``, empty the prefix cache, re-read the status.

        Raises:
            EngineNotServingError: the prefix cache could not be emptied (a request holds blocks that may
                come from the failed version): the engine stops serving until a refit commits on an idle engine.
        """
        try:
            self.llm.collective_rpc("mfp8_revert", args=(version,))
        except Exception as exc:
            logger.error("reverting refit v%d on the workers failed: %s", version, exc)
        if self._caches and prefix_cache.reset_prefix_cache(self.llm) is False:
            self._stale_cache = (
                f"refit version {version} failed ({error}) and the prefix cache could not be emptied after it "
                "(a request holds KV blocks that may come from the failed version)"
            )
        self._refresh_status()
        if self._stale_cache is not None:
            raise EngineNotServingError(
                f"{self._stale_cache}; this engine refuses to generate until a refit commits on an idle engine"
            ) from error

    def abort(self, version: int, reason: str) -> None:
        """Drop what was staged (the workers were not touched by this applier's begin/stage)."""
        logger.warning("refit v%d aborted: %s", version, reason)
        self._items, self._pending, self._values_checked = [], None, None
