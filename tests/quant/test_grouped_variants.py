"""The grouped quantizer's same-bytes variants: the amax from bit patterns (``amax_bits``), unmasked whole tiles
(``unmasked``) and the tile read in row bands (``chunks``), against the default kernel.

Runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, in a subprocess: the variable must be set before Triton is
imported), so the kernel code itself is checked, not a model of it: every source dtype the quantizer takes
(bfloat16, float16, float32), both scale formats, whole-tile groups (where ``unmasked`` drops the masks) and groups
with edge tiles and an expert stack (where it must keep them, and a band can lie wholly outside a short weight), with the values that decide an amax: NaN, +-Inf, -0.0,
subnormals, the largest finite value, and magnitudes over 40 decades. The codes (as the float32 quotients the
interpreter stores) and the scales must be equal bit for bit, and a tile holding NaN/Inf must get the +inf scale that
flags it. On CUDA, with the hardware cast, ``tests/quant/test_recip_division.py``'s ``gpu`` test compares them too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    r"""
    import itertools, json
    import torch
    from megatron_fp8.quant.triton_grouped import GroupedItem, launch_blockwise_grouped
    from megatron_fp8.quant.reference import quantize_blockwise_reference
    from megatron_fp8.quant.triton_kernels import interpreter_active

    assert interpreter_active()
    g = torch.Generator().manual_seed(0)

    def source(shape, dtype):
        e, n, k = shape
        x = torch.randn(e, n, k, generator=g) * torch.logspace(-20, 20, e * n).view(e, n, 1)
        return x.to(dtype)

    def poison(xs, dtype):
        big = torch.finfo(dtype).max
        tiny = torch.finfo(dtype).smallest_normal / 4  # a subnormal
        xs[0][0, 5, 7] = float("nan")
        xs[0][0, 130, 3] = float("inf")
        xs[0][0, 0:128, 128:256] = -0.0                    # a tile of negative zeros
        xs[1][-1, 3, -1] = float("-inf")
        xs[1][0, 0:128, 0:128] = tiny                      # a subnormal tile
        xs[1][0, 0, 0] = -big                              # the largest magnitude, negative
        return xs

    SENTINEL = 0x7FBADBAD  # a signalling NaN's bits: no quotient and no scale the kernel writes

    def unwritten(n):
        return torch.full((n,), SENTINEL, dtype=torch.int32).view(torch.float32)

    # (amax_bits, unmasked, chunks): every pair of the first two, and the tile read in 4 and in 8 row bands
    VARIANTS = [(a, u, 1) for a, u in itertools.product((False, True), (False, True))] + [
        (False, False, 4), (True, True, 8)
    ]  # fmt: skip
    groups = {  # name: shapes ([E, N, K]); "whole": every tile whole, so `unmasked` takes the unmasked kernel
        "whole": [(1, 256, 256), (2, 128, 384)],
        "edges": [(1, 256, 256), (2, 128, 384), (1, 200, 136), (3, 1, 130)],
    }
    out = {}
    for dtype, fmt, (gname, shapes) in itertools.product(
        (torch.bfloat16, torch.float16, torch.float32), ("fp32", "ue8m0"), groups.items()
    ):
        xs = poison([source(s, dtype) for s in shapes], dtype)
        res = {}
        for amax_bits, unmasked, chunks in VARIANTS:
            items = [
                GroupedItem(x, unwritten(x.numel()), unwritten(x.shape[0] * -(-x.shape[1] // 128) * -(-x.shape[2] // 128)))
                for x in xs
            ]  # fmt: skip
            launch_blockwise_grouped(items, 128, 128, fmt, fp8_out=False, amax_bits=amax_bits, unmasked=unmasked,
                                     chunks=chunks)  # fmt: skip
            res[amax_bits, unmasked, chunks] = [(it.q.view(torch.int32), it.scales.view(torch.int32)) for it in items]
        base = res[False, False, 1]
        key = f"{str(dtype).removeprefix('torch.')}/{fmt}/{gname}"
        out[key] = {
            "same": {
                f"amax_bits={a},unmasked={u},chunks={c}": all(
                    torch.equal(qa, qb) and torch.equal(sa, sb) for (qa, sa), (qb, sb) in zip(base, v, strict=True)
                )
                for (a, u, c), v in res.items()
            },
            "inf_scales": [int(torch.isinf(s.view(torch.float32)).sum()) for _, s in base],
            "untouched": [int((q == SENTINEL).sum() + (sc == SENTINEL).sum()) for q, sc in base],
        }
    # a block that is not a power of two (96 x 64: padded to 128 rows, the last band wholly outside the block)
    x = source((2, 200, 136), torch.bfloat16)
    blocks = {}
    for chunks in (1, 2, 4, 8):
        it = GroupedItem(x, unwritten(x.numel()), unwritten(2 * 3 * 3))
        launch_blockwise_grouped([it], 96, 64, "fp32", fp8_out=False, chunks=chunks)
        blocks[chunks] = (it.q.view(torch.int32), it.scales.view(torch.int32))
    ref_q, ref_s = quantize_blockwise_reference(x, block_size=(96, 64))  # and the textbook quantizer's bytes
    same = {f"chunks={c}": all(torch.equal(a, b) for a, b in zip(blocks[1], v)) for c, v in blocks.items()}
    same["reference"] = torch.equal(blocks[1][0].view(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8),
                                    ref_q.reshape(-1).view(torch.uint8)) and torch.equal(
                                    blocks[1][1], ref_s.reshape(-1).view(torch.int32))  # fmt: skip
    out["bfloat16/fp32/96x64"] = {
        "same": same, "inf_scales": [], "untouched": [int(sum((t == SENTINEL).sum() for t in blocks[1]))],
    }  # fmt: skip
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def run() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_every_variant_gives_the_default_kernels_bytes(run):
    assert len(run) == 3 * 2 * 2 + 1
    for key, r in run.items():
        assert all(r["same"].values()), (key, r["same"])
        assert len(r["same"]) == (5 if key.endswith("96x64") else 6)


def test_a_nan_or_inf_tile_gets_the_infinite_scale_that_flags_it(run):
    """+Inf and NaN in the first weight's tiles (0, 0) and (1, 0), -Inf in the second weight's last tile (the same
    under every variant, above); a float16 source also overflows to Inf from ~6.5e4 on, so it has more."""
    for key, r in run.items():
        if key.endswith("96x64"):
            continue  # random values only: no NaN/Inf planted there
        if key.startswith("float16"):
            assert r["inf_scales"][0] >= 2 and r["inf_scales"][1] >= 1, (key, r["inf_scales"])
        else:
            assert r["inf_scales"][:2] == [2, 1], (key, r["inf_scales"])


def test_every_code_and_scale_is_written(run):
    for key, r in run.items():
        assert r["untouched"] == [0] * len(r["untouched"]), key


def test_the_unmasked_kernel_runs_only_on_whole_tiles():
    from megatron_fp8.quant.triton_grouped import whole_tiles

    assert whole_tiles([(4096, 4096), (14336, 4096), (1024, 4096)], 128, 128)  # the 8B linear set
    assert not whole_tiles([(4096, 4096), (200, 136)], 128, 128)  # one edge tile is enough to keep the masks
    assert not whole_tiles([(4096, 4096)], 96, 128)  # a block that is not a power of two is padded, so masked
    assert whole_tiles([], 128, 128)
