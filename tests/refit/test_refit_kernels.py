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

import numpy as np
import pytest
import torch

from megatron_fp8.refit import payload_checksum
from megatron_fp8.refit.integrity.checksum import BLOCK_WORDS, checksum_partials, finish_checksum

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
    """One thread for the sweep's many small ops (an integer result, the same with any thread count; two OpenMP
    threads of small ops on a busy 2-core machine mostly wait on each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_ROWS = 16
"""Changed blocks per :func:`checksum_partials` call of the sweep (1 MiB: it stays in the CPU's cache)."""


def _changed_byte_checksums(x: torch.Tensor, positions: list[int], delta: int):
    """``(position, checksum of x with that byte XORed by delta)`` for each full-word position.

    Each case gets its own payload block: the block that holds the byte, copied, with the byte changed. Its
    partials come from the real :func:`checksum_partials` (several such blocks per call: a payload of whole
    blocks, whose partials are per block by definition), and the real :func:`finish_checksum` folds them with
    the other blocks' partials (unchanged) and the unchanged tail, for each case: the payload's checksum, with
    the per-block work done ``_ROWS`` cases at a time instead of one ``payload_checksum`` call per case (197k
    calls took ~85 s on the 2-core CI machine).

    The rows are one buffer kept across batches: a row already holding the case's block gets its previous case's
    byte restored from the payload and the new one changed (two bytes written instead of a 64 KiB block copied:
    the copies took about a sixth of the sweep), a row holding another block is copied afresh. Either way each row
    is the block with exactly the case's byte changed when :func:`checksum_partials` reads it; the test's exact
    ``payload_checksum`` samples would see a byte left changed (it would stay in that row's later cases).
    """
    block, n = 4 * BLOCK_WORDS, x.numel()
    full = n // 4 * 4
    p0, q0 = (t.numpy().copy() for t in checksum_partials(x))
    tail = x[full:].tolist()
    padded = torch.nn.functional.pad(x[:full], (0, -full % block)).view(-1, block)  # the last block zero-padded
    src = padded.numpy()
    rows = torch.empty((_ROWS, block), dtype=torch.uint8)
    buf = rows.numpy()  # the same memory, written through numpy
    held = np.full(_ROWS, -1)  # the block each row holds (-1: none yet)
    changed = np.zeros(_ROWS, dtype=np.int64)  # the byte of it that the row's previous case changed
    every = np.asarray(positions, dtype=np.int64)
    for s in range(0, len(positions), _ROWS):
        blk, byte = np.divmod(every[s : s + _ROWS], block)
        m = len(blk)
        used = np.flatnonzero(held[:m] >= 0)
        buf[used, changed[used]] = src[held[used], changed[used]]  # undo each row's previous case
        stale = np.flatnonzero(held[:m] != blk)
        buf[stale] = src[blk[stale]]  # rows that move to another block: a fresh copy of it
        held[stale] = blk[stale]
        buf[np.arange(m), byte] ^= delta
        changed[:m] = byte
        p, q = (t.numpy() for t in checksum_partials(rows[:m].view(-1)))
        for k, i in enumerate(positions[s : s + _ROWS]):
            b = i // block
            p0[b], q0[b], keep = p[k], q[k], (p0[b], q0[b])
            yield i, finish_checksum(p0, q0, nbytes=n, tail=tail)
            p0[b], q0[b] = keep


def test_every_single_byte_change_and_every_word_swap_is_caught(one_thread):
    x = torch.randint(0, 256, (8 * BLOCK_WORDS + 22,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    base = payload_checksum(x)
    full = x.numel() // 4 * 4  # the bytes after it are the tail (n % 4 of them), folded in by finish_checksum
    positions = list(range(0, 64)) + list(range(4 * BLOCK_WORDS - 8, x.numel()))
    y = x.clone()
    for delta in (1, 0x80, 0xFF):
        seen = 0
        for i, h in _changed_byte_checksums(x, [i for i in positions if i < full], delta):
            assert h != base, (i, delta)
            # the batched cases are the payload's checksum: the real call agrees (on a sample, and on every byte
            # of the partial last block, which the batch reads zero-padded)
            if seen % 997 == 0 or i >= 8 * BLOCK_WORDS:
                y[i] ^= delta
                assert payload_checksum(y) == h, (i, delta)
                y[i] ^= delta
            seen += 1
        for i in (i for i in positions if i >= full):  # the tail bytes: one payload_checksum call each
            y[i] ^= delta
            assert payload_checksum(y) != base, (i, delta)
            y[i] ^= delta
        assert seen == len([i for i in positions if i < full])
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
