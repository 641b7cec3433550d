"""The CPU checksum partials (numpy's integer sums over the payload's memory) equal the torch path's, exactly.

Lengths: one word, a partial block, whole blocks, more blocks than one numpy step holds (so the chunked loop and
the partial last block both run), words with the sign bit and all ones. The CUDA kernel is compared with the CPU
path in ``tests/refit/test_refit_kernels.py`` (interpreter) and the ``gpu`` tests.
"""

from __future__ import annotations

import pytest
import torch

from megatron_fp8.refit.integrity import checksum
from megatron_fp8.refit.integrity.checksum import BLOCK_WORDS, checksum_partials
from megatron_fp8.refit.opcount import OpCounter


@pytest.mark.parametrize(
    "nbytes",
    [4, 4 * 1000 + 3, 4 * BLOCK_WORDS, 4 * BLOCK_WORDS * 3 + 20, 4 * BLOCK_WORDS * 5],
    ids=["one-word", "partial-block", "one-block", "three-blocks-and-a-bit", "five-blocks"],
)
def test_numpy_partials_equal_the_torch_path(nbytes, monkeypatch):
    monkeypatch.setattr(checksum, "_NP_ROWS", 2)  # several numpy steps, and a step cut short, at test sizes
    x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    x[: min(64, nbytes // 4 * 4)] = 0xFF  # -1 words
    x[64:128:4] = 0x80  # sign bits
    words = x[: nbytes // 4 * 4].view(torch.int32)
    p, q = checksum_partials(x)
    pt, qt = checksum._partials_torch(words)
    assert p.dtype == q.dtype == torch.int64
    assert torch.equal(p, pt) and torch.equal(q, qt)


def test_the_cpu_partials_are_neither_a_device_op_nor_a_host_read():
    """numpy reads the payload's CPU memory directly: no torch compute op, nothing the op counter calls a sync."""
    x = torch.randint(0, 256, (4 * BLOCK_WORDS * 2,), dtype=torch.uint8)
    with OpCounter() as c:
        checksum_partials(x)
    assert c.counts.num_host_reads == 0
