"""``megatron-fp8 doctor``: which FP8 recipes this machine can run, and why not.

Prints an environment panel (GPU, compute capability, CUDA build, cuBLAS,
TransformerEngine, vLLM, DeepGEMM, Megatron versions) and a table recipes x this
machine. ``--json`` prints exactly::

    {"environment": {...}, "recipes": [{"name": str, "supported": bool, "reasons": [str, ...]}, ...]}

It never imports torch, vLLM, Megatron or TransformerEngine (see
:func:`megatron_fp8.recipes.capability.probe_environment`), so it answers in
well under two seconds.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from megatron_fp8.recipes import CPU_EMULATION_NOTE, RECIPES, check_all, probe_environment

_ENV_ROWS: tuple[tuple[str, str], ...] = (
    ("GPU", "gpu_name"),
    ("GPUs", "gpu_count"),
    ("compute capability", "compute_capability"),
    ("driver", "driver_version"),
    ("torch", "torch_version"),
    ("torch CUDA build", "torch_cuda"),
    ("cuBLAS", "cublas_version"),
    ("TransformerEngine", "transformer_engine"),
    ("vLLM", "vllm"),
    ("DeepGEMM", "deep_gemm"),
    ("megatron-core", "megatron_core"),
    ("megatron-bridge", "megatron_bridge"),
    ("nvidia-modelopt", "modelopt"),
    ("triton", "triton"),
    ("python", "python"),
    ("GPU probe", "gpu_probe"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--json``."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace) -> int:
    """Print the report; always exits 0 (an unsupported recipe is information, not a failure)."""
    env = probe_environment()
    verdicts = check_all(env)
    if args.json:
        payload = {"environment": env.to_dict(), "recipes": [v.to_dict() for v in verdicts]}
        print(json.dumps(payload, indent=2))
        return 0

    console = Console()
    env_dict = env.to_dict()
    env_table = Table.grid(padding=(0, 2))
    env_table.add_column(style="bold")
    env_table.add_column()
    for label, key in _ENV_ROWS:
        value = env_dict.get(key)
        env_table.add_row(label, "[dim]-[/dim]" if value in (None, "") else str(value))
    console.print(Panel(env_table, title="this machine", expand=False))

    table = Table(title="FP8 recipes on this machine", show_lines=True)
    table.add_column("recipe", style="bold", no_wrap=True)
    table.add_column("runs here", no_wrap=True)
    table.add_column("TE recipe", no_wrap=True)
    table.add_column("why not", ratio=1)
    for verdict in verdicts:
        recipe = RECIPES[verdict.name]
        table.add_row(
            verdict.name,
            "[green]yes[/green]" if verdict.supported else "[red]no[/red]",
            recipe.te_recipe_class or "-",
            "\n".join(f"- {r}" for r in verdict.reasons) or "-",
        )
    console.print(table)
    if not env.has_gpu:
        console.print(f"[yellow]No CUDA GPU: {CPU_EMULATION_NOTE} (fields validated and recorded).[/yellow]")
    return 0
