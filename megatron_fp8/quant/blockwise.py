"""128x128 block quantization of weights (DeepSeek-style, what vLLM/DeepGEMM load).

Layout (DESIGN.md): a weight ``[N_out, K_in]`` is cut into ``block_size``
tiles; tile ``(i, j)`` covers rows ``[i*bn, min((i+1)*bn, N))`` and columns
``[j*bk, min((j+1)*bk, K))``. Its ``scale_inv`` (float32, row-major
``[ceil(N/bn), ceil(K/bk)]``) is ``amax(tile) / 448`` over the tile's *real*
elements, so ``W ~= q * scale_inv``. A 3-D ``[E, N, K]`` expert stack is
quantized per expert and gets scales ``[E, ceil(N/bn), ceil(K/bk)]``.

CUDA tensors go to the Triton kernel (:mod:`megatron_fp8.quant.triton_kernels`);
CPU tensors to a chunked torch implementation. Both produce the same bytes.
"""

from __future__ import annotations

import math
import typing
from typing import Literal

import torch

from megatron_fp8 import vocab
from megatron_fp8.layout import block_scale_shape, ceil_div
from megatron_fp8.quant import _checks
from megatron_fp8.quant.formats import FP8_DTYPE, FP8_MAX, SCALE_RULES, NonFinitePolicy, ScaleFormat

Backend = Literal["auto", "torch", "triton"]
"""Where a quantizer runs: ``"auto"`` (Triton for CUDA tensors), ``"torch"`` or ``"triton"``."""

_BACKENDS: tuple[str, ...] = typing.get_args(Backend)

_DEFAULT_BLOCK_SIZE = (vocab.DEFAULT_BLOCK, vocab.DEFAULT_BLOCK)

# Rows of the input processed per step on the torch path: bounds the float32
# temporary to ``_CHUNK_ELEMS * 4`` bytes so it stays in cache and memory stays flat.
_CHUNK_ELEMS = 1 << 20


def blockwise_scale_shape(
    shape: tuple[int, ...] | torch.Size, block_size: tuple[int, int] = _DEFAULT_BLOCK_SIZE
) -> tuple[int, ...]:
    """Shape of the ``scale_inv`` tensor for a weight (or expert stack) of ``shape``."""
    return block_scale_shape(tuple(shape), block_size)


