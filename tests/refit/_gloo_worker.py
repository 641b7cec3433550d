"""One rank of a multi-process gloo refit test (run as a script by test_gloo.py).

Rank 0 sends, the others receive into a DictApplier. Scenarios:

* ``broadcast``: versions 1 and 2 in full, then an orderly close;
* ``kill``: version 1 in full, then only the first bucket of version 2, then the
  sender process kills itself (``SIGKILL``: a dead peer);
* ``stall``: like ``kill`` but the sender stays alive and silent until its
  stdin closes (a stalled peer);
* ``faults``: version 1, then versions 2-4 each altered in transit by a
  tampering transport (``is_last`` flipped on a middle bucket; the names of
  ``gate_proj`` and ``up_proj`` swapped in one bucket's metadata; a middle bucket
  dropped), then a clean version 5;
* ``kill_receiver_mid``: version 1, then the receiver kills itself after taking
  the first bucket of version 2;
* ``kill_receiver_commit``: version 1, then the receiver kills itself inside the
  applier's ``commit`` of version 2;
* ``kill_sender_restart``: like ``kill``; then the receiver re-creates its process
  group on ``--port2`` where a new sender (``--role new_sender``) sends a clean
  version 2.

Each process writes a JSON result to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron_fp8.errors import RefitError, RefitRefusedError, TransportClosedError
from megatron_fp8.refit import DictApplier, RefitReceiver, RefitSender, TorchDistTransport, pack_buckets
from megatron_fp8.refit.synthetic import SPECS, fp8_stream, linear_shapes, synthetic_weights

BUCKET_BYTES = 96 * 1024
FAULT_BUCKET_BYTES = 320 * 1024  # bucket 1 holds gate_proj and up_proj (same shape), 5 buckets in all
GATE = "model.layers.0.mlp.gate_proj.weight"
UP = "model.layers.0.mlp.up_proj.weight"


def weights_for(version: int) -> list[tuple[str, torch.Tensor]]:
    spec = SPECS["tiny"].shrunk(1, num_layers=1)
    weights = synthetic_weights(spec, seed=version)
    items = list(fp8_stream(weights, linear_shapes(spec)))
    items.append(("model.layers.0.self_attn.attn.k_scale", torch.tensor(0.01 * version, dtype=torch.float32)))
    return items


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def holds(targets: dict[str, torch.Tensor], version: int) -> bool:
    return all(same_bytes(targets[n], t) for n, t in weights_for(version))


def _flip_last(bucket):
    return dataclasses.replace(bucket, is_last=True) if bucket.index == 1 else bucket


def _swap_gate_up(bucket):
    names = [m.name for m in bucket.metas]
    if GATE not in names or UP not in names:
        return bucket
    swap = {GATE: UP, UP: GATE}
    return dataclasses.replace(
        bucket, metas=tuple(dataclasses.replace(m, name=swap.get(m.name, m.name)) for m in bucket.metas)
    )


def _drop_middle(bucket):
    return None if bucket.index == 2 else bucket


FAULTS = {2: ("flip_last", _flip_last), 3: ("swap_gate_up", _swap_gate_up), 4: ("drop_middle", _drop_middle)}
"""version -> (fault name, what the wire does to each bucket of that version)."""


class TamperingTransport(TorchDistTransport):
    """A gloo transport whose wire alters (or loses) buckets of chosen versions: a hostile network."""

    def send(self, bucket, *, timeout=None):
        fault = FAULTS.get(bucket.version)
        altered = fault[1](bucket) if fault else bucket
        if altered is not None:
            super().send(altered, timeout=timeout)


class CommitKiller(DictApplier):
    """A DictApplier whose process is killed (SIGKILL) inside the commit of version 2."""

    def commit(self, version: int) -> None:
        if version == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        super().commit(version)


def _init(port: int, rank: int, world: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f)


def _catch(fn) -> dict:
    """Run ``fn``; the error type, message and elapsed seconds."""
    start = time.monotonic()
    try:
        fn()
        out: dict = {"error": None}
    except RefitRefusedError as exc:
        out = {"error": "RefitRefusedError", "version": exc.version, "outcome": exc.outcome, "reason": exc.reason}
        out["message"] = str(exc)
    except RefitError as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    out["elapsed"] = time.monotonic() - start
    return out


def sender_main(a: argparse.Namespace, result: dict) -> None:
    if a.scenario == "faults":
        sender = RefitSender(TamperingTransport(src=0, timeout=a.timeout), bucket_bytes=FAULT_BUCKET_BYTES)
        sender.send(weights_for(1), version=1)
        for version in (2, 3, 4, 5):
            result[str(version)] = _catch(lambda v=version: sender.send(weights_for(v), version=v))
        return
    transport = TorchDistTransport(src=0, timeout=a.timeout)
    sender = RefitSender(transport, bucket_bytes=BUCKET_BYTES)
    report = sender.send(weights_for(1), version=1)
    result["v1_buckets"] = report.num_buckets
    result["v1_outcomes"] = [o.status for o in report.outcomes]
    if a.scenario == "broadcast":
        sender.send(weights_for(2), version=2)
        sender.close()
    elif a.scenario in ("kill_receiver_mid", "kill_receiver_commit"):
        result["v2"] = _catch(lambda: sender.send(weights_for(2), version=2))
    else:  # kill, stall, kill_sender_restart: the sender dies or stalls after bucket 0 of version 2
        first = next(pack_buckets(weights_for(2), version=2, bucket_bytes=BUCKET_BYTES))
        assert not first.is_last
        transport.send(first)
        transport.flush()
        result["sent_v2_bucket0"] = True
        _write(a.out, result)
        if a.scenario == "stall":
            sys.stdin.read()  # stalled, but alive, until the test closes our stdin
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)


def receiver_main(a: argparse.Namespace, result: dict) -> None:
    targets = {name: torch.zeros_like(t) for name, t in weights_for(1)}
    applier = CommitKiller(targets) if a.scenario == "kill_receiver_commit" else DictApplier(targets)
    transport = TorchDistTransport(src=0, timeout=a.timeout)
    receiver = RefitReceiver(transport, apply=applier)
    rep = receiver.receive(first_timeout=60.0)
    result["v1_exact"] = holds(targets, 1)
    result["v1_buckets"] = rep.num_buckets
    if a.scenario == "broadcast":
        receiver.receive(first_timeout=60.0)
        result["v2_exact"] = holds(targets, 2)
        try:
            receiver.receive(first_timeout=30.0)
            result["closed"] = False
        except TransportClosedError:
            result["closed"] = True
    elif a.scenario == "faults":
        good = 1
        for version in (2, 3, 4, 5):
            out = _catch(lambda: receiver.receive(first_timeout=60.0))
            good = version if out["error"] is None else good
            out["holds_last_good"] = holds(targets, good)
            out["applier_version"] = applier.version
            result[str(version)] = out
    elif a.scenario == "kill_receiver_mid":
        transport.recv(timeout=60.0)  # bucket 0 of version 2 ...
        _write(a.out, result)
        os.kill(os.getpid(), signal.SIGKILL)  # ... and the engine process dies
    elif a.scenario == "kill_receiver_commit":
        _write(a.out, result)
        receiver.receive(first_timeout=60.0)  # killed inside commit
    else:
        result.update(_catch(lambda: receiver.receive(first_timeout=60.0)))
        result["still_v1"] = holds(targets, 1)
        result["applier_version"] = applier.version
        result["aborted"] = applier.last_abort is not None
        if a.scenario == "kill_sender_restart":
            # the dead sender's group is unusable: leave it and meet a new sender in a fresh group
            dist.destroy_process_group()
            _init(a.port2, 1, 2)
            receiver = RefitReceiver(TorchDistTransport(src=0, timeout=a.timeout), apply=applier)
            result["restart"] = _catch(lambda: receiver.receive(first_timeout=60.0))
            result["v2_exact"] = holds(targets, 2)
            result["applier_version_after"] = applier.version


def new_sender_main(a: argparse.Namespace, result: dict) -> None:
    sender = RefitSender(TorchDistTransport(src=0, timeout=a.timeout), bucket_bytes=BUCKET_BYTES)
    result["v2"] = _catch(lambda: sender.send(weights_for(2), version=2))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--port2", type=int, default=0)
    p.add_argument("--role", choices=("rank", "new_sender"), default="rank")
    p.add_argument(
        "--scenario",
        choices=(
            "broadcast",
            "kill",
            "stall",
            "faults",
            "kill_receiver_mid",
            "kill_receiver_commit",
            "kill_sender_restart",
        ),
        required=True,
    )
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    result: dict = {"rank": a.rank, "role": a.role}
    if a.role == "new_sender":
        _init(a.port2, 0, 2)
        new_sender_main(a, result)
    else:
        _init(a.port, a.rank, a.world)
        (sender_main if a.rank == 0 else receiver_main)(a, result)
    _write(a.out, result)
    os._exit(0)  # skip process-group teardown: a peer may be gone


if __name__ == "__main__":
    sys.exit(main())
