"""One rank of a multi-process gloo refit test (run as a script by test_gloo.py).

Rank 0 sends, the others receive into a DictApplier. Scenarios:

* ``broadcast``: versions 1 and 2 in full, then an orderly close;
* ``kill``: version 1 in full, then only the first bucket of version 2, then the
  sender process exits (a dead peer);
* ``stall``: like ``kill`` but the sender stays alive and silent until its
  stdin closes (a stalled peer).

Each rank writes a JSON result to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_fp8.errors import RefitError, TransportClosedError, TransportTimeoutError
from megatron_fp8.refit import DictApplier, RefitReceiver, RefitSender, TorchDistTransport, pack_buckets
from megatron_fp8.refit.synthetic import SPECS, fp8_stream, linear_shapes, synthetic_weights

BUCKET_BYTES = 96 * 1024


def weights_for(version: int) -> list[tuple[str, torch.Tensor]]:
    spec = SPECS["tiny"].shrunk(1, num_layers=1)
    weights = synthetic_weights(spec, seed=version)
    items = list(fp8_stream(weights, linear_shapes(spec)))
    items.append(("model.layers.0.self_attn.attn.k_scale", torch.tensor(0.01 * version, dtype=torch.float32)))
    return items


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--scenario", choices=("broadcast", "kill", "stall"), required=True)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{a.port}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=60),
    )
    transport = TorchDistTransport(src=0, timeout=a.timeout)
    result: dict = {"rank": a.rank}
    if a.rank == 0:
        sender = RefitSender(transport, bucket_bytes=BUCKET_BYTES)
        report = sender.send(weights_for(1), version=1)
        result["v1_buckets"] = report.num_buckets
        if a.scenario == "broadcast":
            sender.send(weights_for(2), version=2)
            sender.close()
        else:
            first = next(pack_buckets(weights_for(2), version=2, bucket_bytes=BUCKET_BYTES))
            assert not first.is_last
            transport.send(first)
            transport.flush()
            result["sent_v2_bucket0"] = True
            with open(a.out, "w") as f:
                json.dump(result, f)
            if a.scenario == "kill":
                os._exit(0)
            sys.stdin.read()  # stalled, but alive, until the test closes our stdin
            os._exit(0)
    else:
        targets = {name: torch.zeros_like(t) for name, t in weights_for(1)}
        applier = DictApplier(targets)
        receiver = RefitReceiver(transport, apply=applier)
        rep = receiver.receive(first_timeout=60.0)
        expected1 = weights_for(1)
        result["v1_exact"] = all(same_bytes(targets[n], t) for n, t in expected1)
        result["v1_buckets"] = rep.num_buckets
        if a.scenario == "broadcast":
            receiver.receive(first_timeout=60.0)
            result["v2_exact"] = all(same_bytes(targets[n], t) for n, t in weights_for(2))
            try:
                receiver.receive(first_timeout=30.0)
                result["closed"] = False
            except TransportClosedError:
                result["closed"] = True
        else:
            start = time.monotonic()
            try:
                receiver.receive(first_timeout=60.0)
                result["error"] = None
            except TransportTimeoutError as exc:
                result["error"] = "TransportTimeoutError"
                result["message"] = str(exc)
            except RefitError as exc:
                result["error"] = type(exc).__name__
                result["message"] = str(exc)
            result["elapsed"] = time.monotonic() - start
            result["still_v1"] = all(same_bytes(targets[n], t) for n, t in expected1)
            result["applier_version"] = applier.version
            result["aborted"] = applier.last_abort is not None
    with open(a.out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip process-group teardown: a peer may be gone


if __name__ == "__main__":
    sys.exit(main())
