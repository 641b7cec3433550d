"""Blockwise FP8 of many weights at once, written straight into caller-owned outputs (e.g. a refit bucket).

:func:`quantize_blockwise_into` produces the same bytes as :func:`~megatron_fp8.quant.quantize_blockwise` (with
``nonfinite="defer"``) for every weight, but writes each weight's codes and block scales into the tensors the
caller hands it (typed views of a bucket's byte buffer) and issues a fixed handful of device ops for the whole
group, not a set per weight:

* torch path (CPU, and CUDA without Triton): the weights' tiles are gathered into one float32 workspace
  ``[T, bn, bk]`` (tile-major; the partial tiles at the N/K edges padded with zeros, which never raise a
  maximum of ``|x|``) by one multi-tensor copy, then one inf-norm per tile gives every ``amax``, a few
  elementwise ops the scales, one in-place division the quotients, and one multi-tensor copy casts the
  quotients into every weight's codes and the scales into every weight's scale tensor. The workspace is bounded
  by ``workspace_bytes``: a larger group runs in several such rounds (weights split at row-block boundaries),
  reusing one buffer;
* Triton path (CUDA tensors when Triton imports): one kernel launch for the whole group (per source dtype) over
  a table of its weights (:mod:`megatron_fp8.quant.triton_grouped`), writing into the outputs (tested against the
  torch path under ``TRITON_INTERPRET=1``, ``tests/quant/test_grouped_triton.py``).

Non-finite input is never checked here (no host sync): a tile holding NaN/Inf gets a ``+inf`` scale, as with
``nonfinite="defer"``, so the caller learns which weight is bad from the scales it already holds (the refit
packer folds them into its one host read per bucket).

The torch path does not clamp the quotient to +-448 as :mod:`megatron_fp8.quant.blockwise` does: with
``scale = RN(amax / 448)`` (or the larger ue8m0 power of two, or the 2**-126 floor, which only applies when
``amax < 448 * 2**-126``) every finite quotient is at most ``448 * (1 + 2**-24)``, which the cast rounds to 448,
and a non-finite quotient only occurs in a block with an infinite scale, where the clamp does not change a NaN.
The tests check the bytes against the per-weight quantizer.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_fp8.layout import block_scale_shape, ceil_div
from megatron_fp8.quant import _checks
from megatron_fp8.quant.blockwise import Backend, _check_block_size, resolve_backend
from megatron_fp8.quant.formats import (
    FP8_DTYPE,
    MIN_SCALE,
    SCALE_RULES,
    ScaleFormat,
    check_scale_format,
    fp8_max_on,
)

__all__ = ["DEFAULT_WORKSPACE_BYTES", "BlockwiseTarget", "quantize_blockwise_into"]

DEFAULT_WORKSPACE_BYTES = 64 << 20
"""Float32 workspace of one torch-path round, bytes (64 MiB: 16M elements, a 16 MiB FP8 payload per round)."""

_ZEROS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def zero_scalar(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A cached 0-d zero of ``dtype`` on ``device``: expanded, the source of a zero fill inside a multi-tensor copy."""
    key = (torch.device(device), dtype)
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros((), dtype=dtype, device=device)
    return z


@dataclass(frozen=True)
class BlockwiseTarget:
    """One weight and where its FP8 codes and block scales go.

    Attributes:
        x: ``[N, K]`` weight or ``[E, N, K]`` expert stack; bfloat16, float16 or float32; any strides.
        codes: float8_e4m3fn, ``x``'s shape, any strides (e.g. a view of a bucket); written.
        scales: float32 ``[ceil(N/bn), ceil(K/bk)]`` (``[E, ...]`` for 3-D), contiguous; written.
        name: the weight's name, for error messages.
    """

    x: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    name: str | None = None


def _check_target(t: BlockwiseTarget, block_size: tuple[int, int]) -> None:
    _checks.check_input(
        t.x, ranks=(2, 3), what="quantize_blockwise_into", name=t.name, scale_format="fp32", nonfinite="defer"
    )
    want = block_scale_shape(tuple(t.x.shape), block_size)
    if t.codes.dtype != FP8_DTYPE or tuple(t.codes.shape) != tuple(t.x.shape):
        raise _checks.QuantInputError(
            f"quantize_blockwise_into: codes of {t.name!r} must be {FP8_DTYPE} {tuple(t.x.shape)}, got "
            f"{t.codes.dtype} {tuple(t.codes.shape)}"
        )
    if t.scales.dtype != torch.float32 or tuple(t.scales.shape) != want or not t.scales.is_contiguous():
        raise _checks.QuantInputError(
            f"quantize_blockwise_into: scales of {t.name!r} must be contiguous float32 {want}, got "
            f"{t.scales.dtype} {tuple(t.scales.shape)}"
        )


@dataclass(frozen=True)
class _Piece:
    """Row blocks ``[b0, b1)`` of one 2-D weight (or one expert of a stack)."""

    x: torch.Tensor  # [n, k] rows of the source
    codes: torch.Tensor  # [n, k] rows of the codes
    scales: torch.Tensor  # [(b1 - b0) * kb] flat, row-major scales of those row blocks
    nb: int
    kb: int

    @property
    def tiles(self) -> int:
        return self.nb * self.kb


