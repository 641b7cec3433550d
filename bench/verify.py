#!/usr/bin/env python
"""What the refit guarantees cost: exact verification and rollback, side by side in one run.

The same FP8 refit (synthetic Llama-3.1-8B-shaped weights, the 7 linears of each layer as FP8 +
128x128 float32 block scales, embeddings/norms/lm_head in BF16) is applied through the colocated
pipeline (sender thread, in-process transport, receiver, :class:`~megatron_fp8.refit.DictApplier`)
under three settings of the applier:

* ``bare``: neither exact verification nor rollback copy;
* ``verify``: read back every tensor and compare bytes with what was sent;
* ``verify+rollback``: also copy what the version overwrites, to restore it on a failure.

Each setting runs ``--repeats`` times; the table prints the median seconds and the ratios to
``bare`` and to the whole refit, and ``--out`` writes them as JSON. On CPU the default is 2 of the
32 layers (a full 8B set needs ~32 GB for weights plus targets); ``--layers 32`` on a machine with
the memory, ``--device cuda`` on a GPU.

Example::

    python bench/verify.py --out bench/results/verify.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from megatron_fp8.refit import DictApplier
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.refit.synthetic import fp8_stream, get_spec, linear_shapes, synthetic_weights

logger = logging.getLogger("bench.verify")

SETTINGS: dict[str, dict[str, bool]] = {
    "bare": {"verify": False, "rollback": False},
    "verify": {"verify": True, "rollback": False},
    "verify+rollback": {"verify": True, "rollback": True},
}
"""Applier settings compared, by name."""


def _targets(stream_items: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.empty_like(t) for name, t in stream_items}


def run(*, layers: int, repeats: int, device: str, bucket_mb: float, shrink: int = 1) -> dict:
    """Time each setting; returns the JSON summary."""
    spec = get_spec("llama-3.1-8b").shrunk(shrink, num_layers=layers)
    logger.info("generating synthetic %s weights, %d layer(s), on %s", spec, layers, device)
    weights = synthetic_weights(spec, device=device)
    items = list(fp8_stream(weights, linear_shapes(spec)))  # quantized once: this bench times the apply side
    nbytes = sum(t.numel() * t.element_size() for _, t in items)
    results: dict[str, dict] = {}
    for name, options in SETTINGS.items():
        targets = _targets(items)
        refit = ColocatedRefit(DictApplier(targets, **options), bucket_bytes=int(bucket_mb * (1 << 20)))
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            refit.refit(iter(items))
            times.append(time.perf_counter() - t0)
            logger.info("%s: repeat %d/%d %.3f s", name, i + 1, repeats, times[-1])
        refit.close()
        results[name] = {"median_seconds": statistics.median(times), "seconds": times}
        del targets
    bare = results["bare"]["median_seconds"]
    for r in results.values():
        r["ratio_to_bare"] = r["median_seconds"] / bare
    full = results["verify+rollback"]["median_seconds"]
    verify_s = results["verify"]["median_seconds"] - bare
    rollback_s = full - results["verify"]["median_seconds"]
    return {
        "bench": "refit verification and rollback cost (DictApplier, in-process)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor() or 'unknown'})",
        "torch_threads": torch.get_num_threads(),
        "layers": layers,
        "shrink": shrink,
        "version_bytes": nbytes,
        "repeats": repeats,
        "settings": results,
        "verification_fraction_of_refit": verify_s / full,
        "rollback_fraction_of_refit": rollback_s / full,
    }


def _print(summary: dict) -> None:
    print(
        f"\nrefit of {summary['layers']} layer(s) of Llama-3.1-8B shapes (widths / {summary['shrink']}) + BF16 rest "
        f"({summary['version_bytes'] / 1e9:.2f} GB per version) on {summary['device']}"
    )
    print(f"{'setting':<18}{'median s':>10}{'x bare':>9}")
    for name, r in summary["settings"].items():
        print(f"{name:<18}{r['median_seconds']:>10.3f}{r['ratio_to_bare']:>9.2f}")
    print(
        f"verification: {summary['verification_fraction_of_refit']:.1%} of the refit; "
        f"rollback copy: {summary['rollback_fraction_of_refit']:.1%}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the 8B shapes (default 2 on CPU)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="bucket size, MiB")
    ap.add_argument("--shrink", type=int, default=1, help="divide widths/heads/vocab by this (smoke runs)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON summary here")
    args = ap.parse_args(argv)
    if args.layers < 1 or args.repeats < 1:
        ap.error("--layers and --repeats must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    summary = run(
        layers=args.layers, repeats=args.repeats, device=args.device, bucket_mb=args.bucket_mb, shrink=args.shrink
    )
    _print(summary)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
