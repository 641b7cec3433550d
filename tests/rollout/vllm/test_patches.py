"""The vLLM adapter's private patches (megatron_fp8/rollout/vllm/_patches.py) that a CPU kind decides: the
vocabulary-parallel embedding's input masking, which a TP 2 engine gets wrong where inductor vectorizes for AVX2.

Every CPU kind CI runs on has AVX2, so the AVX2 kernels are forced here (``ATEN_CPU_CAPABILITY=avx2``: the ISA that
torch and inductor pick on an AVX2-only machine) on whichever kind runs the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[3]

PROBE = r"""
import json, torch
from torch._inductor import cpu_vec_isa
from vllm.model_executor.layers import vocab_parallel_embedding as vpe
from megatron_fp8.rollout.vllm import _patches

VOCAB, SHARDS = 300, 2  # a TP 2 engine's two halves of a 300-id vocabulary, no added vocabulary, no padding
ids = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)

def expected(lo, hi):
    inside = [lo <= int(i) < hi for i in ids]
    return [int(i) - lo if ok else 0 for i, ok in zip(ids, inside)], [not ok for ok in inside]

def masked(lo, hi):
    out, mask = vpe.get_masked_input_and_mask(ids, lo, hi, 0, VOCAB, VOCAB)
    return out.tolist(), mask.tolist()

shards = [(r * VOCAB // SHARDS, (r + 1) * VOCAB // SHARDS) for r in range(SHARDS)]
first, again = _patches.eager_vocab_masking(), _patches.eager_vocab_masking()
eager = [masked(lo, hi) == expected(lo, hi) for lo, hi in shards]
print(json.dumps({"isa": str(cpu_vec_isa.pick_vec_isa()), "eager_exact": eager, "replaced": [first, again],
                  "compiled_left": hasattr(vpe.get_masked_input_and_mask, "_torchdynamo_orig_callable")}))
"""


def test_the_vocabulary_masking_runs_eagerly_and_exactly_under_avx2_kernels():
    """What the patch leaves: vLLM's own Python function, exact for both shards of a TP 2 vocabulary, under the
    kernels an AVX2-only machine picks. The TP 2 engine it fixes runs under them in test_sharded_engine.py."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["isa"] == "avx2", result  # inductor vectorized for AVX2, as on an AVX2-only machine
    assert result["replaced"] == [True, False]  # replaced once; the second call finds it eager already
    assert result["eager_exact"] == [True, True] and not result["compiled_left"]
