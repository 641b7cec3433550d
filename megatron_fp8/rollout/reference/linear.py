"""Linear layers of the reference FP8 engine: vLLM's W8A8 blockwise GEMM and the BF16 GEMM.

This is part of an emulator and oracle of vLLM's FP8 W8A8 blockwise numerics
for CPU machines, NOT a serving engine; on GPU use vLLM.

W8A8 blockwise (what vLLM's CUTLASS / DeepGEMM / Triton block kernels compute)::

    qa, sa = quantize_per_token_group(x, group_size=block_k)       # 1 x 128 groups, dynamic
    y[m, n] = sum_kb  P[m, n, kb] * (sa[m, kb] * sw[n // block_n, kb])   (float32, kb ascending)
    P[m, n, kb] = sum_{k in block kb} qa[m, k] * qw[n, k]

The per-block partial products ``P`` are computed in float64, where they are
*exact*: an e4m3 product is a multiple of ``2**-18`` below ``2**17.6`` and a
128-term sum stays below ``2**25``, so 43 bits suffice. ``P`` is then rounded
once to float32, multiplied by the combined scale and accumulated over K
blocks in float32 in ascending order (DeepGEMM's promotion scheme), and the
result is rounded to bfloat16. A GPU kernel's float32 partial sums differ from
this canonical value only in their summation order (about 1 float32 ulp), and
this emulator's result does not depend on the batch size or on how rows are
grouped, so a prefill and a decode step of the same token agree bit for bit.

What was checked before writing this (see the module tests): torch 2.13's CPU
``torch._scaled_mm`` / ``torch.nn.functional.scaled_mm`` accept only tensorwise
and rowwise scales on CPU (``BlockWise1x128`` x ``BlockWise128x128`` is
rejected with "Invalid scaling configuration"); vLLM-CPU's
``CPUFp8BlockScaledMMKernel`` is W8A16 and needs AMX; vLLM's only torch-native
block fallback (ROCm gfx1250) dequantizes both operands and runs one float32
GEMM, which is not the per-block accumulation; torchao is not installed. So no
library blockwise W8A8 GEMM runs here. The tests cross-check this one against
rowwise ``torch._scaled_mm`` applied per K block and summed, and against a
float64 evaluation of the formula.

BF16 linears: bfloat16 inputs and weights, products summed in float64 (at
least as accurate as a float32 accumulator, and order independent far below
bfloat16 resolution), bias added before the single rounding to bfloat16.
"""

from __future__ import annotations

import torch

from megatron_fp8.errors import QuantInputError
from megatron_fp8.layout import ceil_div
from megatron_fp8.quant import quantize_per_token_group
from megatron_fp8.quant.formats import FP8_DTYPE

_ROWS_BUDGET_ELEMS = 1 << 22
"""Bounds the float64 ``[KB, rows, N]`` partial-product temporary per step (32 MiB)."""


