"""The ``megatron-fp8`` command line.

Subcommands are declared in :data:`COMMANDS` (name -> module, one-line help);
each module defines ``add_arguments(parser)`` and ``run(args) -> int`` and is
imported only when its command runs, so ``megatron-fp8 doctor`` never pays for
importing vLLM or Megatron.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Mapping
from types import ModuleType

from megatron_fp8 import __version__
from megatron_fp8.cli._io import say
from megatron_fp8.cli._noise import quiet_third_party
from megatron_fp8.errors import ConfigError, MegatronFP8Error, UsageError
from megatron_fp8.launch_env import launch_place

COMMANDS: dict[str, tuple[str, str]] = {  # name -> (module, one-line help)
    "doctor": ("megatron_fp8.cli.doctor", "which FP8 recipes this machine can run, and why not"),
    "demo": ("megatron_fp8.cli.demo", "the main job on the embedded default (what `make demo` runs)"),
    "manifest": ("megatron_fp8.cli.manifest", "the set of HF parameters vLLM holds in FP8 (asked of vLLM once)"),
    "refit": ("megatron_fp8.cli.refit", "refit an engine from a Megatron model: FP8 vs BF16 payload, time, error"),
    "grpo": ("megatron_fp8.cli.grpo", "GRPO with FP8 rollout: BF16 vs FP8 vs FP8+TIS arms"),
    "config": ("megatron_fp8.cli.config", "load, validate and print a run config"),
    "report": ("megatron_fp8.cli.report", "rebuild a run's summary.md and metrics.png from its metrics.jsonl"),
    "launch": ("megatron_fp8.cli.launch", "torchrun -m megatron_fp8 COMMAND; a signal ends in one line, no traceback"),
}

EXIT_ERROR = 1
"""Exit code of a run that failed with a clear error (bad config, refused refit, ...)."""
EXIT_USAGE = 2
"""Exit code of a usage error (a bad command-line argument, an unusable --out), as argparse's own."""
EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT)."""


def _load(name: str) -> ModuleType:
    """Import the module of command ``name`` (only the command that runs is ever imported)."""
    module_name, _ = COMMANDS[name]
    return importlib.import_module(module_name)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The top-level parser; only the subcommand named in ``argv`` gets its arguments (and its module imported)."""
    parser = argparse.ArgumentParser(prog="megatron-fp8", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"megatron-fp8 {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            _load(name).add_arguments(p)
    return parser


def log_format(env: Mapping[str, str]) -> str:
    """The commands' log line: ``LEVEL name: message``, with ``[rank N]`` after the level where a launcher started
    several processes (``WORLD_SIZE`` > 1), so the lines every rank prints can be told apart."""
    try:
        place = launch_place(env)
    except ConfigError:  # reported, with its fix, where the command reads the launch (not before the CLI's handler)
        place = None
    if place is not None and place.world_size > 1:
        return f"%(levelname)s [rank {place.rank}] %(name)s: %(message)s"
    return "%(levelname)s %(name)s: %(message)s"


def main(argv: list[str] | None = None) -> int:
    """Run ``megatron-fp8``; returns the exit code.

    Errors end in one line on stderr, never a traceback unless ``--debug``: :data:`EXIT_USAGE` for a usage
    error (no command, :class:`~megatron_fp8.errors.UsageError`), :data:`EXIT_ERROR` for every other
    :class:`MegatronFP8Error`, a file-system error or an unexpected exception, :data:`EXIT_INTERRUPTED`
    after Ctrl-C (what was complete is kept: e.g. GRPO rebuilds its summary from the finished steps).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not {"-v", "--verbose"} & set(argv):  # read by torch's C++ logging when torch loads (build_parser may load it)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    first = next((i for i, a in enumerate(argv) if a in COMMANDS), None)
    passed_on = argv[first + 1 :] if first is not None and argv[first] == "launch" else None
    argv = argv[: first + 1] if passed_on is not None and first is not None else argv  # launch: torchrun's options
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if passed_on is not None:
        args.torchrun_args = passed_on
    # overrides may stand anywhere among the options: argparse takes the first run of them, the rest come back here
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*(args.overrides or []), *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=log_format(os.environ))
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    quiet_third_party(verbose=args.verbose)  # before any command imports the Megatron / vLLM stacks
    prefix = f"megatron-fp8 {args.command}"
    try:
        return int(_load(args.command).run(args) or 0)
    except KeyboardInterrupt:
        if args.debug:
            raise
        say(f"{prefix}: interrupted; outputs of completed work are kept")
        return EXIT_INTERRUPTED
    except MegatronFP8Error as exc:
        if args.debug:
            raise
        say(f"{prefix}: error: {exc}")
        return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_ERROR
    except OSError as exc:
        if args.debug:
            raise
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        say(f"{prefix}: error: {exc.strerror or exc}{where}; check the path and its permissions")
        return EXIT_ERROR
    except Exception as exc:
        if args.debug:
            raise
        from megatron_fp8.files import disk_error_kind  # lazy: only on this path

        kind = disk_error_kind(exc, os.getcwd())
        if kind is not None:  # a write no guard named: still not a bug to report
            say(f"{prefix}: error: {kind} ({type(exc).__name__}: {exc}); free space, then rerun")
            return EXIT_ERROR
        say(
            f"{prefix}: unexpected error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback, "
            "and please report it)"
        )
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
