"""The Megatron-Bridge boundary: the only module of megatron-fp8 that imports ``megatron.bridge``.

Everything megatron-fp8 asks of Megatron-Bridge goes through here:

* :func:`import_bridge`: import ``megatron.bridge`` with the private patches of
  :mod:`bridge_mappings._patches` applied first (the entry point of every patch);
* :func:`load_bridge`: ``AutoBridge.from_hf_pretrained`` for a checkpoint folder;
* :func:`export_hf_weights`: the HF-named weight stream of a built model,
  through the bridge's own mapping registry (QKV / gate-up splits, TP / EP
  gathers, PP broadcasts are the bridge's job);
* :func:`quantized_hf_weight_stream`: that stream with FP8 + ``_scale_inv`` for
  the names vLLM holds in FP8;
* :func:`bf16_mixed_precision`: Megatron-Bridge's ``bf16_mixed()`` config;
* :func:`transformer_engine_available`: whether a real TransformerEngine is importable
  (the patches' import stand-ins never count);
* the bridge's types for annotations (``AutoBridge``, ``GPTModelProvider``,
  ``MixedPrecisionConfig``), re-exported under ``TYPE_CHECKING`` so that no other
  module names ``megatron.bridge``, even for typing.

Supported version: megatron-bridge 0.3.x (the pin of both the CPU venv and the
container: ``requirements/constraints.txt``, ``docker/constraints-container.txt``).
Its ``AutoBridge.export_hf_weights(model, cpu=False, show_progress=True,
conversion_tasks=None, merge_adapter_weights=True)`` is the only export this
module calls; FP8 is produced by quantizing each gathered tensor as it leaves that
stream, which works on every release that has ``export_hf_weights``. Newer
releases' quantized exports (``export_hf_weights_quant``, ``export_weight_dtype``)
are not used: nothing here could run them, so no branch pretends to.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import logging
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bridge_mappings import _patches
from megatron_fp8.errors import ConfigError
from megatron_fp8.vocab import SCALE_SUFFIX

if TYPE_CHECKING:  # the bridge's own types, for annotations only (re-exported: `import X as X`)
    from megatron.bridge import AutoBridge as AutoBridge
    from megatron.bridge.models import GPTModelProvider as GPTModelProvider
    from megatron.bridge.training.mixed_precision import MixedPrecisionConfig as MixedPrecisionConfig

logger = logging.getLogger(__name__)

__all__ = [
    "bf16_mixed_precision",
    "bridge_version",
    "export_hf_weights",
    "import_bridge",
    "load_bridge",
    "quantized_hf_weight_stream",
    "transformer_engine_available",
]

QuantFn = Callable[[str, torch.Tensor], tuple[Any, Any]]
"""``(hf_name, tensor) -> (fp8 data, float32 scale_inv)``: tensors, or the refit packer's pending parts of them
(:func:`bridge_mappings.quantized_export.in_bucket_parts`), yielded as they are."""


def bridge_version() -> str | None:
    """Installed megatron-bridge version, or ``None``."""
    try:
        return importlib.metadata.version("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        return None


def transformer_engine_available() -> bool:
    """Whether a real TransformerEngine is importable (the TE import stand-ins of the patches never count)."""
    return _patches.real_te_available()


def import_bridge() -> types.ModuleType:
    """Import ``megatron.bridge`` with the patches it needs on this machine applied first.

    Returns:
        The ``megatron.bridge`` module.

    Raises:
        ConfigError: megatron-bridge is not installed (the message names the fix).
    """
    version = bridge_version()
    if version is None:
        raise ConfigError("megatron-bridge is not installed: run `make install` (or use the image from `make image`)")
    _patches.apply(version)
    return importlib.import_module("megatron.bridge")


def load_bridge(hf_path: str | Path, *, dtype: torch.dtype) -> AutoBridge:
    """``AutoBridge.from_hf_pretrained(hf_path, dtype=dtype)``.

    Raises:
        ConfigError: the checkpoint is one the bridge cannot handle (the bridge's reason quoted).
    """
    bridge_mod = import_bridge()
    try:
        return bridge_mod.AutoBridge.from_hf_pretrained(str(hf_path), dtype=dtype)
    except ValueError as exc:
        raise ConfigError(f"Megatron-Bridge cannot load {hf_path}: {exc}") from exc


def _export_kwargs(bridge: AutoBridge, *, cpu: bool) -> dict[str, bool]:
    accepted = inspect.signature(bridge.export_hf_weights).parameters
    kwargs: dict[str, bool] = {}
    if "cpu" in accepted:
        kwargs["cpu"] = cpu
    if "show_progress" in accepted:
        kwargs["show_progress"] = False
    return kwargs


def export_hf_weights(
    bridge: AutoBridge, model: list[torch.nn.Module], *, cpu: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield a built model's weights under Hugging Face names, in the bridge's order.

    Collective over the model-parallel group: every rank must iterate the whole stream.

    Args:
        bridge: the bridge the model was built with.
        model: the model chunks (one per virtual pipeline stage).
        cpu: move each tensor to CPU before yielding it.

    Yields:
        ``(hf_name, tensor)``; tensors have the HF shapes (e.g. ``q_proj.weight`` ``[N_out, K_in]``)
        and the model's parameter dtype. Every rank receives every full tensor.
    """
    kwargs = _export_kwargs(bridge, cpu=cpu)
    with cpu_device_patches():
        stream = iter(bridge.export_hf_weights(model, **kwargs))
    while True:
        # The CPU device answer is active only while the bridge produces the next tensor.
        with cpu_device_patches():
            item = next(stream, None)
        if item is None:
            return
        name, tensor = item[0], item[1]
        yield name, (tensor.cpu() if cpu else tensor)


def quantized_hf_weight_stream(
    bridge: AutoBridge,
    model: list[torch.nn.Module],
    *,
    is_fp8: Callable[[str], bool],
    quant_fn: QuantFn,
    cpu: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The quantizing export: FP8 weight + ``_scale_inv`` for ``is_fp8`` names, the export dtype otherwise.

    Each full (gathered) tensor is quantized as it leaves :func:`export_hf_weights`, so the
    scale is ``[ceil(N/128), ceil(K/128)]`` over the whole HF weight, as vLLM loads it.
    """
    for name, tensor in export_hf_weights(bridge, model, cpu=cpu):
        if is_fp8(name):
            q, scale = quant_fn(name, tensor)
            yield name, q
            yield name + SCALE_SUFFIX, scale
        else:
            yield name, tensor


def bf16_mixed_precision() -> MixedPrecisionConfig:
    """Megatron-Bridge's ``bf16_mixed()`` ``MixedPrecisionConfig`` (the base FP8 recipes are applied on)."""
    import_bridge()
    mixed_precision = importlib.import_module("megatron.bridge.training.mixed_precision")
    return mixed_precision.bf16_mixed()


def cpu_device_patches() -> contextlib.AbstractContextManager[bool]:
    """Scope in which Megatron-Core's ``torch.cuda.current_device()`` answers the CPU device (without CUDA only).

    Patch 3 of :mod:`bridge_mappings._patches`. Yields ``True`` when active, ``False`` when CUDA is
    available and nothing was patched.
    """
    return _patches.cpu_device_patches()


def cpu_schedule_patches() -> contextlib.AbstractContextManager[bool]:
    """Scope for Megatron-Core's forward-backward schedules without CUDA: patch 3 plus patch 5 of
    :mod:`bridge_mappings._patches` (their ``device="cuda"`` token counters made on the CPU). Yields ``True`` when
    active, ``False`` when CUDA is available and nothing was patched.
    """
    return _patches.cpu_schedule_patches()


def packed_attention_scope(model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """Scope in which ``model`` takes packed (THD) micro-batches: TransformerEngine's attention reads ``cu_seqlens``
    itself (nothing to do); the local ``DotProductAttention`` (every model built without TE) runs each sequence alone
    (patch 6 of :mod:`bridge_mappings._patches`)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention  # lazy: optional

    if any(isinstance(module, DotProductAttention) for module in model.modules()):
        return _patches.packed_local_attention()
    return contextlib.nullcontext()


def use_cpu_rng_tracker() -> bool:
    """Install Megatron's no-op-fork RNG tracker when CUDA is unavailable (patch 4); ``False`` with CUDA."""
    return _patches.use_cpu_rng_tracker()


def reset_rng_tracker() -> None:
    """Drop Megatron's RNG tracker so the next model build starts from a fresh one (patch 4)."""
    _patches.reset_rng_tracker()
