"""Module-level in-place refit plans for processed vLLM layouts (vLLM 0.11: FP8 linears, fused MoE, KV scales).

Part of the vLLM adapter room (split from :mod:`~megatron_fp8.rollout.vllm.adapter` for length).
:func:`~megatron_fp8.rollout.vllm.adapter.inplace_load_weights` hands each module whose layout
(:mod:`~megatron_fp8.rollout.vllm.layouts`) is not the checkpoint's to one of these planners:
they assemble this TP rank's fused checkpoint-format tensors from every shard of the module
(``cat(q, k, v)``, ``cat(gate, up)``, row-parallel columns, experts stacked), map them onto
the engine's layout (transpose, vLLM's own UE8M0 re-quantization) and check every shape and
dtype against the held Parameter. Nothing is written here: the caller writes only after every
module of the version was planned (:func:`~megatron_fp8.rollout.vllm.layouts.write_inplace`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from megatron_fp8.rollout.vllm import layouts
from megatron_fp8.rollout.vllm.layouts import RefitTargetError, UnknownLayoutError
from megatron_fp8.vocab import KV_SCALE_KINDS, SCALE_SUFFIX

logger = logging.getLogger(__name__)

EXPERT_PROJ_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
"""Checkpoint names of an expert's (gate, up, down) projections (Qwen/Llama/DeepSeek; Mixtral)."""


def local_part(
    module: torch.nn.Module, key: str | int | None, kind: str, t: torch.Tensor, *, block: int
) -> torch.Tensor:
    """This TP rank's part of one checkpoint shard (``kind``: ``column``, ``row`` or ``replicated``).

    Args:
        module: the vLLM linear module.
        key: the fused shard (``"q"``/``"k"``/``"v"``, a merged index) or ``None``.
        t: the full checkpoint tensor (weight ``[N, K]`` or its block scale).
        block: rows per element of ``t`` (1: weight, 128: block scale).
    """
    tp_rank, tp_size = int(getattr(module, "tp_rank", 0)), int(getattr(module, "tp_size", 1))
    if tp_size == 1 or kind == "replicated":
        return t
    if kind == "row":
        cols = t.shape[1] // tp_size
        return t[:, tp_rank * cols : (tp_rank + 1) * cols]
    _, src, _ = layouts.column_slices(module, key, t.shape[0] * block, block)
    return t[src]


def _get(sent: Mapping[str, torch.Tensor], name: str, prefix: str) -> torch.Tensor:
    if name not in sent:
        raise RefitTargetError(
            f"{prefix}: {name!r} is missing; the in-place refit writes a processed module whole, so a version "
            "must carry every shard of it (weights and their scales)"
        )
    return sent[name]


