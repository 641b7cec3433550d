"""Stream the trainer's weights under Hugging Face names through Megatron-Bridge.

:func:`export_hf_weights` yields ``(hf_name, tensor)`` pairs from Megatron-Bridge's
own ``AutoBridge.export_hf_weights(model, ...)`` (0.3.1 signature:
``export_hf_weights(model, cpu=False, show_progress=True, conversion_tasks=None,
merge_adapter_weights=True)``; only the keywords the installed version accepts are
passed). The bridge un-fuses ``linear_qkv`` into ``q_proj`` / ``k_proj`` / ``v_proj``
and ``linear_fc1`` into ``gate_proj`` / ``up_proj``, and gathers TP / EP shards, so
every rank receives full HF tensors. This is the stream the ``bridge_mappings``
layer wraps (FP8 manifest, quantization, refit).

Per-expert MoE layers (``SequentialMLP``, the layout used on CPU): megatron-bridge
0.3.1's ``MegatronParamMapping.gather_from_ep_ranks`` reads the expert id as the
text after ``.weight`` in the Megatron name, which only holds for TE's grouped
layout (``experts.linear_fc1.weight3``); for ``experts.local_experts.3.linear_fc1.weight``
it raises ``ValueError: invalid literal for int()``. :func:`export_hf_weights`
therefore builds the conversion tasks itself (``bridge.get_conversion_tasks``, the
documented hook for adjusted tasks) and gives exactly those expert tasks a copy of
their mapping whose ``gather_from_ep_ranks`` reads the id from ``local_experts.<id>.``
and otherwise does the same (EP all-gather, HF names per EP rank). The bridge
classes themselves are not changed.
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
import types
from collections.abc import Iterator
from typing import Any

import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron.build import MegatronModel
from megatron_fp8.megatron.te_shim import cpu_device_patches

logger = logging.getLogger(__name__)

_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_HF_EXPERT = re.compile(r"experts\.(\d+)")


def _gather_sequential_expert(
    self: Any, megatron_weights: torch.Tensor | None, megatron_module: Any, hf_param_name: str | None
) -> dict[str, torch.Tensor]:
    """``gather_from_ep_ranks`` for ``local_experts.<id>`` names (see the module docstring)."""
    if megatron_module is None:
        per_rank = self.broadcast_obj_from_pp_rank(None, "num_experts_per_rank")
    else:
        per_rank = self._get_config(megatron_module).num_moe_experts // self.ep_size
        per_rank = self.broadcast_obj_from_pp_rank(per_rank, "num_experts_per_rank")
    match = _LOCAL_EXPERT.search(self.megatron_param)
    if match is None:
        raise ConfigError(f"expert parameter {self.megatron_param!r} has no 'local_experts.<id>.' component")
    local = int(match.group(1)) % per_rank
    names = [_HF_EXPERT.sub(f"experts.{local + per_rank * i}", str(hf_param_name)) for i in range(self.ep_size)]
    if str(hf_param_name) not in names:
        raise ConfigError(f"HF name {hf_param_name!r} does not match the expert ids {names} of {self.megatron_param!r}")
    if self.ep_size == 1:
        return {names[0]: megatron_weights}
    gathered = [torch.empty_like(megatron_weights) for _ in range(self.ep_size)]
    torch.distributed.all_gather(gathered, megatron_weights, group=self.ep_group)
    return dict(zip(names, gathered, strict=True))


def _fixed_tasks(m: MegatronModel) -> list[Any]:
    tasks = m.bridge.get_conversion_tasks(m.model)
    fixed = 0
    for task in tasks:
        mapping = getattr(task, "mapping", None)
        if mapping is None or not _LOCAL_EXPERT.search(str(getattr(mapping, "megatron_param", ""))):
            continue
        patched = copy.copy(mapping)
        patched.gather_from_ep_ranks = types.MethodType(_gather_sequential_expert, patched)
        task.mapping = patched
        fixed += 1
    logger.debug("export: %d conversion tasks, %d per-expert tasks use the local_experts id reader", len(tasks), fixed)
    return tasks


def export_hf_weights(m: MegatronModel, *, cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the model's weights under Hugging Face names, in the bridge's order.

    Args:
        m: the model.
        cpu: move each tensor to CPU before yielding it.

    Yields:
        ``(hf_name, tensor)``; tensors have the HF shapes (e.g. ``q_proj.weight`` ``[N_out, K_in]``)
        and the model's parameter dtype. Every rank receives every full tensor.
    """
    export = m.bridge.export_hf_weights
    accepted = inspect.signature(export).parameters
    kwargs: dict[str, Any] = {}
    if "cpu" in accepted:
        kwargs["cpu"] = cpu
    if "show_progress" in accepted:
        kwargs["show_progress"] = False
    if m.is_moe and "conversion_tasks" in accepted:
        kwargs["conversion_tasks"] = _fixed_tasks(m)
    with cpu_device_patches():
        stream = iter(export(m.model, **kwargs))
    while True:
        # The CPU device answer is active only while the bridge produces the next tensor.
        with cpu_device_patches():
            item = next(stream, None)
        if item is None:
            return
        name, tensor = item
        yield name, (tensor.cpu() if cpu else tensor)