def _pieces(t: BlockwiseTarget, bn: int, bk: int, max_tiles: int) -> Iterator[_Piece]:
    x3 = t.x if t.x.dim() == 3 else t.x.unsqueeze(0)
    q3 = t.codes if t.codes.dim() == 3 else t.codes.unsqueeze(0)
    e, n, k = x3.shape
    nb, kb = ceil_div(n, bn), ceil_div(k, bk)
    s2 = t.scales.view(e, nb * kb)
    step = max(1, max_tiles // kb)  # row blocks per piece
    for ei in range(e):
        for b0 in range(0, nb, step):
            b1 = min(nb, b0 + step)
            r0, r1 = b0 * bn, min(n, b1 * bn)
            yield _Piece(x3[ei, r0:r1], q3[ei, r0:r1], s2[ei, b0 * kb : b1 * kb], b1 - b0, kb)


def _regions(
    tiles: torch.Tensor, data: torch.Tensor, bn: int, bk: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Pair each part of a 2-D ``data`` block grid with its place in tile-major ``tiles`` ``[nb, kb, bn, bk]``.

    Returns:
        ``([(tile view, data view), ...], [pad views])``: the full-tile part, the right and bottom edge strips and
        the corner (each pair the same shape), and the parts of the edge tiles outside ``data``.
    """
    n, k = data.shape
    nf, kf = n // bn, k // bk
    nr, kr = n - nf * bn, k - kf * bk
    pairs = []
    if nf and kf:
        pairs.append((tiles[:nf, :kf].permute(0, 2, 1, 3), data[: nf * bn, : kf * bk].view(nf, bn, kf, bk)))
    if nf and kr:
        pairs.append((tiles[:nf, kf, :, :kr], data[: nf * bn, kf * bk :].view(nf, bn, kr)))
    if nr and kf:
        pairs.append((tiles[nf, :kf, :nr, :].permute(1, 0, 2), data[nf * bn :, : kf * bk].view(nr, kf, bk)))
    if nr and kr:
        pairs.append((tiles[nf, kf, :nr, :kr], data[nf * bn :, kf * bk :]))
    pads = []
    if kr:
        pads.append(tiles[:nf, kf, :, kr:])
    if nr:
        pads.append(tiles[nf, :, nr:, :])
    if nr and kr:
        pads.append(tiles[nf, kf, :nr, kr:])
    return pairs, [p for p in pads if p.numel()]


def _fp32_scale_(amax: torch.Tensor) -> torch.Tensor:
    """:data:`SCALE_RULES` ``"fp32"`` in 4 ops (same values): ``max(amax / 448, 2**-126)``, 1.0 where ``amax == 0``."""
    scale = amax.div(fp8_max_on(amax.device)).clamp_min_(MIN_SCALE)
    return scale.masked_fill_(amax == 0, 1.0)


def _rounds(pieces: list[_Piece], max_tiles: int) -> Iterator[list[_Piece]]:
    group: list[_Piece] = []
    used = 0
    for p in pieces:
        if group and used + p.tiles > max_tiles:
            yield group
            group, used = [], 0
        group.append(p)
        used += p.tiles
    if group:
        yield group


def _quantize_torch(
    targets: Sequence[BlockwiseTarget],
    bn: int,
    bk: int,
    scale_format: str,
    *,
    workspace_bytes: int,
    copies: tuple[list[torch.Tensor], list[torch.Tensor]],
) -> int:
    """The torch path (see the module docstring); returns the number of rounds."""
    max_tiles = max(1, workspace_bytes // (4 * bn * bk))
    pieces = [p for t in targets for p in _pieces(t, bn, bk, max_tiles)]
    device = targets[0].codes.device
    ws_tiles = max(min(sum(p.tiles for p in pieces), max_tiles), max(p.tiles for p in pieces))
    workspace = torch.empty((ws_tiles, bn, bk), dtype=torch.float32, device=device)
    rule = _fp32_scale_ if scale_format == "fp32" else SCALE_RULES[scale_format]
    rounds = 0
    for group in _rounds(pieces, max_tiles):
        dst_in, src_in = (list(copies[0]), list(copies[1])) if rounds == 0 else ([], [])
        dst_out: list[torch.Tensor] = []
        src_out: list[torch.Tensor] = []
        at = 0
        spans = []
        for p in group:
            tiles = workspace[at : at + p.tiles].view(p.nb, p.kb, bn, bk)
            pairs, pads = _regions(tiles, p.x, bn, bk)
            for tile_view, x_view in pairs:
                dst_in.append(tile_view)
                src_in.append(x_view)
            for pad in pads:
                dst_in.append(pad)
                src_in.append(zero_scalar(device, torch.float32).expand(pad.shape))
            for tile_view, q_view in _regions(tiles, p.codes, bn, bk)[0]:
                dst_out.append(q_view)
                src_out.append(tile_view)
            spans.append((at, p))
            at += p.tiles
        work = workspace[:at]
        torch._foreach_copy_(dst_in, src_in)  # the tiles (and the caller's own copies)
        amax = torch.linalg.vector_norm(work.view(at, bn * bk), ord=math.inf, dim=1)  # one op; NaN propagates
        amax.nan_to_num_(nan=math.inf, posinf=math.inf)  # a NaN tile -> +inf amax and scale (as the kernel)
        scale = rule(amax)
        work.div_(scale[:, None, None])
        for start, p in spans:
            dst_out.append(p.scales)
            src_out.append(scale[start : start + p.tiles])
        torch._foreach_copy_(dst_out, src_out)  # cast into every weight's codes; every weight's scales
        rounds += 1
    return rounds


def _quantize_triton(
    triton_kernels: types.ModuleType,
    targets: Sequence[BlockwiseTarget],
    bn: int,
    bk: int,
    scale_format: str,
    *,
    copies: tuple[list[torch.Tensor], list[torch.Tensor]],
) -> int:
    """The Triton path: one launch per source dtype for the whole group
    (:func:`~megatron_fp8.quant.triton_grouped.launch_blockwise_grouped`), codes and scales written straight into
    the targets' tensors; returns the number of launches.

    Codes that are not contiguous go through a staging tensor (copied in one multi-tensor copy with ``copies``).
    Under Triton's CPU interpreter (``TRITON_INTERPRET=1``), whose float32 -> float8 cast is not
    round-to-nearest-even, the kernel stores the clamped float32 quotient in a staging tensor and torch casts it
    into the codes (as ``quantize_blockwise_triton(fp8_out=False)``); the scales are written in place either way.
    """
    from megatron_fp8.quant.triton_grouped import GroupedItem, launch_blockwise_grouped

    fp8_out = not triton_kernels.interpreter_active()
    dst, src = copies
    staged_dst: list[torch.Tensor] = []
    staged_src: list[torch.Tensor] = []
    by_dtype: dict[torch.dtype, list[GroupedItem]] = {}
    for t in targets:
        x3 = (t.x if t.x.dim() == 3 else t.x.unsqueeze(0)).contiguous()
        q3 = t.codes if t.codes.dim() == 3 else t.codes.unsqueeze(0)
        direct = fp8_out and q3.is_contiguous()
        q_out = q3 if direct else torch.empty(q3.shape, dtype=FP8_DTYPE if fp8_out else torch.float32, device=q3.device)
        by_dtype.setdefault(x3.dtype, []).append(GroupedItem(x3, q_out, t.scales.view(-1)))
        if not direct:
            staged_dst.append(q3)
            staged_src.append(q_out)
    for items in by_dtype.values():
        launch_blockwise_grouped(items, bn, bk, scale_format, fp8_out=fp8_out)
    if dst or staged_dst:
        torch._foreach_copy_(dst + staged_dst, src + staged_src)
    return len(by_dtype)


def quantize_blockwise_into(
    targets: Sequence[BlockwiseTarget],
    *,
    block_size: tuple[int, int] = (128, 128),
    scale_format: ScaleFormat = "fp32",
    backend: Backend = "auto",
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    copies: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
) -> None:
    """Quantize every target's weight into its ``codes`` and ``scales`` (the bytes of :func:`quantize_blockwise`).

    No host sync and no non-finite check: a block holding NaN/Inf gets a ``+inf`` scale (read the scales to
    find it). Every target must be on one device.

    Args:
        targets: the weights and their outputs (:class:`BlockwiseTarget`); outputs must not overlap the inputs.
        block_size: ``(bn, bk)`` of a block along ``(N, K)``.
        scale_format: ``"fp32"`` or ``"ue8m0"``.
        backend: ``"auto"`` (Triton for CUDA tensors when it imports), ``"torch"`` or ``"triton"``.
        workspace_bytes: bound on the torch path's float32 workspace, bytes (rounded up to whole row blocks
            of the widest weight).
        copies: ``(dst, src)`` lists of other tensors to copy (``dst[i].copy_(src[i])``) in the same
            multi-tensor copy as the first round's input (a bucket's unquantized tensors); done before return.

    Raises:
        QuantInputError: a bad input or output shape/dtype, or a bad option.
    """
    bn, bk = _check_block_size(block_size)
    check_scale_format(scale_format)
    dst, src = (list(copies[0]), list(copies[1])) if copies is not None else ([], [])
    if not targets:
        if dst:
            torch._foreach_copy_(dst, src)
        return
    for t in targets:
        _check_target(t, (bn, bk))
    if resolve_backend(targets[0].x, backend) == "triton":
        from megatron_fp8.quant import triton_kernels  # lazy: imports Triton only when it runs

        _quantize_triton(triton_kernels, targets, bn, bk, scale_format, copies=(dst, src))
        return
    _quantize_torch(targets, bn, bk, scale_format, workspace_bytes=workspace_bytes, copies=(dst, src))