def plan_linear(
    module: torch.nn.Module,
    layout: layouts.LinearLayout,
    shards: Sequence[tuple[str | int | None, str]],
    kind: str,
    sent: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The engine tensors of one FP8 linear module in a processed layout (``rowmajor``/``transposed``/``ue8m0``).

    Args:
        module: the vLLM linear module.
        layout: its :class:`~megatron_fp8.rollout.vllm.layouts.LinearLayout`.
        shards: ``[(key, hf_prefix)]`` of the module's checkpoint shards, in fused order.
        kind: ``column``, ``row`` or ``replicated``.
        sent: checkpoint-format tensors by name (``X.weight`` e4m3, ``X.weight_scale_inv`` float32).

    Returns:
        ``{param_name: tensor}`` checked against the held Parameters.

    Raises:
        RefitTargetError: a missing shard or scale, or a shape/dtype that does not fit.
    """
    prefix = module.prefix
    bn = layout.block[0]
    weights, scales = [], []
    for key, hf in shards:
        w = _get(sent, f"{hf}.weight", prefix)
        s = _get(sent, f"{hf}.weight{SCALE_SUFFIX}", prefix)
        if w.dtype != layouts.FP8 or s.dtype != torch.float32:
            raise RefitTargetError(
                f"{hf}.weight: {w.dtype} with {s.dtype} scales arrived for {prefix}, which holds FP8 "
                f"({layout.kind}); send e4m3 weights with float32 block scales"
            )
        weights.append(local_part(module, key, kind, w, block=1))
        scales.append(local_part(module, key, kind, s, block=bn))
    weight = torch.cat(weights, dim=0) if len(weights) > 1 else weights[0]
    scale = torch.cat(scales, dim=0) if len(scales) > 1 else scales[0]
    out = layouts.engine_linear_tensors(layout, weight, scale)
    layouts.check_fit(module, prefix, out)
    return out


def expert_names(prefix: str, num_experts: int, sent: Mapping[str, torch.Tensor]) -> tuple[str, str, str]:
    """The (gate, up, down) checkpoint names the stream uses for ``prefix``'s experts."""
    for names in EXPERT_PROJ_NAMES:
        if f"{prefix}.0.{names[0]}.weight" in sent:
            return names
    return EXPERT_PROJ_NAMES[0]


def plan_experts(
    module: torch.nn.Module, prefix: str, sent: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The engine tensors of one fused-MoE module, from every expert's checkpoint tensors.

    ``w13[e] = cat(gate_e, up_e)`` (this TP rank's intermediate rows), ``w2[e] = down_e`` (this
    rank's intermediate columns); scales likewise by 128-row/column blocks.

    Returns:
        ``({param_name: tensor}, names consumed from the stream)``.

    Raises:
        UnknownLayoutError: expert parallelism (not every expert local), or an unknown layout.
        RefitTargetError: a missing expert tensor, or a shape/dtype that does not fit.
    """
    layout = layouts.moe_layout(module)
    num = int(getattr(module, "global_num_experts", module.w13_weight.shape[0]))
    if int(getattr(module, "local_num_experts", num)) != num or module.w13_weight.shape[0] != num:
        raise UnknownLayoutError(prefix, f"{module.w13_weight.shape[0]} of {num} experts", "expert parallelism")
    tp_rank, tp_size = int(getattr(module, "tp_rank", 0)), int(getattr(module, "tp_size", 1))
    inter = int(module.w13_weight.shape[1]) // 2  # this rank's intermediate rows
    bn, bk = layout.block
    fp8 = layout.kind != "bf16"
    if fp8 and tp_size > 1 and inter % bn:
        raise UnknownLayoutError(prefix, f"intermediate {inter} per rank", f"not a multiple of the {bn} block")
    gate, up, down = expert_names(prefix, num, sent)
    used: set[str] = set()
    w13, w2, s13, s2 = [], [], [], []

    def take(e: int, proj: str, suffix: str) -> torch.Tensor:
        name = f"{prefix}.{e}.{proj}.weight{suffix}"
        used.add(name)
        return _get(sent, name, prefix)

    r0, r1 = tp_rank * inter, (tp_rank + 1) * inter
    for e in range(num):
        w13.append(torch.cat([take(e, gate, "")[r0:r1], take(e, up, "")[r0:r1]], dim=0))
        w2.append(take(e, down, "")[:, r0:r1])
        if fp8:
            b0, b1 = r0 // bn, -(-r1 // bn)
            c0, c1 = r0 // bk, -(-r1 // bk)
            s13.append(torch.cat([take(e, gate, SCALE_SUFFIX)[b0:b1], take(e, up, SCALE_SUFFIX)[b0:b1]], dim=0))
            s2.append(take(e, down, SCALE_SUFFIX)[:, c0:c1])
    tensors = {"w13_weight": torch.stack(w13), "w2_weight": torch.stack(w2)}
    if fp8:
        tensors |= {"w13_weight_scale_inv": torch.stack(s13), "w2_weight_scale_inv": torch.stack(s2)}
    out = layouts.engine_moe_tensors(layout, tensors)
    layouts.check_fit(module, prefix, out)
    return out, used


def plan_kv(module: torch.nn.Module, prefix: str, sent: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The KV scales of one attention layer (layout ``processed``): ``{"q"|"k"|"v": float32 scalar}``.

    Raises:
        UnknownLayoutError: the layer's KV layout is not ``processed``.
        RefitTargetError: a missing, non-scalar or non-positive scale.
    """
    layouts.kv_layout(module)
    out = {}
    for kind in KV_SCALE_KINDS:
        t = _get(sent, f"{prefix}.{kind}_scale", prefix)
        if t.numel() != 1 or not t.is_floating_point() or not float(t.reshape(())) > 0:
            raise RefitTargetError(f"{prefix}.{kind}_scale: a KV scale must be one positive float, got {t!r}")
        out[kind] = t.to(torch.float32).reshape(())
    return out
