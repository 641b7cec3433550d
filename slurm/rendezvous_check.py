"""Rendezvous preflight: every task joins one gloo process group and all-reduces.

Run by ``slurm/grpo.sbatch`` in every task (``srun``) before the expensive job, with the
``torch.distributed`` environment that ``slurm/common.sh`` derives from Slurm
(``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``). It checks that

* all ``WORLD_SIZE`` ranks meet at ``MASTER_ADDR:MASTER_PORT`` within ``--timeout-s``;
* a sum all-reduce of ``rank + 1`` (int64) gives ``WORLD_SIZE * (WORLD_SIZE + 1) / 2``;
* an all-gather of (rank, host) returns every rank exactly once;
* every rank has its own GPU: the device each rank would use (``megatron_fp8.rl.cluster.devices``: the one GPU Slurm bound
  to the task, else ``cuda:LOCAL_RANK``; identified by UUID, or by its ``CUDA_VISIBLE_DEVICES`` entry without CUDA)
  differs from every other rank's on the same host.

Rank 0 writes the result as JSON to ``--out`` and every rank logs one line
``rendezvous ok: rank R/W ...``. Exit status 0 on success, 1 on a wrong result,
2 on a malformed environment, 3 when the rendezvous itself fails (timeout, refused),
4 when two ranks of a node would share a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

log = logging.getLogger("rendezvous_check")

_REQUIRED = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"rendezvous_check: {name}={value!r} is not an integer (set by slurm/common.sh)") from None


def run_check(*, timeout_s: float, out: Path | None) -> dict[str, object]:
    """Join the gloo group from the environment, all-reduce and all-gather, return the summary.

    Args:
        timeout_s: seconds to wait for all ranks at the rendezvous.
        out: JSON file rank 0 writes the summary to (parent created), or ``None``.

    Returns:
        The summary: ``world_size``, ``master_addr``, ``master_port``, ``sum`` (int), ``expected`` (int),
        ``hosts`` (host name per rank), ``seconds`` (float, rendezvous + collectives), ``ok`` (bool).
    """
    import torch
    import torch.distributed as dist

    from megatron_fp8.errors import ConfigError
    from megatron_fp8.rl.cluster.devices import check_distinct, local_assignment

    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if not 0 <= rank < world:
        raise SystemExit(f"rendezvous_check: RANK={rank} outside [0, WORLD_SIZE={world})")
    start = time.perf_counter()
    dist.init_process_group(
        backend="gloo",
        init_method="env://",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        total = torch.tensor([rank + 1], dtype=torch.int64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        gathered: list[object] = [None] * world
        dist.all_gather_object(gathered, (rank, socket.gethostname()))
        mine = local_assignment()
        devices: list[object] = [None] * world
        dist.all_gather_object(devices, mine)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    seconds = time.perf_counter() - start
    expected = world * (world + 1) // 2
    ranks_seen = sorted(int(r) for r, _ in gathered)  # type: ignore[misc]
    summary: dict[str, object] = {
        "world_size": world,
        "master_addr": os.environ["MASTER_ADDR"],
        "master_port": int(os.environ["MASTER_PORT"]),
        "sum": int(total.item()),
        "expected": expected,
        "hosts": [h for _, h in sorted(gathered)],  # type: ignore[misc]
        "seconds": round(seconds, 3),
        "ok": int(total.item()) == expected and ranks_seen == list(range(world)),
        "devices": [d.to_dict() for d in sorted(devices, key=lambda d: d.rank)],  # type: ignore[union-attr]
    }
    try:
        check_distinct(devices)  # type: ignore[arg-type]
        summary["devices_ok"] = True
    except ConfigError as exc:
        summary["devices_ok"] = False
        summary["devices_error"] = str(exc)
    if rank == 0 and out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON summary written by rank 0")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="rendezvous timeout in seconds")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "?")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(name)s: %(message)s", stream=sys.stdout)
    missing = [name for name in _REQUIRED if not os.environ.get(name)]
    if missing:
        log.error(
            "missing %s: run under slurm/common.sh (srun ... bash slurm/common.sh task -- ...)", ", ".join(missing)
        )
        return 2
    try:
        summary = run_check(timeout_s=args.timeout_s, out=args.out)
    except SystemExit as exc:
        log.error("%s", exc)
        return 2
    except ValueError as exc:  # megatron_fp8.errors.ConfigError: this rank cannot pick a GPU of its own
        log.error("%s", exc)
        return 4
    except (RuntimeError, OSError) as exc:  # gloo/TCPStore failures: timeout, refused, unresolvable host
        log.error(
            "rendezvous failed at %s:%s (world size %s): %s; check that MASTER_ADDR resolves on every node and "
            "that MASTER_PORT is free (override with MASTER_PORT=...)",
            os.environ["MASTER_ADDR"],
            os.environ["MASTER_PORT"],
            os.environ["WORLD_SIZE"],
            exc,
        )
        return 3
    if not summary["devices_ok"]:
        log.error("%s", summary["devices_error"])
        return 4
    if not summary["ok"]:
        log.error(
            "rendezvous wrong result: all-reduce sum %s, expected %s; hosts %s",
            summary["sum"],
            summary["expected"],
            summary["hosts"],
        )
        return 1
    mine = summary["devices"][int(rank)]  # type: ignore[index]
    log.info(
        "rendezvous ok: rank %s/%s sum=%s hosts=%s master=%s:%s in %.2fs; device cuda:%s (%s)",
        rank,
        summary["world_size"],
        summary["sum"],
        ",".join(map(str, summary["hosts"])),
        summary["master_addr"],
        summary["master_port"],
        summary["seconds"],
        mine["index"],
        mine["device_id"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
