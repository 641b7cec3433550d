"""``megatron-fp8 demo``: what ``make demo`` runs -- the GRPO job on the embedded default config.

Three arms (BF16 rollout, FP8 rollout, FP8 rollout + token TIS C=2) on the tiny model and the
``addition`` toy task; on CPU the rollout engine is the reference FP8 engine (an emulator of
vLLM's FP8 numerics). Prints where the summary table and the plot are, and the wall-clock and CPU
time the demo took (the CPU time counts this process and its children, e.g. the one-time vLLM ask).
"""

from __future__ import annotations

import argparse
import os
import time

from megatron_fp8.cli.grpo import run_job


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--out``, ``--no-progress`` and ``--overwrite``."""
    parser.add_argument("--out", default="out/demo", metavar="DIR", help="output folder (default: out/demo)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier run's outputs in --out (refused otherwise)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the embedded default GRPO job into ``--out``."""
    job = argparse.Namespace(
        config=None,
        steps=None,
        out=args.out,
        arms=None,
        overrides=[],
        no_progress=args.no_progress,
        overwrite=args.overwrite,
        verbose=getattr(args, "verbose", False),
    )
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    paths = run_job(job)
    if paths is None:  # a rank other than 0 of a multi-process launch: rank 0 reports
        return 0
    metrics, summary, plot = paths
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    print(
        f"demo finished in {wall:.0f} s wall, {cpu:.0f} s CPU on {os.cpu_count()} core(s).\n"
        f"  table:   {summary}\n  plot:    {plot}\n  metrics: {metrics}"
    )
    return 0


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
