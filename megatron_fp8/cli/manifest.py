"""``megatron-fp8 manifest``: the HF parameters vLLM holds in FP8, asked of vLLM once per setup.

Each setup (quantization config, BF16 layers, ignored-layer keywords, model config, vLLM version)
is stored in its own file of the cache, so ``--num-first-layers-in-bf16 1`` after a plain run asks
vLLM once for the new setup and both stay reusable.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from bridge_mappings.manifest import ManifestStore, build_quantization_config
from megatron_fp8.cli._io import stdout_to_stderr
from megatron_fp8.models import resolve_model
from megatron_fp8.vocab import FP8_DTYPE_NAME, SCALE_SUFFIX


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--model``, the BF16 layer counts, ``--quantize-router``, ``--ignored-layer-kw``, ``--refresh``,
    ``--store``, ``--json``."""
    parser.add_argument("--model", default="tiny", help="'tiny', 'tiny-moe' or an HF checkpoint folder")
    parser.add_argument("--num-first-layers-in-bf16", type=int, default=0, metavar="N")
    parser.add_argument("--num-last-layers-in-bf16", type=int, default=0, metavar="N")
    parser.add_argument(
        "--quantize-router",
        action="store_true",
        help="do not put the MoE router into ignored_layers (vLLM then holds it in FP8)",
    )
    parser.add_argument(
        "--ignored-layer-kw",
        action="append",
        default=[],
        metavar="KW",
        help="keep every linear module whose name contains KW in BF16 (vllm_cfg.quantization_ignored_layer_kws)",
    )
    parser.add_argument("--refresh", action="store_true", help="ask vLLM again even if a matching manifest is stored")
    parser.add_argument("--store", default=None, help="folder of stored manifests (default: the cache folder)")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the FP8 manifest of ``--model`` (asking vLLM only when no matching one is stored)."""
    path = resolve_model(args.model)
    qcfg = build_quantization_config(
        path,
        num_first_layers_in_bf16=args.num_first_layers_in_bf16,
        num_last_layers_in_bf16=args.num_last_layers_in_bf16,
        keep_router_bf16=not args.quantize_router,
        ignored_layer_kws=tuple(args.ignored_layer_kw),
    )
    with stdout_to_stderr(args.json):
        stored = ManifestStore(args.store).get_or_ask(
            path,
            qcfg,
            num_first_layers_in_bf16=args.num_first_layers_in_bf16,
            num_last_layers_in_bf16=args.num_last_layers_in_bf16,
            refresh=args.refresh,
        )
    m = stored.manifest
    if args.json:
        out = m.to_json()
        out["reused"] = stored.reused
        out["path"] = str(stored.path)
        print(json.dumps(out, indent=1))
        return 0
    console = Console()
    status = "reused the stored manifest" if stored.reused else "asked vLLM and stored the answer"
    console.print(
        f"[bold]FP8 manifest[/] for {path}\n  source: {m.source}\n  {status}: {stored.path}\n"
        f"  fingerprint: {m.fingerprint.digest}"
    )
    table = Table("HF parameter", "vLLM holds it in")
    for name in m.fp8_params:
        table.add_row(name, f"[green]{FP8_DTYPE_NAME}[/] (+ {SCALE_SUFFIX})")
    for name in m.fp8_capable_bf16:
        table.add_row(name, "[yellow]bfloat16[/] (ignored layer)")
    console.print(table)
    console.print(
        f"{len(m.fp8_params)} FP8, {len(m.bf16_params)} BF16 tensors "
        f"({len(m.fp8_capable_bf16)} of them linear weights kept in BF16 by ignored_layers)"
    )
    return 0
