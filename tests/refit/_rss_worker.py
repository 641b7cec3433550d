"""200 in-process refits of the synthetic tiny model in a process of their own; prints the RSS samples as JSON.

Run by ``test_sender_receiver.py::test_200_refits_flat_rss``: a fresh process, so the RSS it reads is the refit's,
not that of a test process that has built models and engines before (their arenas and threads move its floor).
"""

from __future__ import annotations

import gc
import json
import sys
import threading

import psutil
import torch

from megatron_fp8.refit import DictApplier, InProcTransport, RefitReceiver, RefitSender
from megatron_fp8.refit.synthetic import SPECS, fp8_stream, linear_shapes, synthetic_weights


def main() -> int:
    # What the imports made (~170k objects, torch's) is frozen out of the collector: the gc.collect() before each
    # of the 40 RSS samples then walks only what the refits made (~0.1 s less each, a third of this worker's time on
    # the 2-core CI machine); a cycle a refit leaks is still collected, a leak still raises the floor.
    gc.collect()
    gc.freeze()
    spec, bucket = SPECS["tiny"], 128 * 1024
    transport = InProcTransport(maxsize=64, timeout=5.0)
    items = list(fp8_stream(synthetic_weights(spec, seed=0), linear_shapes(spec)))
    applier = DictApplier({n: torch.zeros_like(t) for n, t in items})
    receiver = RefitReceiver(transport, apply=applier)
    sender = RefitSender(transport, bucket_bytes=bucket)
    proc = psutil.Process()
    early, late = [], []  # RSS after each of refits 21..40 and 181..200
    for version in range(1, 201):
        errors: list[BaseException] = []

        def send(v: int = version, errs: list[BaseException] = errors) -> None:
            try:
                sender.send(items, version=v)
            except BaseException as exc:  # reported below
                errs.append(exc)

        th = threading.Thread(target=send)
        th.start()
        receiver.receive()
        th.join()
        if errors:
            raise errors[0]
        if 20 < version <= 40 or version > 180:
            gc.collect()
            (early if version <= 40 else late).append(proc.memory_info().rss)
    held = all(
        torch.equal(applier.tensors[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)) for n, t in items
    )
    json.dump({"version": applier.version, "holds": held, "early": early, "late": late}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
