"""The in-place refit for vLLM without layerwise reload: a whole version planned, checked, then written into the engine.

:func:`inplace_load_weights` is the load path of vLLM releases without layerwise reload (e.g. 0.11,
chosen by :func:`~megatron_fp8.rollout.vllm.adapter.reload_weights`): after
``process_weights_after_loading`` the Parameters of FP8 layers are new objects without their
``weight_loader``, so ``model.load_weights`` cannot be called again. It resolves every tensor of the
version to its target first: checkpoint-layout Parameters by this TP rank's rows/columns, and each
module whose layout (:mod:`~megatron_fp8.rollout.vllm.layouts`) is not the checkpoint's through one of
the module-level planners (:func:`plan_linear`, :func:`plan_experts`, :func:`plan_kv`). The planners
assemble this TP rank's fused checkpoint-format tensors from every shard of the module
(``q, k, v`` and ``gate, up`` as :class:`~megatron_fp8.rollout.vllm.layouts.RowParts`, each shard written into
its own rows without a host concatenation; row-parallel columns; experts stacked), map them onto the engine's
layout (transpose, vLLM's own UE8M0 re-quantization) and check every shape and dtype against the held
Parameter; they write nothing. The first byte is written only after every module of the version was
planned (:func:`~megatron_fp8.rollout.vllm.layouts.write_inplace`).

With ``local=True`` the version holds this TP rank's parts only (an engine sharded over trainer ranks is sent its
:func:`~megatron_fp8.rollout.vllm.expected.engine_shard_plan`): each part is written where its full tensor's slice
would go, with the same checks; nothing is sliced here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_fp8.layout import ceil_div
from megatron_fp8.refit.applier import copy_by_dtype
from megatron_fp8.rollout.vllm import layers, layouts
from megatron_fp8.rollout.vllm.layouts import RefitTargetError, UnknownLayoutError, stacked
from megatron_fp8.vocab import KV_SCALE_KINDS, SCALE_SUFFIX, is_kv_scale_name

if TYPE_CHECKING:  # vLLM's types, for annotations only (vLLM is optional at import time)
    from vllm.model_executor.layers.linear import LinearBase

logger = logging.getLogger(__name__)

EXPERT_PROJ_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
"""Checkpoint names of an expert's (gate, up, down) projections (Qwen/Llama/DeepSeek; Mixtral)."""


def local_part(
    module: torch.nn.Module, key: str | int | None, kind: str, t: torch.Tensor, *, block: int, local: bool = False
) -> torch.Tensor:
    """This TP rank's part of one checkpoint shard (``kind``: ``column``, ``row`` or ``replicated``).

    Args:
        module: the vLLM linear module.
        key: the fused shard (``"q"``/``"k"``/``"v"``, a merged index) or ``None``.
        t: the full checkpoint tensor (weight ``[N, K]`` or its block scale), or with ``local`` already the part.
        block: rows per element of ``t`` (1: weight, 128: block scale).
        local: ``t`` is this rank's part already (returned as it is).
    """
    tp_rank, tp_size = int(getattr(module, "tp_rank", 0)), int(getattr(module, "tp_size", 1))
    if tp_size == 1 or kind == "replicated" or local:
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
    *,
    local: bool = False,
) -> dict[str, torch.Tensor]:
    """The engine tensors of one FP8 linear module in a processed layout (``rowmajor``/``transposed``/``ue8m0``).

    A fused weight comes back as a :class:`~megatron_fp8.rollout.vllm.layouts.RowParts` of its shards (not
    concatenated; ``ue8m0`` re-quantizes it whole), its scales as one tensor.

    Args:
        module: the vLLM linear module.
        layout: its :class:`~megatron_fp8.rollout.vllm.layouts.LinearLayout`.
        shards: ``[(key, hf_prefix)]`` of the module's checkpoint shards, in fused order.
        kind: ``column``, ``row`` or ``replicated``.
        sent: checkpoint-format tensors by name (``X.weight`` e4m3, ``X.weight_scale_inv`` float32).
        local: ``sent`` holds this TP rank's parts (:func:`local_part`).

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
        weights.append(local_part(module, key, kind, w, block=1, local=local))
        scales.append(local_part(module, key, kind, s, block=bn, local=local))
    weight = stacked(weights)  # the fused weight, not concatenated: each shard is copied into its own rows
    scale = torch.cat(scales, dim=0) if len(scales) > 1 else scales[0]  # 1/16384 of the weight's elements
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


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor lands: ``param.data[index]`` gets ``source[src_index]``."""

    param: torch.nn.Parameter
    index: tuple[slice, ...]
    src_index: tuple[slice, ...]
    name: str


