"""What a refit rollback needs from vLLM: undoing a half-done layerwise reload, re-reading the engine's checkpoint.

The worker (:mod:`~megatron_fp8.rollout.vllm.worker_extension`) restores a known-good version with these:
after a version failed past its first write, or to revert a commit another worker failed. Written against
vLLM 0.32's ``vllm.model_executor.model_loader.reload`` (layerwise reload); on releases without it
:func:`reset_layerwise_state` has nothing to undo. An engine loaded in place (vLLM 0.11, or a shard taking its
parts) is restored from an :class:`EngineSnapshot` of its own weights taken before the first write; an engine
loaded through vLLM's layerwise reload from the last good version's stream, kept in host memory
(:class:`HostRollbackCopy` when that version was staged on the GPU).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from megatron_fp8.refit import multi
from megatron_fp8.rollout.vllm.kv_backends import old_scales, refresh_derived_kv_scales

if TYPE_CHECKING:  # vLLM's types, for annotations only (vLLM is optional at import time)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

logger = logging.getLogger(__name__)


def reset_layerwise_state(model: torch.nn.Module) -> int:
    """Undo a layerwise reload that raised midway, so that the next reload starts clean.

    vLLM's layerwise reload moves every layer's parameters to the ``meta`` device, buffers
    the loaded tensors per layer, and only puts the real (kernel) tensors back when a layer
    is complete or at ``finalize``. An exception in between leaves layers on ``meta`` with
    buffered tensors that the next reload replays (the bricked engine of issue 11). This puts
    every such layer's kernel tensors back (they hold the old values or, for layers already
    processed, the new ones: the caller reloads a good version right after) and clears the
    buffered state.

    Returns:
        The number of layers that were left mid-reload.
    """
    try:
        from vllm.model_executor.model_loader.reload import layerwise  # lazy: vLLM is optional
    except ImportError:  # pragma: no cover - vLLM without layerwise reload
        return 0
    fixed = 0
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        for tensor in layerwise.get_layer_tensors(layer).values():
            tensor.weight_loader = layerwise._get_original_loader(tensor)
        info.reset()
        fixed += 1
    layerwise.LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    if fixed:
        logger.warning("reset %d layer(s) left mid-reload by a failed layerwise reload", fixed)
    return fixed


def checkpoint_weights(model_runner: GPUModelRunner) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint the engine was built from, as a checkpoint-format stream (read from disk, on CPU).

    Used to restore version 0 when no refit has committed yet (host memory: one copy of the
    checkpoint while restoring).
    """
    from vllm.model_executor.model_loader import get_model_loader  # lazy: vLLM is optional

    config = model_runner.vllm_config
    loader = get_model_loader(config.load_config)
    model = model_runner.get_model()
    return [(n, t.to("cpu", copy=True)) for n, t in loader.get_all_weights(config.model_config, model)]


class HostRollbackCopy:
    """The host copy of a version loaded from device tensors, kept as the worker's rollback source.

    A version staged on the engine's GPU (the colocated refit kept on the device) must not stay there once it is
    loaded: it would hold a second copy of the weights while the KV cache generates. Its rollback source (the
    worker's ``last_good``) goes to the host instead: every device tensor is copied into pinned memory on a side
    stream, started after the load is queued, so it overlaps the exact verification; :meth:`result` waits for it.
    A stream of host tensors is kept as it is (no copy).

    Args:
        stream: ``(name, tensor)`` pairs of one version, as loaded.
    """

    def __init__(self, stream: list[tuple[str, torch.Tensor]]):
        self._side: torch.cuda.Stream | None = None
        self.copied_bytes = 0
        self._items: list[tuple[str, torch.Tensor]] = []
        for name, tensor in stream:
            if tensor.device.type != "cpu":
                tensor = self._to_host(tensor)
            self._items.append((name, tensor))

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        self.copied_bytes += tensor.numel() * tensor.element_size()
        if tensor.device.type != "cuda":
            return tensor.detach().to("cpu", copy=True)
        if self._side is None:
            self._side = torch.cuda.Stream(tensor.device)
            self._side.wait_stream(torch.cuda.current_stream(tensor.device))  # after the load that reads it too
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(self._side):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._side)  # its memory is not reused before the copy has read it
        return host

    def result(self) -> list[tuple[str, torch.Tensor]]:
        """The host stream, once every copy has landed."""
        if self._side is not None:
            self._side.synchronize()
            self._side = None
        return self._items


_KV_FLOATS = ("_q_scale_float", "_k_scale_float", "_v_scale_float", "calculate_kv_scales")
"""The host values of an attention layer that a KV-scale write changes with its ``_q/_k/_v_scale`` tensors."""


class EngineSnapshot:
    """The engine's weights as they are before an in-place load writes into them, copied where they live.

    The rollback source of an engine loaded in place (vLLM 0.11, an engine whose shards take their parts): no host
    copy of any version is kept. Before the first write every parameter and every attention layer's KV-scale
    tensors are copied on their device (one flat buffer and a multi-tensor copy per device; on a GPU, in the memory
    the sleeping KV cache gave back, for the refit's duration), with the KV scales' host values; a failure after the
    first write, or a revert another shard asks for, copies them back and checks every byte. Dropped once every
    shard committed (the trainer's release).

    Args:
        model: the vLLM model (``worker.model_runner.model``).
    """

    def __init__(self, model: torch.nn.Module):
        seen: set[int] = set()
        self._held: list[torch.Tensor] = []
        for _, param in model.named_parameters():
            if id(param) not in seen and param.numel():
                seen.add(id(param))
                self._held.append(param.data)
        self._kv: list[tuple[torch.nn.Module, dict[str, object]]] = []
        for _, module in model.named_modules():
            scales = [getattr(module, f"_{k}_scale", None) for k in "qkv"]
            if not all(isinstance(t, torch.Tensor) for t in scales):
                continue
            self._kv.append((module, {a: getattr(module, a) for a in _KV_FLOATS if hasattr(module, a)}))
            for t in scales:
                if id(t) not in seen:
                    seen.add(id(t))
                    self._held.append(t.data)
        self._copies = multi.snapshot(self._held)
        self.nbytes = sum(t.numel() * t.element_size() for t in self._held)

    def restore(self) -> None:
        """Copy every snapshotted tensor and KV-scale value back, then compare every byte.

        Raises:
            RuntimeError: a restored tensor differs from its snapshot.
        """
        before = [(module, old_scales(module)) for module, _ in self._kv]
        multi.copy_into(self._held, self._copies)
        for (module, values), (_, old) in zip(self._kv, before, strict=True):
            for attr, value in values.items():
                setattr(module, attr, value)
            refresh_derived_kv_scales(module, old)  # FlashInfer's host floats derived from the failed version's
        bad = multi.first_mismatch(self._held, self._copies)
        if bad is not None:
            raise RuntimeError(f"tensor {bad} of the engine's snapshot did not come back byte for byte")
