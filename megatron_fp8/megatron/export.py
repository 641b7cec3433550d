"""Stream the trainer's weights under Hugging Face names through Megatron-Bridge.

:func:`export_hf_weights` yields ``(hf_name, tensor)`` pairs from Megatron-Bridge's
own ``AutoBridge.export_hf_weights(model, ...)`` (0.3.1 signature:
``export_hf_weights(model, cpu=False, show_progress=True, conversion_tasks=None,
merge_adapter_weights=True)``; only the keywords the installed version accepts are
passed). The bridge un-fuses ``linear_qkv`` into ``q_proj`` / ``k_proj`` / ``v_proj``
and ``linear_fc1`` into ``gate_proj`` / ``up_proj``, and gathers TP / EP shards, so
every rank receives full HF tensors. This is the stream the ``bridge_mappings``
layer wraps (FP8 manifest, quantization, refit).

Per-expert MoE layers (``SequentialMLP``, the layout used on CPU) need
:func:`megatron_fp8.megatron.te_shim.fix_sequential_expert_export` (applied here for
MoE models): megatron-bridge 0.3.1 cannot export them otherwise (see that function).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from megatron_fp8.megatron.build import MegatronModel
from megatron_fp8.megatron.te_shim import cpu_device_patches

logger = logging.getLogger(__name__)


def export_hf_weights(m: MegatronModel, *, cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the model's weights under Hugging Face names, in the bridge's order.

    Args:
        m: the model.
        cpu: move each tensor to CPU before yielding it.

    Yields:
        ``(hf_name, tensor)``; tensors have the HF shapes (e.g. ``q_proj.weight`` ``[N_out, K_in]``)
        and the model's parameter dtype. Every rank receives every full tensor.
    """
    from bridge_mappings.bridge_adapter import bridge_export_call

    export, kwargs = bridge_export_call(m.bridge, is_moe=m.is_moe, cpu=cpu)
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
