"""``megatron-fp8 report DIR``: rebuild a run's ``summary.md`` and ``metrics.png`` from its ``metrics.jsonl``.

Works on a finished run, an interrupted one (every completed step is in ``metrics.jsonl``) and a crashed
one; the summary header uses the run's ``config.yaml`` when it is there.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_fp8.errors import UsageError
from megatron_fp8.rl.state.outputs import rebuild_outputs
from megatron_fp8.rl.state.report import terminal_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the run folder."""
    parser.add_argument("dir", metavar="DIR", help="a run's output folder (holds metrics.jsonl)")


def run(args: argparse.Namespace) -> int:
    """Rebuild and print the summary table."""
    given = Path(args.dir)
    if given.is_file():
        raise UsageError(
            f"{given} is a file; report wants the run folder that holds metrics.jsonl: megatron-fp8 report "
            f"{given.parent}"
        )
    summary, plot, arms = rebuild_outputs(args.dir)
    print(terminal_table(arms))  # 80 columns; summary.md has every column
    steps = sum(len(a.steps) for a in arms)
    print(f"rebuilt from {steps} step(s) of {len(arms)} arm(s).\n  table: {summary}\n  plot:  {plot}")
    return 0