def _inplace_targets(model: torch.nn.Module) -> dict[str, list[tuple[LinearBase, str | int | None, str]]]:
    packed = {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}
    linear_cls = layers.linear_base_cls()
    out: dict[str, list[tuple[LinearBase, str | int | None, str]]] = {}
    for _, module in model.named_modules():
        if not isinstance(module, linear_cls):
            continue
        head, _, last = module.prefix.rpartition(".")
        shards = packed.get(last)
        if shards:
            keys: list[str | int] = list("qkv") if hasattr(module, "num_kv_head_replicas") else list(range(len(shards)))
            for key, shard in zip(keys, shards, strict=True):
                out[f"{head}.{shard}"] = [(module, key, "column")]
        else:
            kind = (
                "row"
                if type(module).__name__ == "RowParallelLinear"
                else ("replicated" if type(module).__name__ in ("ReplicatedLinear", "GateLinear") else "column")
            )
            out[module.prefix] = [(module, None, kind)]
    return out


def _plan_processed(
    model: torch.nn.Module,
    targets: dict[str, list[tuple[LinearBase, str | int | None, str]]],
    items: list[tuple[str, torch.Tensor]],
    *,
    local: bool = False,
) -> tuple[dict[str, torch.nn.Module], set[str], list, list]:
    """Plan the modules whose held layout is not the checkpoint's (vLLM 0.11 processed FP8, experts, KV).

    Returns:
        ``(modules by name, stream names consumed, [(module, {param: tensor})], [(attention, {kind: scale})])``.
    """
    sent = dict(items)
    modules = dict(model.named_modules())
    done: set[str] = set()
    writes: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
    kv_writes: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
    seen: set[int] = set()
    for base, entries in targets.items():
        module, _, kind = entries[0]
        if id(module) in seen or f"{base}.weight" not in sent:
            continue
        layout = layouts.linear_layout(module)
        if layout.kind not in ("rowmajor", "transposed", "ue8m0"):
            continue
        seen.add(id(module))
        shards = [(key, b) for b, ((m, key, _k),) in targets.items() if m is module]
        writes.append((module, plan_linear(module, layout, shards, kind, sent, local=local)))
        done.update(n for _k, b in shards for n in (f"{b}.weight", f"{b}.weight_scale_inv"))
    experts_cls = layers.routed_experts_cls()
    for module in modules.values():
        prefix = layers.experts_prefix(module) if isinstance(module, experts_cls) else ""
        if prefix and any(n.startswith(prefix + ".") for n in sent):
            if local and int(getattr(module, "tp_size", 1)) > 1:
                raise UnknownLayoutError(prefix, "experts split over TP ranks", "a version of this rank's parts")
            tensors, used = plan_experts(module, prefix, sent)
            writes.append((module, tensors))
            done.update(used)
    for prefix in sorted({n.rpartition(".")[0] for n in sent if is_kv_scale_name(n)}):
        if prefix in modules:
            kv_writes.append((modules[prefix], plan_kv(modules[prefix], prefix, sent)))
            done.update(f"{prefix}.{k}_scale" for k in ("q", "k", "v"))
    return modules, done, writes, kv_writes


