"""``megatron-fp8 launch``: torchrun for megatron-fp8, ending a signal with the project's one line, not a traceback.

``megatron-fp8 launch [torchrun options] COMMAND [its arguments]`` is ``torchrun [torchrun options] -m megatron_fp8
COMMAND ...`` (``torch.distributed.run``, run in this process), with two differences:

* a signal to the launcher (Ctrl-C = SIGINT to its process group, SIGTERM, SIGUSR1) is passed on to every rank, which
  saves its last completed step and stops (:mod:`megatron_fp8.rl.driver.stopping`; the launcher waits up to
  ``--shutdown-timeout``, default :data:`SHUTDOWN_TIMEOUT_S` here, not torchrun's 30 s), and the launcher ends with
  one line and exit 128 + the signal (130 after Ctrl-C), where torchrun ends in its ``SignalException`` traceback,
  exit 1;
* a rank that fails ends the launcher with one line naming the rank and its exit code, and that exit code (torchrun
  prints a ``ChildFailedError`` report and exits 1).

The ranks' own stop line says what was saved where and the command that continues, which is this ``launch`` command
(:data:`LAUNCH_ENV` tells them how they were started).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys

LAUNCH_ENV = "MEGATRON_FP8_LAUNCH"
"""The command prefix that started the ranks (``megatron-fp8 launch --nproc-per-node 2``), read by their stop line."""

SHUTDOWN_TIMEOUT_S = 900
"""How long the launcher waits for the ranks to finish their step and save after a signal (torchrun: 30 s)."""

NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
"""``--nproc-per-node`` values torchrun takes besides a count (one process per core, GPU or XPU; ``auto``: GPUs,
else cores)."""

SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""The signals the launcher passes on to the ranks (torchrun's, plus Slurm's warning SIGUSR1)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Everything after ``launch``: torchrun's options, then a megatron-fp8 command and its arguments."""
    parser.add_argument(
        "torchrun_args",
        nargs=argparse.REMAINDER,
        metavar="[TORCHRUN OPTIONS] COMMAND ...",
        help="e.g. --nproc-per-node 2 grpo --config PATH --out DIR",
    )


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(torchrun options, megatron-fp8 command + its arguments)``: the command starts at its name.

    Raises:
        UsageError: no megatron-fp8 command named.
    """
    from megatron_fp8.cli import COMMANDS  # lazy: the package imports this module's name only
    from megatron_fp8.errors import UsageError

    for i, arg in enumerate(argv):
        if arg in COMMANDS and arg != "launch":
            return argv[:i], argv[i:]
    raise UsageError(
        "launch needs a megatron-fp8 command after torchrun's options, e.g. "
        "`megatron-fp8 launch --nproc-per-node 2 grpo --out DIR`"
    )


def run(args: argparse.Namespace) -> int:
    """Run torchrun in this process; a signal or a failed rank ends in one line and its exit code."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    if {"-h", "--help"} & set(args.torchrun_args) and not any(a in args.torchrun_args for a in ("grpo", "config")):
        print(__doc__.split("\n\n")[1].replace("``", "`"))
        get_args_parser().print_help()
        return 0
    options, command = split_command(list(args.torchrun_args))
    given = {o.split("=", 1)[0].replace("_", "-") for o in options if o.startswith("--")}
    defaults = [] if "--shutdown-timeout" in given else ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    defaults += [] if "--signals-to-handle" in given else ["--signals-to-handle", SIGNALS]
    torchrun_args = get_args_parser().parse_args([*defaults, *options, "-m", "megatron_fp8", *command])
    nproc = str(torchrun_args.nproc_per_node)
    if not (nproc.isdigit() and int(nproc) > 0) and nproc not in NPROC_WORDS:
        from megatron_fp8.errors import UsageError

        raise UsageError(
            f"--nproc-per-node {nproc!r}: give the processes per node as a number >= 1 (e.g. --nproc-per-node 2), "
            f"or one of torchrun's words: {', '.join(NPROC_WORDS)}"
        )
    os.environ[LAUNCH_ENV] = " ".join(shlex.quote(a) for a in ["megatron-fp8", "launch", *options])
    try:
        torchrun(torchrun_args)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(
            f"megatron-fp8 launch: {name} passed on to every rank; each saved its last completed step if "
            "checkpointing is on and said so above, with the command that continues",
            file=sys.stderr,
        )
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        rank, failure = min(exc.failures.items())
        print(
            f"megatron-fp8 launch: rank {rank} exited with code {failure.exitcode} ({len(exc.failures)} rank(s) "
            "failed); its error is the line above",
            file=sys.stderr,
        )
        return failure.exitcode if 0 < failure.exitcode < 256 else 1
    return 0
