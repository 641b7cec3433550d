"""Multi-process refit over gloo: 1 sender + 2 receivers, faults in transit, killed and stalled peers.

Every process is a real ``torch.distributed`` gloo rank (``_gloo_worker.py``); a killed peer is killed
with ``SIGKILL`` (kill -9) by itself at the named point.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fp8.errors import ConfigError
from megatron_fp8.launch_env import find_free_ports
from megatron_fp8.refit import make_transport

WORKER = Path(__file__).with_name("_gloo_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _run(
    tmp_path: Path, scenario: str, world: int, timeout: float = 5.0, *, new_sender: bool = False, killed=()
) -> list[dict]:
    """Run ranks ``0..world-1`` (plus a new sender on a second port); their JSON results, in that order.

    Ranks in ``killed`` must die by SIGKILL; every other rank but a stalled sender must exit 0.
    """
    port, port2 = find_free_ports(2)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    roles = [(rank, "rank") for rank in range(world)] + ([(0, "new_sender")] if new_sender else [])
    procs, outs = [], []
    for rank, role in roles:
        out = tmp_path / f"{scenario}_{role}_{rank}.json"
        outs.append(out)
        cmd = [sys.executable, str(WORKER), "--rank", str(rank), "--world", str(world), "--port", str(port)]
        cmd += ["--port2", str(port2), "--role", role, "--scenario", scenario, "--timeout", str(timeout)]
        cmd += ["--out", str(out)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        for i, p in enumerate(procs):
            if scenario == "stall" and i == 0:
                continue  # stalls until its stdin closes
            _, err = p.communicate(timeout=120)
            expected = -signal.SIGKILL if i in killed else 0
            assert p.returncode == expected, (i, p.returncode, err.decode()[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
                p.wait(timeout=30)
    return [json.loads(o.read_text()) for o in outs]


def test_broadcast_to_two_receivers_exact(tmp_path):
    sender, *receivers = _run(tmp_path, "broadcast", world=3)
    assert sender["v1_buckets"] > 2  # several buckets, so the double buffer and prefetch are used
    assert sender["v1_outcomes"] == ["committed", "committed"]  # every receiver's outcome reached the sender
    for r in receivers:
        assert r["v1_exact"] and r["v2_exact"] and r["closed"], r
        assert r["v1_buckets"] == sender["v1_buckets"]


def test_faults_in_transit_refused_by_every_receiver_and_the_sender_is_told(tmp_path):
    sender, *receivers = _run(tmp_path, "faults", world=3)
    expected = {
        "2": r"bucket 1 of version 2: checksum mismatch",  # is_last flipped on a middle bucket
        "3": r"bucket 1 of version 3: checksum mismatch",  # gate_proj / up_proj names swapped
        "4": r"bucket 3 of version 4 arrived, expected bucket 2",  # bucket 2 lost
    }
    for version, pattern in expected.items():
        told = sender[version]
        assert told["error"] == "RefitRefusedError" and told["outcome"] == "refused", told
        assert told["version"] == int(version)
        assert "rank 1:" in told["reason"] and "rank 2:" in told["reason"]  # both receivers' outcomes arrived
        for r in receivers:
            got = r[version]
            assert got["error"] == "RefitError" and pattern in got["message"], got
            assert got["holds_last_good"] and got["applier_version"] == 1, got  # nothing of it was applied
    for r in receivers:  # the lost bucket's tensors are named from the version's trailer
        assert (
            "2 missing ['model.layers.0.mlp.down_proj.weight', 'model.layers.0.mlp.down_proj.weight_scale_inv']"
            in (r["4"]["message"])
        )
    assert sender["5"]["error"] is None  # the next clean version commits everywhere
    for r in receivers:
        assert r["5"]["error"] is None and r["5"]["holds_last_good"] and r["5"]["applier_version"] == 5


def test_receiver_killed_mid_version_sender_raises_naming_the_version(tmp_path):
    timeout = 4.0
    sender, _receiver = _run(tmp_path, "kill_receiver_mid", world=2, timeout=timeout, killed=(1,))
    told = sender["v2"]
    assert told["error"] == "TransportTimeoutError", told
    assert "version 2" in told["message"] and "receiver rank(s) [1]" in told["message"]
    assert told["elapsed"] < timeout + 3.0  # within its deadline, not the process group's 60 s


def test_receiver_killed_inside_commit_sender_raises_naming_the_version(tmp_path):
    timeout = 4.0
    sender, _receiver = _run(tmp_path, "kill_receiver_commit", world=2, timeout=timeout, killed=(1,))
    told = sender["v2"]
    assert told["error"] == "TransportTimeoutError", told
    assert "sent no outcome for refit version 2" in told["message"] and "[1]" in told["message"]
    assert told["elapsed"] < timeout + 3.0


def test_killed_sender_times_out_and_keeps_last_version(tmp_path):
    timeout = 4.0
    _sender, receiver = _run(tmp_path, "kill", world=2, timeout=timeout, killed=(0,))
    assert receiver["error"] == "TransportTimeoutError", receiver
    assert "sender rank 0" in receiver["message"] and "bucket" in receiver["message"]
    assert receiver["elapsed"] < timeout + 3.0
    assert receiver["still_v1"] and receiver["applier_version"] == 1 and receiver["aborted"]


def test_killed_sender_then_a_new_sender_commits_the_next_clean_version(tmp_path):
    _old, receiver, new = _run(tmp_path, "kill_sender_restart", world=2, new_sender=True, killed=(0,))
    assert receiver["error"] == "TransportTimeoutError" and receiver["still_v1"], receiver
    assert receiver["applier_version"] == 1
    # a fresh process group (the dead rank's cannot be reused) and a new sender: version 2 commits
    assert receiver["restart"]["error"] is None and new["v2"]["error"] is None, (receiver, new)
    assert receiver["v2_exact"] and receiver["applier_version_after"] == 2


def test_stalled_sender_times_out_within_deadline(tmp_path):
    timeout = 2.0
    _sender, receiver = _run(tmp_path, "stall", world=2, timeout=timeout)
    assert receiver["error"] == "TransportTimeoutError", receiver
    assert "sender rank 0" in receiver["message"]
    assert timeout - 0.5 <= receiver["elapsed"] < timeout + 3.0
    assert receiver["still_v1"] and receiver["applier_version"] == 1


@pytest.mark.parametrize("name", ["nccl"])
def test_registry_refuses_backend_mismatch_without_group(name):
    with pytest.raises(ConfigError, match="init_process_group"):
        make_transport(name, src=0)
