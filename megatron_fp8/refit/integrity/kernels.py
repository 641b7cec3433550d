"""Triton kernels of the refit hot path (CUDA): the bucket checksum's per-block partials in one launch.

:func:`checksum_partials_triton` reads every payload word once (one program per 64 KiB block, int64
accumulation) and writes two int64 per block, the same values as the torch path of
:func:`megatron_fp8.refit.integrity.checksum.checksum_partials` (integer sums are exact, so the order of the
reduction does not matter).

Testing without a GPU: with ``TRITON_INTERPRET=1`` set before Triton is imported, the kernel runs on CPU
tensors in Triton's interpreter; ``tests/refit/test_refit_kernels.py`` compares it with the torch path
there, byte for byte, on odd lengths. :func:`runs_on` sends only CUDA tensors to the kernel.
"""

from __future__ import annotations

import torch

from megatron_fp8.layout import ceil_div

try:  # Triton is optional: without it the torch path runs everywhere
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install raising at import time
    triton = None
    tl = None

__all__ = ["available", "checksum_partials_triton", "interpreter_active", "runs_on"]

_TILE = 2048
"""Words loaded per loop iteration of a checksum program (8 KiB)."""


def available() -> bool:
    """Whether Triton imports here (the kernels can be compiled or interpreted)."""
    return triton is not None


def interpreter_active() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` before import)."""
    return triton is not None and type(_checksum_blocks_kernel).__name__ == "InterpretedFunction"


def runs_on(words: torch.Tensor) -> bool:
    """Whether :func:`checksum_partials_triton` is used for ``words`` (a CUDA tensor and Triton present)."""
    return triton is not None and words.is_cuda


if triton is not None:

    @triton.jit
    def _checksum_blocks_kernel(words_ptr, p_ptr, q_ptr, nwords, BLOCK: tl.constexpr, TILE: tl.constexpr):
        block = tl.program_id(0)
        base = block.to(tl.int64) * BLOCK
        p = tl.zeros([TILE], dtype=tl.int64)
        q = tl.zeros([TILE], dtype=tl.int64)
        for start in range(0, BLOCK, TILE):
            j = start + tl.arange(0, TILE)
            idx = base + j
            w = tl.load(words_ptr + idx, mask=idx < nwords, other=0).to(tl.int64)
            p += w
            q += w * (j + 1).to(tl.int64)
        tl.store(p_ptr + block, tl.sum(p, axis=0))
        tl.store(q_ptr + block, tl.sum(q, axis=0))


def checksum_partials_triton(words: torch.Tensor, block_words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block ``(p, q)`` of a 1-D contiguous int32 word tensor in one kernel launch, no host sync.

    Args:
        words: 1-D contiguous ``torch.int32`` (the payload's full words), on CUDA (or CPU under the interpreter).
        block_words: words per block, a multiple of 2048.

    Returns:
        ``(p, q)``: int64 tensors of ``ceil(len(words) / block_words)`` entries on ``words.device``.
    """
    if triton is None:
        raise RuntimeError("checksum_partials_triton needs the triton package")
    if words.dtype != torch.int32 or words.dim() != 1 or not words.is_contiguous():
        raise ValueError(f"expected 1-D contiguous int32 words, got {words.dtype} {tuple(words.shape)}")
    if block_words % _TILE:
        raise ValueError(f"block_words must be a multiple of {_TILE}, got {block_words}")
    nblocks = ceil_div(words.numel(), block_words)
    out = torch.empty(2, nblocks, dtype=torch.int64, device=words.device)
    if nblocks:
        _checksum_blocks_kernel[(nblocks,)](
            words, out[0], out[1], words.numel(), BLOCK=block_words, TILE=_TILE, num_warps=8
        )
    return out[0], out[1]
