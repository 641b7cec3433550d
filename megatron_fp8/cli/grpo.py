"""``megatron-fp8 grpo``: GRPO with BF16 vs FP8 vs FP8+TIS rollout, the main job.

``megatron-fp8 grpo [--config PATH] [--steps N] [--out DIR] [--arms a,b,c] [dotted.key=value ...]``
runs :func:`megatron_fp8.rl.driver.grpo.run_grpo` (embedded default: the tiny model on the
``addition`` toy task; ``data.train.data_path=F.jsonl`` trains on a file) and writes ``metrics.jsonl``,
``summary.md``, ``metrics.png`` and ``config.yaml`` (and ``warm_start/``, ``validation.jsonl``, ``logs/``)
into ``--out`` (default: the config's ``out_dir``, else a new ``out/grpo-<time>`` per run; a run resumed from its
checkpoints continues in their folder); a folder holding another run's outputs is refused
unless ``--overwrite``, or unless the run resumes from ``checkpointing.checkpoint_dir``. A progress bar
runs on stderr; the summary table is printed at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from megatron_fp8.cli._io import say
from megatron_fp8.cli._noise import quiet_third_party
from megatron_fp8.config import load_config_report
from megatron_fp8.config.nemo_rl.inheritance import with_env_hints
from megatron_fp8.config.refusals import refuse_before_run
from megatron_fp8.errors import ConfigError, UsageError
from megatron_fp8.vocab import ARMS

logger = logging.getLogger(__name__)

MODEL_HELP = "'tiny', 'tiny-moe', a checkpoint folder or a Hugging Face id (= model.name_or_path=NAME)"


def model_override(args: argparse.Namespace) -> list[str]:
    """``--model NAME`` as the override it stands for (``[]`` without it).

    Raises:
        UsageError: an empty name.
    """
    model = getattr(args, "model", None)
    if model is None:
        return []
    if not model.strip():
        raise UsageError("--model '' names no model; give 'tiny', a checkpoint folder or a Hugging Face id")
    return [f"model.name_or_path={model}"]


ARMS_HELP = f"comma-separated arms: {', '.join(ARMS)} (= grpo.arms=[...])"


def arms_argument(args: argparse.Namespace) -> list[str] | None:
    """The arms ``--arms a,b`` names (``None`` without it).

    Raises:
        UsageError: an empty or unknown arm name.
    """
    if getattr(args, "arms", None) is None:
        return None
    arms = [a.strip() for a in args.arms.split(",")]
    if not all(arms):
        raise UsageError(f"--arms {args.arms!r} has an empty arm name; e.g. --arms {','.join(ARMS)}")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise UsageError(f"--arms {args.arms!r}: unknown arm(s) {unknown}; valid arms: {', '.join(ARMS)}")
    return arms


def command_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides ``config`` and ``grpo`` apply: the ``KEY=VALUE`` words, then what ``--model``, ``--arms``,
    ``--allow-no-effect`` and ``--allow-over-memory`` stand for (so every check of the config sees them).

    A key given twice with different values takes the last one, as NeMo-RL's command line does, and a warning names
    every value and the one used (``--model`` is applied after the words, so it wins over ``model.name_or_path=``).

    Raises:
        UsageError: an empty ``--model``, an empty or unknown arm.
    """
    given = [(item, item) for item in getattr(args, "overrides", None) or []]  # (override, as the user wrote it)
    given += [(item, f"--model {args.model}") for item in model_override(args)]
    arms = arms_argument(args)
    if arms is not None:
        given.append((f"grpo.arms=[{','.join(arms)}]", f"--arms {args.arms}"))
    for flag in ("allow_no_effect", "allow_over_memory"):
        if getattr(args, flag, False):
            given.append((f"grpo.{flag}=true", f"--{flag.replace('_', '-')}"))
    _warn_repeated(given)
    return [item for item, _ in given]


