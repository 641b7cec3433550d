"""``megatron-fp8 config``: load, validate and print a run config.

``megatron-fp8 config [--config PATH] [dotted.key=value ...] [--json]`` prints
the resolved config as YAML (or JSON), after the overrides, the model
dimensions filled in and every validation rule passed. A bad config exits 1 with
the error naming the dotted key and the fix.
"""

from __future__ import annotations

import argparse
import json

from megatron_fp8.config import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--config``, ``--json`` and the positional overrides."""
    parser.add_argument("--config", default=None, help="YAML file (default: the embedded tiny_cpu.yaml)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. grpo.num_steps=3")


def run(args: argparse.Namespace) -> int:
    """Print the resolved config; :class:`~megatron_fp8.errors.ConfigError` propagates (exit 1 via the CLI)."""
    cfg = load_config(args.config, args.overrides)
    if args.json:
        print(json.dumps(cfg.to_dict(), indent=2))
    else:
        print(
            f"# training recipe: {cfg.training_recipe}; rollout: {cfg.policy.generation.vllm_cfg.precision}"
            f"{' blockwise' if cfg.rollout_blockwise else ''}"
        )
        print(cfg.dump_yaml(), end="")
    return 0