def _check_block_operands(
    qw: torch.Tensor, sw: torch.Tensor, k: int, block_size: tuple[int, int], name: str | None
) -> tuple[int, int]:
    label = f"weight {name!r}" if name else "weight"
    bn, bk = block_size
    if qw.dtype != FP8_DTYPE or qw.dim() != 2:
        raise QuantInputError(f"{label}: expected a 2-D {FP8_DTYPE} [N, K] tensor, got {qw.dtype} {tuple(qw.shape)}")
    n, kw = qw.shape
    if kw != k:
        raise QuantInputError(f"{label}: input has K={k} but the weight is {tuple(qw.shape)} ([N, K])")
    if k % bk:
        raise QuantInputError(
            f"{label}: K={k} is not a multiple of block_k={bk}; vLLM's per-token-group activation quantizer "
            "needs whole groups (keep this layer in BF16)"
        )
    expected = (ceil_div(n, bn), k // bk)
    if sw.dtype != torch.float32 or tuple(sw.shape) != expected:
        raise QuantInputError(
            f"{label}: scale_inv must be float32 {expected} for block_size {block_size}, "
            f"got {sw.dtype} {tuple(sw.shape)}"
        )
    return n, k // bk


def w8a8_block_fp8_matmul(
    qa: torch.Tensor,
    sa: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    *,
    block_size: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    name: str | None = None,
    weight_f64: torch.Tensor | None = None,
) -> torch.Tensor:
    """Blockwise-scaled FP8 GEMM on already quantized operands.

    Args:
        qa: float8_e4m3fn activations ``[M, K]``.
        sa: float32 activation scales ``[M, K // block_k]`` (one per token and group).
        qw: float8_e4m3fn weight ``[N, K]``.
        sw: float32 weight block scales ``[ceil(N / block_n), K // block_k]``.
        block_size: ``(block_n, block_k)``.
        bias: optional ``[N]`` bias, added in float32 before the output rounding.
        out_dtype: ``torch.bfloat16`` (what vLLM returns) or ``torch.float32``
            (the float32 accumulator itself, for tests).
        name: weight name used in error messages.
        weight_f64: optional ``qw.to(torch.float64)`` computed once by the caller
            (the conversion dominates the cost of small GEMMs); must equal it.

    Returns:
        ``[M, N]`` tensor in ``out_dtype``.

    Raises:
        QuantInputError: dtype / shape mismatch, naming the weight.
    """
    if qa.dtype != FP8_DTYPE or qa.dim() != 2:
        raise QuantInputError(f"activations for {name!r}: expected 2-D {FP8_DTYPE}, got {qa.dtype} {tuple(qa.shape)}")
    m, k = qa.shape
    n, kb = _check_block_operands(qw, sw, k, block_size, name)
    bn, bk = block_size
    if sa.dtype != torch.float32 or tuple(sa.shape) != (m, kb):
        raise QuantInputError(
            f"activations for {name!r}: scales must be float32 {(m, kb)}, got {sa.dtype} {tuple(sa.shape)}"
        )
    if weight_f64 is None:
        weight_f64 = qw.to(torch.float64)
    elif weight_f64.dtype != torch.float64 or weight_f64.shape != qw.shape:
        raise QuantInputError(f"weight {name!r}: weight_f64 must be float64 {tuple(qw.shape)}")
    w64 = weight_f64.view(n, kb, bk).transpose(0, 1).transpose(1, 2)  # [KB, bk, N] view of row-major [KB, N, bk]
    sw_rows = sw.repeat_interleave(bn, dim=0)[:n].t().contiguous()  # [KB, N]
    out = torch.empty((m, n), dtype=out_dtype)
    rows = max(1, _ROWS_BUDGET_ELEMS // max(1, kb * n))
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        a64 = qa[r0:r1].to(torch.float64).view(r1 - r0, kb, bk).transpose(0, 1)  # [KB, rows, bk]
        partial = torch.bmm(a64, w64).to(torch.float32)  # exact in float64, one rounding to float32
        acc = torch.zeros((r1 - r0, n), dtype=torch.float32)
        for b in range(kb):
            acc.add_(partial[b] * (sa[r0:r1, b, None] * sw_rows[b][None, :]))
        if bias is not None:
            acc.add_(bias.to(torch.float32))
        out[r0:r1] = acc.to(out_dtype)
    return out


def w8a8_block_fp8_linear(
    x: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    *,
    block_size: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
    activation_scale_format: str = "fp32",
    out_dtype: torch.dtype = torch.bfloat16,
    name: str | None = None,
    weight_f64: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's dynamic W8A8 blockwise FP8 linear: quantize ``x`` per token group, then the block GEMM.

    Args:
        x: ``[..., K]`` bfloat16 activations.
        qw: float8_e4m3fn ``[N, K]`` weight.
        sw: float32 ``[ceil(N/block_n), K/block_k]`` weight ``scale_inv``.
        block_size: ``(block_n, block_k)``; activations use groups of ``block_k``.
        bias: optional ``[N]`` bias.
        activation_scale_format: ``"fp32"`` or ``"ue8m0"`` activation scales.
        out_dtype: output dtype (bfloat16 as in vLLM).
        name: weight name used in error messages.
        weight_f64: optional cached ``qw.to(torch.float64)`` (see :func:`w8a8_block_fp8_matmul`).

    Returns:
        ``[..., N]`` tensor in ``out_dtype``.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    _check_block_operands(qw, sw, k, block_size, name)
    qa, sa = quantize_per_token_group(
        x2,
        group_size=block_size[1],
        scale_format=activation_scale_format,
        name=f"input of {name}" if name else None,
        backend="torch",
    )
    y = w8a8_block_fp8_matmul(
        qa, sa, qw, sw, block_size=block_size, bias=bias, out_dtype=out_dtype, name=name, weight_f64=weight_f64
    )
    return y.view(*lead, qw.shape[0])


def bf16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    name: str | None = None,
) -> torch.Tensor:
    """BF16 linear ``x @ weight.T (+ bias)``: float64 accumulation, one rounding to ``out_dtype``.

    Args:
        x: ``[..., K]`` bfloat16 activations.
        weight: ``[N, K]`` bfloat16 weight.
        bias: optional ``[N]`` bias.
        out_dtype: output dtype (bfloat16).
        name: weight name used in error messages.

    Returns:
        ``[..., N]`` tensor in ``out_dtype``.
    """
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise QuantInputError(
            f"weight {name!r}: shape {tuple(weight.shape)} does not match input K={x.shape[-1]} ([N, K] expected)"
        )
    y = x.to(torch.float64) @ weight.to(torch.float64).t()
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(out_dtype)