def _warn_repeated(given: list[tuple[str, str]]) -> None:
    """Warn about each key set more than once to different values (``given``: (override, as written) pairs)."""
    by_key: dict[str, list[tuple[str, str]]] = {}
    for item, written in given:
        key, sep, value = item.lstrip("+").partition("=")
        if sep:  # a malformed word is the loader's usage error
            by_key.setdefault(key.strip(), []).append((value.strip(), written))
    for key, values in by_key.items():
        if len({value for value, _ in values}) > 1:
            logger.warning(
                "%s is given %d times (%s): the last, %s, is used",
                key, len(values), ", ".join(written for _, written in values), values[-1][1],
            )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--config``, ``--steps``, ``--out``, ``--arms``, ``--model``, ``--no-progress``, ``--overwrite``,
    overrides."""
    parser.add_argument("--config", default=None, help="YAML file (default: the embedded tiny_cpu.yaml)")
    parser.add_argument(
        "--steps", type=int, default=None, metavar="N", help="steps per arm (default: grpo.max_num_steps)"
    )
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output folder (default: the config's out_dir, else a new out/grpo-<time>; a resumed run continues in its "
        "checkpoint's folder)",
    )
    parser.add_argument("--arms", default=None, metavar="a,b,c", help=ARMS_HELP)
    parser.add_argument("--model", default=None, metavar="NAME", help=MODEL_HELP)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace another run's outputs in --out (refused otherwise)"
    )
    parser.add_argument(
        "--allow-no-effect",
        action="store_true",
        help="run although NeMo-RL keys that change the experiment have no effect here (= grpo.allow_no_effect=true)",
    )
    parser.add_argument(
        "--allow-over-memory",
        action="store_true",
        help="run although the memory plan per phase exceeds the GPU (= grpo.allow_over_memory=true)",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. grpo.seed=1")


def run_job(args: argparse.Namespace) -> tuple[Path, Path, Path] | None:
    """Load the config, run GRPO and print the summary; returns ``(metrics, summary, plot)`` paths."""
    verbose = getattr(args, "verbose", False)
    quiet_third_party(verbose=verbose)  # before the Megatron / vLLM stacks are imported
    # lazy: the RL stack (engines, trainer) loads only when a run starts, not for `grpo --help`
    from megatron_fp8.rl.driver.grpo import run_grpo
    from megatron_fp8.rl.driver.preflight import refuse_empty_config

    refuse_empty_config(args.config)
    overrides = command_overrides(args)  # every check of the config sees --model, --arms and the --allow-* flags
    arms = arms_argument(args)
    loaded = load_config_report(args.config, overrides)
    config = loaded.config
    refuse_before_run(config, loaded.no_effect)
    logging.getLogger().setLevel(config.logging.level if not verbose else "DEBUG")
    if args.out is not None and not args.out.strip():
        raise UsageError("--out '' names no folder; give a path, or leave --out out for a new folder per run")
    out = Path(args.out) if args.out else (Path(config.out_dir) if config.out_dir else None)
    steps = getattr(args, "steps", None)
    if steps is not None and steps < 1:
        raise UsageError(f"--steps must be >= 1, got {steps}")
    try:
        result = run_grpo(
            config,
            out_dir=out,
            steps=steps,
            arms=arms,
            progress=not getattr(args, "no_progress", False),
            overwrite=getattr(args, "overwrite", False),
        )
    except ConfigError as exc:  # a value read from an environment variable: the message names it
        hinted = with_env_hints(str(exc), loaded.env)
        if hinted == str(exc):
            raise
        raise ConfigError(hinted) from exc
    if result.summary_path is None:  # a rank other than 0 of a multi-process run: rank 0 writes
        print(f"rank done in {result.seconds:.0f} s; rank 0 writes the outputs to {result.out_dir}")
        return None
    from megatron_fp8.rl.state.report import terminal_table  # lazy, as run_grpo

    print(terminal_table(result.arms))  # 80 columns; summary.md has every column and the run's settings
    print(f"finished in {result.seconds:.0f} s")
    return result.metrics_path, result.summary_path, result.plot_path


def continue_prefix(env: Mapping[str, str]) -> str:
    """How the printed continue command starts: the ``megatron-fp8 launch ...`` that started the ranks; under plain
    torchrun on one node the equivalent ``launch`` (torchrun in process: a signal ends in one line, not torchrun's
    traceback); on several nodes, torchrun's node and process counts (the rendezvous options are the user's: not
    known here); else ``megatron-fp8``.

    Args:
        env: the rank's environment (``MEGATRON_FP8_LAUNCH``, torchrun's ``TORCHELASTIC_RUN_ID``,
            ``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``).
    """
    from megatron_fp8.cli.launch import LAUNCH_ENV  # set by `megatron-fp8 launch` for the ranks it starts

    if env.get(LAUNCH_ENV):
        return env[LAUNCH_ENV]
    if "TORCHELASTIC_RUN_ID" not in env:
        return "megatron-fp8"
    try:
        local = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
        nodes = max(1, int(env.get("WORLD_SIZE", str(local))) // local)
    except ValueError:
        return "megatron-fp8"
    if nodes == 1:
        return f"megatron-fp8 launch --nproc-per-node {local}"
    return f"torchrun --nnodes {nodes} --nproc-per-node {local} -m megatron_fp8"  # + the rendezvous, on every node


def run(args: argparse.Namespace) -> int:
    """Run the job; errors of the package propagate (exit 1 via the CLI).

    A run stopped at a safe point (SIGTERM / SIGUSR1 / Ctrl-C, ``checkpoint_must_save_by``) prints one line and
    returns :data:`~megatron_fp8.rl.driver.stopping.EXIT_STOPPED` when a checkpoint holds its last step (1 when
    checkpointing is off: nothing to continue from; 130 after Ctrl-C).
    """
    from megatron_fp8.cli import EXIT_ERROR, EXIT_INTERRUPTED
    from megatron_fp8.rl.driver.stopping import (
        EXIT_STOPPED,
        RunStopped,
        next_command,
        stop_message,
        tolerate_usr1_outside_steps,
    )

    tolerate_usr1_outside_steps()  # a "time limit near" after the last step must not fail a finished run
    try:
        paths = run_job(args)
    except RunStopped as stopped:
        command = " ".join(
            [continue_prefix(os.environ), *(shlex.quote(a) for a in next_command(sys.argv[1:], stopped))]
        )
        if os.environ.get("RANK", "0") == "0":  # every rank stopped at the same step (agreed): one line says so
            say(f"megatron-fp8 grpo: {stop_message(stopped, command=command)}")
        if stopped.reason == "SIGINT":
            return EXIT_INTERRUPTED
        return EXIT_STOPPED if stopped.checkpoint is not None else EXIT_ERROR  # nothing to continue from
    if paths is not None:
        metrics, summary, plot = paths
        print(f"metrics: {metrics}\nsummary: {summary}\nplot:    {plot}")
    return 0