def inplace_load_weights(
    model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *, local: bool = False
) -> None:
    """Copy checkpoint-format tensors into a built vLLM model's existing Parameters (no rebinding).

    For vLLM releases without layerwise reload: after ``process_weights_after_loading``
    the Parameters of FP8 layers are new objects without their ``weight_loader``, so
    ``model.load_weights`` cannot be called again. This writes each HF shard into the
    fused Parameter's rows itself: q/k/v into ``qkv_proj`` (this TP rank's heads, KV
    heads replicated when TP > KV heads), gate/up into ``gate_up_proj``, row-parallel
    weights by columns, ``weight_scale_inv`` by 128-row blocks; other tensors go through
    the Parameter's own ``weight_loader`` (embeddings, norms keep theirs). Modules that
    vLLM processed after loading (0.11: FP8 linears with ``weight_scale``, fused MoE, KV
    scales) are mapped onto the layout they hold (:mod:`~megatron_fp8.rollout.vllm.layouts`:
    transposed scales, UE8M0 re-quantization, ``_k_scale``) by :func:`plan_linear`,
    :func:`plan_experts` and :func:`plan_kv`. Every target is resolved and shape-checked,
    and every processed module fully mapped, before the first byte is copied. With ``local``
    the tensors are this TP rank's parts (the module docstring); a vocabulary part is written
    into the embedding's first rows and its padding zeroed, as vLLM's loader does.

    Raises:
        RefitTargetError: an unknown name, a shape mismatch, a missing shard of a processed
            module, or a layout this fallback does not know
            (:class:`~megatron_fp8.rollout.vllm.layouts.UnknownLayoutError`: names the module,
            the layout found and the vLLM version).
    """
    items = list(weights)
    targets = _inplace_targets(model)
    params = dict(model.named_parameters())
    modules, done, writes, kv_writes = _plan_processed(model, targets, items, local=local)
    embedding_cls = layers.vocab_embedding_cls()
    plan: list[tuple[_Target | None, str, torch.Tensor]] = []
    for name, tensor in items:
        if name in done:
            continue
        base, _, leaf = name.rpartition(".")
        if base in targets and leaf in ("weight", "weight_scale_inv"):
            module, shard, kind = targets[base][0]
            param = getattr(module, leaf, None)
            if param is None:
                raise RefitTargetError(f"{name}: the vLLM module {module.prefix} has no {leaf!r}")
            block = 1
            if leaf == "weight_scale_inv":
                wshape = module.weight.shape
                block = ceil_div(wshape[0], param.shape[0]) if param.dim() == 2 else 1
            tp_rank, tp_size = int(getattr(module, "tp_rank", 0)), int(getattr(module, "tp_size", 1))
            if kind == "column":
                rows = tensor.shape[0] * block * (tp_size if local else 1)  # a plain column split is even
                dst_rows, src_rows, full = layouts.column_slices(module, shard, rows, block)
                expected = (ceil_div(full, block), param.shape[1])
                if local:  # the part is the slice itself
                    src_rows = slice(None)
                    expected = (dst_rows.stop - dst_rows.start, param.shape[1])
                t = _Target(param, (dst_rows,), (src_rows,), name)
            elif kind == "row" and local:
                expected = tuple(param.shape)
                t = _Target(param, (slice(None), slice(None)), (slice(None), slice(None)), name)
            elif kind == "row":
                expected = (param.shape[0], param.shape[1] * tp_size)
                cols = tensor.shape[1] // tp_size
                t = _Target(
                    param, (slice(None), slice(None)), (slice(None), slice(tp_rank * cols, (tp_rank + 1) * cols)), name
                )
            else:
                expected = tuple(param.shape)
                t = _Target(param, (slice(None),), (slice(None),), name)
            if tuple(tensor.shape) != tuple(expected):
                raise RefitTargetError(
                    f"{name}: shape {tuple(tensor.shape)} does not fit {module.prefix}.{leaf}, which "
                    f"expects {tuple(expected)} for this HF tensor"
                )
            dst, src = param.data[t.index], tensor[t.src_index]
            if tuple(dst.shape) != tuple(src.shape):
                raise RefitTargetError(
                    f"{name}: {tuple(src.shape)} does not fit {module.prefix}.{leaf} rows/cols "
                    f"{tuple(dst.shape)} (TP rank {getattr(module, 'tp_rank', 0)})"
                )
            if dst.dtype != src.dtype:
                raise RefitTargetError(
                    f"{name}: {src.dtype} arrived for {module.prefix}.{leaf}, which holds {dst.dtype}"
                )
            plan.append((t, name, tensor))
        elif name in params:
            param = params[name]
            sharded = getattr(param, "weight_loader", None) is not None and param.dim() >= 1
            rows_ok = sharded and tensor.dim() == param.dim() and tuple(tensor.shape[1:]) == tuple(param.shape[1:])
            if (tuple(tensor.shape) != tuple(param.shape) and not rows_ok) or (
                local and tensor.shape[:1] > param.shape[:1]
            ):
                raise RefitTargetError(f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
            if tensor.dtype != param.dtype:
                raise RefitTargetError(f"{name}: {tensor.dtype} arrived for a parameter that holds {param.dtype}")
            plan.append((None, name, tensor))
        elif ".experts." in name:
            raise RefitTargetError(f"{name}: routed experts need vLLM's layerwise reload (vLLM >= 0.15) to be refit")
        elif is_kv_scale_name(name):
            raise RefitTargetError(f"{name}: the engine has no attention layer {name.rpartition('.')[0]!r}")
        else:
            raise RefitTargetError(f"{name} is not a parameter of this vLLM model ({type(model).__name__})")
    for module, tensors in writes:
        layouts.write_inplace(module, tensors)
    for module, scales in kv_writes:
        layouts.write_kv_scales(module, scales)
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []  # plain copies: one multi-tensor copy per dtype (copy_by_dtype)
    with torch.no_grad():
        for t, name, tensor in plan:
            if t is not None:
                dst.append(t.param.data[t.index])
                src.append(tensor[t.src_index])
                continue
            param = params[name]
            module = modules.get(name.rpartition(".")[0])
            if local and isinstance(module, embedding_cls) and int(getattr(module, "tp_size", 1)) > 1:
                rows = tensor.shape[0]  # this rank's vocabulary rows: vLLM's loader would slice them again
                dst.append(param.data[:rows])
                src.append(tensor)
                param.data[rows:].fill_(0)
                continue
            loader = getattr(param, "weight_loader", None)
            if loader is not None:  # vLLM's own loader (embeddings, norms): it picks this rank's slice itself
                loader(param, tensor)
            else:
                dst.append(param.data)
                src.append(tensor)
        copy_by_dtype(dst, src)
