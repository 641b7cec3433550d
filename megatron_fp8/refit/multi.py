"""Multi-tensor device work for the appliers: a few ops per group of tensors, never one op per tensor.

A version holds hundreds of tensors; the per-tensor loops (a copy, a compare and a host read each) are
what made a refit host-bound. Here each step is one multi-tensor op (``torch._foreach_copy_``) or a few
ops over byte-concatenations bounded by :data:`CHUNK_BYTES`, and every result a caller needs on the host
comes back in one read. On CUDA with Triton, contiguous tensors take the grouped byte passes of
:mod:`megatron_fp8.refit.fused_fill` instead (a copy or a comparison in one pass at copy bandwidth, one launch per
element width).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_fp8.layout import ceil_div, contiguous_strides
from megatron_fp8.refit import fused_fill

CHUNK_BYTES = 256 << 20
"""Bytes compared per concatenation in :func:`first_mismatch` (bounds its temporaries: 2x this per chunk)."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view when contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


def snapshot(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (same dtypes and shapes), made with one flat buffer and one multi-tensor copy per device.

    Returns:
        One tensor per input, views into one new buffer per device.
    """
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for device, idx in by_device.items():
        # each copy starts at a multiple of 16 bytes, so one typed view of the buffer per dtype serves every copy
        # of that dtype: one strided view per tensor (the fused path then needs no other op per tensor)
        places, at = [], 0
        for i in idx:
            places.append(at)
            at += ceil_div(tensors[i].numel() * tensors[i].element_size(), 16) * 16
        buffer = torch.empty(at, dtype=torch.uint8, device=device)
        typed: dict[torch.dtype, torch.Tensor] = {}
        dst, src = [], []
        for i, place in zip(idx, places, strict=True):
            t = tensors[i]
            if not t.numel():
                out[i] = torch.empty_like(t)
                continue
            base = typed.get(t.dtype)
            if base is None:
                base = typed[t.dtype] = buffer.view(t.dtype)
            out[i] = base.as_strided(t.shape, contiguous_strides(t.shape), place // t.element_size())
            dst.append(out[i])
            src.append(t)  # read by pointer (fused) or through _bytes, which detaches
        if dst and fused_fill.runs_on(src):
            fused_fill.copy_many(dst, src)  # words as they are, addressed by data pointer
        elif dst:  # bytes as they are (a same-dtype copy could touch a NaN's payload)
            torch._foreach_copy_([_bytes(d) for d in dst], [_bytes(t) for t in src])
    return out  # type: ignore[return-value]


def smallest(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The smallest value of many floating-point tensors, with no op per tensor.

    Per (device, dtype) group one ``torch._foreach_neg`` and one ``torch._foreach_max`` (the largest negation), a
    stack and a reduction; ``-0.0`` and ``0.0`` both give a value that is not ``> 0``, a NaN anywhere gives NaN.
    Empty tensors are skipped.

    Args:
        tensors: floating-point tensors of any shapes, dtypes and devices (e.g. a version's block scales).
        device: where the result goes (the caller reads it with its other values in one host read).

    Returns:
        A 1-element float32 tensor on ``device``, or ``None`` when every tensor is empty.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    if not groups:
        return None
    with torch.no_grad():
        lows = [
            torch.stack(torch._foreach_max(torch._foreach_neg(group))).amax().float().to(device)
            for group in groups.values()
        ]
        return torch.stack(lows).amax().neg().reshape(1)


def copy_into(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every ``i`` in one multi-tensor op (same shapes and dtypes)."""
    if targets:
        with torch.no_grad():
            torch._foreach_copy_(list(targets), list(sources))


def first_mismatch(held: Sequence[torch.Tensor], sent: Sequence[torch.Tensor]) -> int | None:
    """Index of the first pair whose bytes differ, ``None`` when every ``held[i]`` equals ``sent[i]`` exactly.

    Compares byte-concatenations of up to :data:`CHUNK_BYTES` per device (two copies and two ops per chunk)
    and reads every chunk's verdict back in one host read per device; only a chunk that differs is then
    searched tensor by tensor. Shapes and dtypes must already agree (the appliers check them first).
    """
    chunks: dict[torch.device, list[list[int]]] = {}
    filled: dict[torch.device, int] = {}
    for i, h in enumerate(held):
        nbytes = h.numel() * h.element_size()
        if nbytes == 0:
            continue
        groups = chunks.setdefault(h.device, [[]])
        if groups[-1] and filled[h.device] + nbytes > CHUNK_BYTES:
            groups.append([])
            filled[h.device] = 0
        groups[-1].append(i)
        filled[h.device] = filled.get(h.device, 0) + nbytes
    bad: list[int] = []
    for device, groups in chunks.items():
        every = [i for g in groups for i in g]
        pairs = [held[i] for i in every] + [sent[i] for i in every]
        if fused_fill.runs_on(pairs):  # one pass over both sides, one flag per pair, one host read
            differs = fused_fill.compare_many(pairs[: len(every)], pairs[len(every) :]).tolist()
            bad.extend(i for i, d in zip(every, differs, strict=True) if d)
            continue
        flags = []
        for idx in groups:
            a = torch.cat([_bytes(held[i]) for i in idx])
            b = torch.cat([_bytes(sent[i]).to(device) for i in idx])
            flags.append(torch.ne(a, b).any())
        for idx, differs in zip(groups, torch.stack(flags).tolist(), strict=True):
            if differs:
                bad.extend(i for i in idx if not torch.equal(_bytes(held[i]), _bytes(sent[i]).to(device)))
    return min(bad) if bad else None
