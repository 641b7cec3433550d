"""``megatron-fp8 refit``: refit an engine from a Megatron model; FP8 vs BF16 payload, time, error."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from rich.console import Console
from rich.table import Table

from bridge_mappings.manifest import ManifestStore, build_quantization_config
from megatron_fp8.cli._io import stdout_to_stderr
from megatron_fp8.errors import UsageError
from megatron_fp8.megatron import build_megatron_model, export_hf_weights, megatron_parallel
from megatron_fp8.models import resolve_model

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--model``, ``--compare-bf16``, ``--transport``, ``--repeats``, the BF16 layer counts, ``--json``."""
    parser.add_argument("--model", default="tiny", help="'tiny', 'tiny-moe' or an HF checkpoint folder")
    parser.add_argument("--compare-bf16", action="store_true", help="also refit the same parameters in BF16")
    parser.add_argument("--transport", choices=("inproc", "gloo"), default="inproc")
    parser.add_argument("--repeats", type=int, default=3, help="refits to time, >= 1 (median reported)")
    parser.add_argument("--num-first-layers-in-bf16", type=int, default=0, metavar="N")
    parser.add_argument("--num-last-layers-in-bf16", type=int, default=0, metavar="N")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    """Refit an engine from a Megatron model of ``--model`` and print payload, time and error (exit 1 if unverified)."""
    # lazy: the RL stack (engines, trainer) loads only when a run starts, not for `refit --help`
    from megatron_fp8.rl.driver.refit_session import run_refits, run_refits_over_gloo

    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.num_first_layers_in_bf16 < 0 or args.num_last_layers_in_bf16 < 0:
        raise UsageError("--num-first-layers-in-bf16 / --num-last-layers-in-bf16 must be >= 0")
    from megatron_fp8.rl.driver.runtime import phase, quiet_stdout

    path = resolve_model(args.model)
    runs = {}
    with stdout_to_stderr(args.json):
        qcfg = build_quantization_config(
            path,
            num_first_layers_in_bf16=args.num_first_layers_in_bf16,
            num_last_layers_in_bf16=args.num_last_layers_in_bf16,
        )
        stored = ManifestStore().get_or_ask(
            path,
            qcfg,
            num_first_layers_in_bf16=args.num_first_layers_in_bf16,
            num_last_layers_in_bf16=args.num_last_layers_in_bf16,
        )
        manifest = stored.manifest
        precisions = ("fp8", "bf16") if args.compare_bf16 else ("fp8",)
        if args.transport == "inproc":
            with megatron_parallel():
                with phase("building the Megatron-Core model (blockwise recipe)"), quiet_stdout():
                    m = build_megatron_model(path, recipe="blockwise")
                for precision in precisions:
                    with phase(f"{args.repeats} {precision.upper()} refit(s) in process, verified"):
                        runs[precision] = run_refits(m, path, manifest, precision=precision, repeats=args.repeats)
        else:
            with megatron_parallel():
                with phase("building the Megatron-Core model (blockwise recipe)"), quiet_stdout():
                    m = build_megatron_model(path, recipe="blockwise")
                weights = dict(export_hf_weights(m))
            for precision in precisions:
                logger.info("%d %s refit(s) over gloo to a receiver process, verified ...", args.repeats, precision)
                runs[precision] = run_refits_over_gloo(
                    weights,
                    path,
                    manifest,
                    precision=precision,
                    repeats=args.repeats,
                    prompt=(1, 2, 3, 4),
                    timeout=120.0,
                )
    fp8 = runs["fp8"]
    out = {
        "model": str(path),
        "transport": args.transport,
        "manifest_source": manifest.source,
        "manifest_reused": stored.reused,
        "fp8_params": len(manifest.fp8_params),
        "fp8_payload_bytes": fp8.manifest_param_bytes,
        "verified": all(r.verified for r in runs.values()),
        "max_rel_weight_error": fp8.max_rel_weight_error,
        "fp8_refit_seconds": fp8.seconds,
        "runs": {k: dataclasses.asdict(v) for k, v in runs.items()},
    }
    if "bf16" in runs:
        bf16 = runs["bf16"]
        out["bf16_payload_bytes_same_params"] = bf16.manifest_param_bytes
        out["payload_ratio_fp8_over_bf16"] = fp8.manifest_param_bytes / bf16.manifest_param_bytes
        out["bf16_refit_seconds"] = bf16.seconds
        out["time_ratio_fp8_over_bf16"] = fp8.seconds / bf16.seconds
    if args.json:
        print(json.dumps(out, indent=1))
        return 0 if out["verified"] else 1
    console = Console()
    console.print(
        f"[bold]refit[/] {path} over {args.transport}; manifest: {manifest.source} "
        f"({'reused' if stored.reused else 'asked now'}), {len(manifest.fp8_params)} FP8 params"
    )
    # Key columns only, in MB, so the table fits 80 columns; --json has every number.
    table = Table("precision", "FP8-param MB", "wire MB fp8/scl/bf16", "median s", "verified", "max rel err")
    for r in runs.values():
        pb = r.payload_bytes
        table.add_row(
            r.precision,
            f"{r.manifest_param_bytes / 1e6:.3f}",
            f"{pb['fp8'] / 1e6:.2f}/{pb['scales'] / 1e6:.3f}/{pb['bf16'] / 1e6:.2f}",
            f"{r.seconds:.3f}",
            "yes" if r.verified else "NO",
            f"{r.max_rel_weight_error:.4f}",
        )
    console.print(table)
    if "bf16" in runs:
        console.print(
            f"payload FP8/BF16 over the FP8 params: {out['payload_ratio_fp8_over_bf16']:.6f}; "
            f"time FP8/BF16: {out['time_ratio_fp8_over_bf16']:.3f}"
        )
    return 0