def _check_block_size(block_size: tuple[int, int]) -> tuple[int, int]:
    if (
        not isinstance(block_size, (tuple, list))
        or len(block_size) != 2
        or not all(isinstance(b, int) and b > 0 for b in block_size)
    ):
        raise _checks.QuantInputError(f"block_size must be two positive ints, got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def resolve_backend(x: torch.Tensor, backend: Backend) -> str:
    """Pick ``"triton"`` for CUDA tensors (when Triton imports) and ``"torch"`` otherwise."""
    if backend not in _BACKENDS:
        raise _checks.QuantInputError(f"unknown backend {backend!r}; valid names: {list(_BACKENDS)}")
    if backend == "auto":
        if x.is_cuda:
            from megatron_fp8.quant import triton_kernels  # lazy: imports Triton (optional) only for CUDA tensors

            return "triton" if triton_kernels.available() else "torch"
        return "torch"
    return backend


def _blockwise_torch(
    x3: torch.Tensor, bn: int, bk: int, scale_format: str, *, name: str | None, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation over a ``[E, N, K]`` stack.

    Works through a few row blocks at a time in one preallocated float32 buffer
    (copy in, amax, divide and clamp in place, cast out), so every elementwise
    step runs on cache-resident data and memory stays flat: an order of
    magnitude faster on CPU than the textbook permute-based version.
    """
    e, n, k = x3.shape
    nb, kb = ceil_div(n, bn), ceil_div(k, bk)
    kp = kb * bk
    q = torch.empty((e, n, k), dtype=FP8_DTYPE, device=x3.device)
    amax = torch.empty((e, nb, kb), dtype=torch.float32, device=x3.device)
    scale = torch.empty_like(amax)
    rows_per_chunk = max(1, _CHUNK_ELEMS // (bn * kp))  # row blocks per step
    buf = torch.empty((min(nb, rows_per_chunk) * bn, kp), dtype=torch.float32, device=x3.device)
    if kp != k:
        buf[:, k:] = 0  # zeros never raise a maximum of |x|: amax stays over real elements
    scale_fn = SCALE_RULES[scale_format]
    for ei in range(e):
        for b0 in range(0, nb, rows_per_chunk):
            b1 = min(nb, b0 + rows_per_chunk)
            r0, r1 = b0 * bn, min(n, b1 * bn)
            rows = (b1 - b0) * bn
            work = buf[:rows]
            work[: r1 - r0, :k].copy_(x3[ei, r0:r1])
            if r1 - r0 < rows:
                work[r1 - r0 :] = 0
            tiles = work.view(b1 - b0, bn, kb, bk)
            blk_amax = torch.maximum(tiles.amax(dim=(1, 3)), tiles.amin(dim=(1, 3)).neg_())
            blk_amax.nan_to_num_(nan=math.inf, posinf=math.inf)  # NaN block -> +inf amax and scale (as the kernel)
            amax[ei, b0:b1] = blk_amax
            blk_scale = scale_fn(blk_amax)
            scale[ei, b0:b1] = blk_scale
            tiles.div_(blk_scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
            q[ei, r0:r1].copy_(work[: r1 - r0, :k])
    if not check:
        return q, scale
    _checks.raise_on_nonfinite_amax(
        x3 if e > 1 else x3[0],
        amax if e > 1 else amax[0],
        block_size=(bn, bk),
        axis_names=(("expert",) if e > 1 else ()) + ("row_block", "col_block"),
        name=name,
        what="quantize_blockwise",
    )
    return q, scale


def quantize_blockwise(
    x: torch.Tensor,
    *,
    block_size: tuple[int, int] = _DEFAULT_BLOCK_SIZE,
    scale_format: ScaleFormat = "fp32",
    nonfinite: NonFinitePolicy = "raise",
    name: str | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight (or a stack of expert weights) to FP8 with per-block scales.

    Args:
        x: ``[N, K]`` weight or ``[E, N, K]`` expert stack; bfloat16, float16 or
            float32; CPU or CUDA. Any shape, including non-multiples of the block.
        block_size: ``(rows, cols)`` of a block along ``(N, K)``.
        scale_format: ``"fp32"`` (``amax/448``) or ``"ue8m0"`` (power of two).
        nonfinite: ``"raise"`` (default) raises :class:`NonFiniteError` naming
            the first block holding NaN/Inf before anything is returned (one host
            read); ``"sanitize"`` replaces NaN/Inf with 0 first; ``"defer"`` checks
            nothing and syncs nothing: such a block gets a ``+inf`` scale.
        name: tensor name used in error messages.
        backend: ``"auto"`` (Triton for CUDA tensors), ``"torch"`` or ``"triton"``.

    Returns:
        ``(q, scale_inv)``: ``q`` float8_e4m3fn with ``x``'s shape and device;
        ``scale_inv`` float32 ``[ceil(N/bn), ceil(K/bk)]`` (``[E, ...]`` for 3-D),
        row-major, with ``x ~= q * scale_inv`` per block.

    Raises:
        QuantInputError: wrong rank, non-float dtype, empty tensor, bad option.
        NonFiniteError: NaN/Inf in the input and ``nonfinite="raise"``.
    """
    _checks.check_input(
        x, ranks=(2, 3), what="quantize_blockwise", name=name, scale_format=scale_format, nonfinite=nonfinite
    )
    bn, bk = _check_block_size(block_size)
    if nonfinite == "sanitize":
        x = _checks.sanitize(x, name=name)
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    if resolve_backend(x, backend) == "triton":
        from megatron_fp8.quant import triton_kernels  # lazy: imports Triton (optional) only when it runs

        q, scale = triton_kernels.quantize_blockwise_triton(
            x3, bn, bk, scale_format, name=name, check=nonfinite != "defer"
        )
    else:
        q, scale = _blockwise_torch(x3, bn, bk, scale_format, name=name, check=nonfinite != "defer")
    if x.dim() == 2:
        return q[0], scale[0]
    return q, scale


def expand_block_scales(
    scale_inv: torch.Tensor, shape: tuple[int, ...] | torch.Size, block_size: tuple[int, int] = _DEFAULT_BLOCK_SIZE
) -> torch.Tensor:
    """Broadcast per-block scales to one value per element of ``shape`` (float32)."""
    bn, bk = _check_block_size(block_size)
    *_, n, k = shape
    full = scale_inv.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :n, :k]


def dequantize_blockwise(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    block_size: tuple[int, int] = _DEFAULT_BLOCK_SIZE,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``q * scale_inv`` per block.

    Args:
        q: float8_e4m3fn ``[N, K]`` or ``[E, N, K]``.
        scale_inv: float32 ``[ceil(N/bn), ceil(K/bk)]`` (``[E, ...]`` for 3-D).
        block_size: the block size used to quantize.
        out_dtype: dtype of the result (float32 by default: the product is exact
            in float32 for e4m3 values and power-of-two scales).

    Returns:
        Tensor of ``q``'s shape in ``out_dtype``.
    """
    bn, bk = _check_block_size(block_size)
    if q.dim() not in (2, 3) or scale_inv.dim() != q.dim():
        raise _checks.QuantInputError(
            f"dequantize_blockwise: q has shape {tuple(q.shape)} and scale_inv {tuple(scale_inv.shape)}; "
            "expected [N, K] with [ceil(N/bn), ceil(K/bk)] (or both with a leading expert axis)"
        )
    expected = blockwise_scale_shape(q.shape, (bn, bk))
    if tuple(scale_inv.shape) != expected:
        raise _checks.QuantInputError(
            f"dequantize_blockwise: scale_inv has shape {tuple(scale_inv.shape)} but q {tuple(q.shape)} "
            f"with block_size {(bn, bk)} needs {expected}"
        )
    full = expand_block_scales(scale_inv.to(torch.float32), q.shape, (bn, bk))
    return (q.to(torch.float32) * full).to(out_dtype)
