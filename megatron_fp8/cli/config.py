"""``megatron-fp8 config``: load, validate and print a run config, or explain every key.

``megatron-fp8 config [--config PATH] [dotted.key=value ...] [--json]`` prints
the resolved config as YAML (or JSON), after the overrides, the model
dimensions filled in and every validation rule passed. The file may be a NeMo-RL
config as it is (``defaults:`` parents, interpolations, NeMo-RL's resolvers).

``megatron-fp8 config --explain CONFIG [overrides] [--json]`` prints every key
instead: its value, the file (parent) that set it, and its effect: where the value
goes, or "no effect" and why. ``--json`` gives the full table.

Without ``--explain`` the config then goes through every check ``megatron-fp8 grpo`` makes before it
touches a model (:func:`megatron_fp8.rl.driver.preflight.preflight`: arms vs rollout precision, processes,
the model resolved and its dimensions against the TP sizes, its tokenizer), so what it refuses ``grpo``
refuses; a Hugging Face model not in the local cache is checked against its known dimensions (nothing
is downloaded) and the output says so. A file that sets no key is refused.

A bad config exits 1 with the error naming the file or dotted key and the fix.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from megatron_fp8.cli._noise import quiet_third_party
from megatron_fp8.cli.grpo import ARMS_HELP, MODEL_HELP, command_overrides
from megatron_fp8.config.explain import explain_rows, render_json, render_text
from megatron_fp8.config.loader import load_config_report
from megatron_fp8.config.memory_plan import memory_report
from megatron_fp8.config.nemo_rl.inheritance import with_env_hints
from megatron_fp8.config.refusals import refuse_before_run
from megatron_fp8.config.schema import RunConfig
from megatron_fp8.errors import ConfigError, UsageError

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--config``, ``--explain``, ``--json`` and the positional overrides."""
    parser.add_argument("--config", default=None, help="YAML file (default: the embedded tiny_cpu.yaml)")
    parser.add_argument(
        "--explain",
        default=None,
        metavar="CONFIG",
        help="explain every key of CONFIG: value, source file, effect (or 'no effect' and why)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of YAML (with --explain: the table)")
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
    parser.add_argument("--model", default=None, metavar="NAME", help=MODEL_HELP)
    parser.add_argument("--arms", default=None, metavar="a,b,c", help=ARMS_HELP)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. grpo.max_num_steps=3")


def _layout_lines(cfg: RunConfig) -> list[str]:
    """``# layout:``, ``# memory per GPU:`` and ``# memory plan`` lines (:func:`memory_report`; a plan over the GPU is
    refused after them by :func:`refuse_before_run`)."""
    lines, _ = memory_report(cfg)
    return [f"# {line}" for line in lines]


def run(args: argparse.Namespace) -> int:
    """Print the resolved config or its explanation; a ``ConfigError`` propagates (exit 1 via the CLI)."""
    if args.explain is not None and args.config is not None and args.explain != args.config:
        raise UsageError(
            f"--config {args.config} and --explain {args.explain} name different files; give one "
            f"(`megatron-fp8 config --explain {args.explain}` explains that file's keys)"
        )
    quiet_third_party(verbose=getattr(args, "verbose", False))
    # lazy: the preflight imports torch and the model stack; `config --explain` and `--help` need neither
    from megatron_fp8.rl.driver.preflight import preflight, refuse_empty_config

    refuse_empty_config(args.explain or args.config)
    loaded = load_config_report(args.explain or args.config, command_overrides(args))  # as `grpo` applies them
    cfg = loaded.config
    if args.explain is not None:
        rows = explain_rows(loaded)
        print(render_json(loaded, rows) if args.json else render_text(loaded, rows), end="" if not args.json else "\n")
        return 0
    for line in _layout_lines(cfg):  # before the preflight: a config it refuses still shows its layout
        print(line, file=sys.stderr if args.json else sys.stdout)
    try:
        refuse_before_run(cfg, loaded.no_effect)
        # every check `grpo` makes before it touches a model
        report = preflight(cfg, download=False, launch_checks="WORLD_SIZE" in os.environ, runs_here=False)
    except ConfigError as exc:  # a value read from an environment variable: the message names it
        hinted = with_env_hints(str(exc), loaded.env)
        if hinted == str(exc):
            raise
        raise ConfigError(hinted) from exc
    for note in report.notes:
        print(f"# preflight: {note}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(cfg.to_dict(), indent=2))
    else:
        print(
            f"# training recipe: {cfg.training_recipe}, policy.precision {cfg.policy.precision}; rollout: "
            f"{cfg.policy.generation.vllm_cfg.precision}"
            f"{' blockwise' if cfg.rollout_blockwise else ''}; arms: {', '.join(report.arms)}; "
            "approved: every check `megatron-fp8 grpo` makes before it starts passed"
        )
        print(cfg.dump_yaml(), end="")
    return 0
