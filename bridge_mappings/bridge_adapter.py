"""Every Megatron-Bridge version difference, in one place.

* megatron-bridge 0.3.x (the newest for Python 3.11, used on CPU machines) has
  ``AutoBridge.export_hf_weights(model, cpu=..., show_progress=...)`` only;
* newer releases (in the container) add ``export_hf_weights_quant(model,
  quantization_checker, quant_fn, quant_block_size=...)`` and, for ``fp8_param``
  blockwise models, ``build_export_fp8_tasks`` which sends TransformerEngine's own
  FP8 data and scales without requantizing.

Callers use :func:`hf_weight_stream` and :func:`quantized_hf_weight_stream`; they
never test versions themselves.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_fp8.quant.formats import SCALE_SUFFIX

logger = logging.getLogger(__name__)


def bridge_version() -> str | None:
    """Installed megatron-bridge version, or ``None``."""
    try:
        return importlib.metadata.version("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        return None


def bridge_export_call(bridge: Any, *, is_moe: bool, cpu: bool) -> tuple[Callable[..., Any], dict[str, Any]]:
    """``(export_fn, kwargs)`` for ``bridge.export_hf_weights(model, **kwargs)`` on the installed version.

    0.3.1's signature is ``export_hf_weights(model, cpu=False, show_progress=True,
    conversion_tasks=None, merge_adapter_weights=True)``; only keywords the installed
    version accepts are passed. 0.3.x cannot export per-expert ``SequentialMLP`` weights
    (the CPU MoE layout): the fix in :func:`megatron_fp8.megatron.te_shim.fix_sequential_expert_export`
    is installed for MoE models on those versions.
    """
    import inspect

    export = bridge.export_hf_weights
    accepted = inspect.signature(export).parameters
    kwargs: dict[str, Any] = {}
    if "cpu" in accepted:
        kwargs["cpu"] = cpu
    if "show_progress" in accepted:
        kwargs["show_progress"] = False
    if is_moe and (bridge_version() or "0").startswith("0.3."):
        from megatron_fp8.megatron.te_shim import fix_sequential_expert_export

        fix_sequential_expert_export()
    return export, kwargs


def has_quantized_export(bridge: Any) -> bool:
    """Whether the bridge offers a quantized export hook (newer than 0.3.x)."""
    return callable(getattr(bridge, "export_hf_weights_quant", None))


def has_fp8_param_export(bridge: Any) -> bool:
    """Whether the bridge can export TE's own FP8 data + scales (``fp8_param`` models)."""
    return callable(getattr(bridge, "build_export_fp8_tasks", None))


def hf_weight_stream(m: Any, *, cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every weight of a built model, through Megatron-Bridge's own mappings.

    QKV/gated-MLP splits, TP gathers and PP broadcasts are Megatron-Bridge's job.

    Args:
        m: a :class:`~megatron_fp8.megatron.MegatronModel` (bridge + model chunks).
    """
    from megatron_fp8.megatron.export import export_hf_weights

    yield from export_hf_weights(m, cpu=cpu)


def quantized_hf_weight_stream(
    m: Any,
    *,
    is_fp8: Callable[[str], bool],
    quant_fn: Callable[[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    block_size: tuple[int, int],
    cpu: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The quantizing export: FP8 weight + ``_scale_inv`` for ``is_fp8`` names, BF16 otherwise.

    Uses, in this order, what the installed Megatron-Bridge offers: the export of
    TransformerEngine's own FP8 data + scales for ``fp8_param`` models (no
    requantization), the ``export_hf_weights_quant`` hook, or (0.3.x) quantizing
    each gathered tensor as it leaves :func:`hf_weight_stream`.
    """
    bridge, model = m.bridge, m.model
    if has_fp8_param_export(bridge) and _model_has_fp8_params(model):
        logger.info("megatron-bridge %s: exporting TransformerEngine's own FP8 data and scales", bridge_version())
        tasks = bridge.build_export_fp8_tasks(model)
        for item in bridge.export_hf_weights(model, cpu=cpu, show_progress=False, conversion_tasks=tasks):
            yield item[0], item[1]
        return
    if has_quantized_export(bridge):

        def hook(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            return quant_fn(kwargs.get("name", "<bridge tensor>"), tensor)

        for item in bridge.export_hf_weights_quant(
            model, is_fp8, hook, quant_block_size=block_size, cpu=cpu, show_progress=False
        ):
            yield item[0], item[1]
        return
    for name, tensor in hf_weight_stream(m, cpu=cpu):
        if is_fp8(name):
            q, scale = quant_fn(name, tensor)
            yield name, q
            yield name + SCALE_SUFFIX, scale
        else:
            yield name, tensor


def _model_has_fp8_params(model: list[torch.nn.Module]) -> bool:
    for chunk in model:
        for p in chunk.parameters():
            if type(p).__name__ in ("Float8BlockwiseQTensor", "Float8Tensor", "MXFP8Tensor"):
                return True
    return False
