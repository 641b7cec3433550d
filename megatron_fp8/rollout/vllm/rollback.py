"""What a refit rollback needs from vLLM: undoing a half-done layerwise reload, re-reading the engine's checkpoint.

The worker (:mod:`~megatron_fp8.rollout.vllm.worker_extension`) restores a known-good version with these:
after a version failed past its first write, or to revert a commit another worker failed. Written against
vLLM 0.32's ``vllm.model_executor.model_loader.reload`` (layerwise reload); on releases without it
:func:`reset_layerwise_state` has nothing to undo, and a failed in-place refit is not rolled back (the
worker marks the engine not serving instead).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

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
