"""The refit's Triton checksum kernel gives the torch path's partials, checked in Triton's CPU interpreter.

``TRITON_INTERPRET=1`` must be set before Triton is imported, so the kernel runs in a subprocess. On a GPU
``tests/refit/test_buckets.py::test_cuda_pack_unpack_and_bucket_size`` compares the CUDA (kernel) checksum
with the CPU (torch) one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_fp8.refit import payload_checksum
from megatron_fp8.refit.integrity.checksum import BLOCK_WORDS, checksum_partials

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent(
    r"""
    import json
    import torch
    from megatron_fp8.refit.integrity import kernels
    from megatron_fp8.refit.integrity.checksum import BLOCK_WORDS, checksum_partials

    assert kernels.interpreter_active()
    rows = []
    g = torch.Generator().manual_seed(0)
    # odd lengths, one word, exact blocks, a partial last block, extreme words (sign bit, all ones)
    for n in [4, 12, 4 * BLOCK_WORDS, 4 * BLOCK_WORDS + 16, 3 * 4 * BLOCK_WORDS - 8, 1000]:
        x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        if n == 12:
            x[:] = 0xFF
        if n == 1000:
            x[::4] = 0x80
        words = x[: n // 4 * 4].view(torch.int32)
        pk, qk = kernels.checksum_partials_triton(words, BLOCK_WORDS)
        pt, qt = checksum_partials(x)  # CPU tensors: the torch path
        rows.append([n, bool(torch.equal(pk, pt)), bool(torch.equal(qk, qt)), pk.numel()])
    print("RESULT" + json.dumps(rows))
    """
)


def test_kernel_partials_equal_the_torch_path_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    rows = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT") :])
    assert len(rows) == 6
    bad = [r for r in rows if not (r[1] and r[2])]
    assert not bad, f"kernel partials differ from the torch path (nbytes, p ok, q ok, blocks): {bad}"
    assert [r[3] for r in rows] == [1, 1, 1, 2, 3, 1]


@pytest.fixture
def one_thread():
    """~200k checksums of a 128 KiB payload: one thread each (an integer result, the same with any thread count;
    two OpenMP threads of small ops on a busy 2-core machine mostly wait on each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_every_single_byte_change_and_every_word_swap_is_caught(one_thread):
    x = torch.randint(0, 256, (8 * BLOCK_WORDS + 22,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    base = payload_checksum(x)
    y = x.clone()  # one buffer, each byte changed and restored in place (a clone per case was half the test's time)
    for i in list(range(0, 64)) + list(range(4 * BLOCK_WORDS - 8, x.numel())):
        for delta in (1, 0x80, 0xFF):
            y[i] ^= delta
            assert payload_checksum(y) != base, (i, delta)
            y[i] ^= delta
    assert torch.equal(y, x)
    for a, b in [(0, 1), (0, BLOCK_WORDS), (7, BLOCK_WORDS + 7), (BLOCK_WORDS - 1, BLOCK_WORDS)]:
        y = x[: x.numel() // 4 * 4].clone().view(torch.int32)
        if y[a] == y[b]:
            continue
        y[a], y[b] = y[b].clone(), y[a].clone()
        assert payload_checksum(y.view(torch.uint8)) != payload_checksum(x[: y.numel() * 4]), (a, b)
    assert payload_checksum(x[:-4]) != base  # truncation, even of trailing bytes
    assert payload_checksum(torch.cat([x, torch.zeros(4, dtype=torch.uint8)])) != base  # zero padding added


def test_partials_are_exact_int64_sums():
    x = torch.full((8 * BLOCK_WORDS,), 0xFF, dtype=torch.uint8)  # every word is -1
    p, q = checksum_partials(x)
    assert p.tolist() == [-BLOCK_WORDS, -BLOCK_WORDS]
    assert q.tolist() == [-BLOCK_WORDS * (BLOCK_WORDS + 1) // 2] * 2
