"""The engine's value check of a host-staged refit version, on the CPU where it runs (part of ``make bench``).

A colocated vLLM engine gets each version staged in host memory (docs/benchmarks.md, "A GRPO run's refit on GPUs"), and its
worker checks the whole version before the first write
(:func:`megatron_fp8.rollout.vllm.expected.validate_version`: NaN/Inf in every weight, scales finite and > 0). Run
on the host's CPU, in the trainer rank's process (often one OpenMP thread: ``torchrun`` sets
``OMP_NUM_THREADS=1``), over every byte of the version: 9.1 GB for the Llama-3.1-8B FP8 set, 16.1 GB for BF16. A GRPO
refit no longer pays it for the weights (the receiver checks NaN/Inf on the GPU as the buckets arrive and tells the
workers, :func:`megatron_fp8.refit.applier.accepts_checked_values`); a worker called directly, or fed by another
caller, still does, and this is its cost.

Measured side by side in one run, per arm (``fp8``: FP8 linear weights + float32 block scales + BF16 rest, as
the engine holds them; ``bf16``: every tensor BF16) and per thread count:

* ``now``: :func:`validate_version` as it is (one ``aminmax`` per float tensor, one ``max`` per byte order per FP8
  tensor: :func:`megatron_fp8.refit.integrity.finite.has_nonfinite`);
* ``previous``: the rule it replaced (until 2026-11-28): ``isfinite(t).all()`` per float tensor and
  ``((bytes & 0x7f) == 0x7f).any()`` per FP8 tensor, each writing temporaries of the tensor's size;
* ``read_floor``: one ``max`` over every tensor's bytes (as int8/int16/int32): the least a value check can read.

The version is random finite data at the 8B set's shapes for ``--layers`` of its 32 decoder layers (embeddings,
norms and ``lm_head`` whole); ``full_set_s`` scales each figure to the whole set's bytes at the rate measured
(an estimate: the rate is per byte). Timings are not pass/fail.

Usage::

    python bench/engine_checks.py [--layers 2] [--threads 1,2] [--repeats 3] [--out bench/results/engine_checks_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from megatron_fp8.layout import ceil_div
from megatron_fp8.refit.synthetic import LlamaSpec, bf16_rest_shapes, get_spec, linear_shapes
from megatron_fp8.rollout.vllm.expected import ExpectedTensor, validate_version
from megatron_fp8.vocab import SCALE_SUFFIX

logger = logging.getLogger("bench.engine_checks")

Items = list[tuple[str, torch.Tensor]]

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Element size -> the integer dtype a read-floor ``max`` views a tensor as."""


def _finite_fp8(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 0x7F, shape, generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)


def _finite_bf16(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 0x3F80, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)


def engine_version(spec: LlamaSpec, *, arm: str, seed: int = 0) -> tuple[Items, dict[str, ExpectedTensor]]:
    """A host-staged version of ``spec`` as the engine receives it, and the engine's expected set for it.

    Args:
        spec: the model's shapes (e.g. ``get_spec("llama-3.1-8b").shrunk(1, num_layers=2)``).
        arm: ``"fp8"`` (linear weights FP8 with float32 128x128 block scales, the rest BF16) or ``"bf16"``.
        seed: random seed.

    Returns:
        ``(items, expected)``: ``(name, host tensor)`` pairs, finite values; name -> :class:`ExpectedTensor`.
    """
    g = torch.Generator().manual_seed(seed)
    items: Items = []
    expected: dict[str, ExpectedTensor] = {}

    def add(name: str, tensor: torch.Tensor, kind: str) -> None:
        items.append((name, tensor))
        dtype = str(tensor.dtype).removeprefix("torch.")
        expected[name] = ExpectedTensor(name=name, shape=tuple(tensor.shape), dtypes=(dtype,), kind=kind, group=name)

    for name, shape in bf16_rest_shapes(spec).items():
        add(name, _finite_bf16(shape, g), "other")
    for name, (n, k) in linear_shapes(spec).items():
        if arm == "bf16":
            add(name, _finite_bf16((n, k), g), "weight")
            continue
        add(name, _finite_fp8((n, k), g), "weight")
        add(name + SCALE_SUFFIX, torch.rand(ceil_div(n, 128), ceil_div(k, 128), generator=g) + 1e-3, "scale")
    return items, expected


def previous_rule(items: Items, expected: dict[str, ExpectedTensor]) -> bool:
    """The engine's value check until 2026-11-28 (the baseline): per-tensor masks. ``True`` when all are good."""
    for name, t in items:
        if expected[name].kind in ("scale", "kv_scale"):
            if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
                return False
        elif t.dtype == torch.float8_e4m3fn:
            if bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
                return False
        elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return False
    return True


def read_floor(items: Items) -> None:
    """One ``max`` over every tensor's bytes read as integers: one read pass, nothing written."""
    for _, t in items:
        t.view(_INT_VIEW[t.element_size()]).max()


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    *, spec_name: str, layers: int, threads: Sequence[int], repeats: int, arms: Sequence[str] = ("fp8", "bf16")
) -> dict:
    """Time the three checks per arm and thread count (module docstring); the result as a JSON-able dict."""
    base = get_spec(spec_name)
    spec = base.shrunk(1, num_layers=min(layers, base.num_layers))
    default_threads = torch.get_num_threads()
    out: dict = {
        "what_ran": "bench/engine_checks.py",
        "spec": spec_name,
        "layers": spec.num_layers,
        "of_layers": base.num_layers,
        "repeats": repeats,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "runs": [],
    }
    for arm in arms:
        items, expected = engine_version(spec, arm=arm)
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        full_bytes = set_bytes(base, arm=arm)
        for n in threads:
            torch.set_num_threads(n)
            logger.info("%s arm, %d tensors, %.2f GB, %d thread(s)", arm, len(items), nbytes / 1e9, n)
            now = _median_s(
                lambda items=items, expected=expected: validate_version(items, expected, partial=False), repeats
            )
            prev = _median_s(lambda items=items, expected=expected: previous_rule(items, expected), repeats)
            floor = _median_s(lambda items=items: read_floor(items), repeats)
            run = {"arm": arm, "threads": n, "tensors": len(items), "bytes": nbytes, "full_set_bytes": full_bytes}
            for key, seconds in (("now", now), ("previous", prev), ("read_floor", floor)):
                run[f"{key}_s"] = seconds
                run[f"{key}_gbps"] = nbytes / seconds / 1e9
                run[f"{key}_full_set_s"] = seconds * full_bytes / nbytes
            run["speedup_over_previous"] = prev / now
            run["now_pct_of_read_floor"] = 100.0 * floor / now
            out["runs"].append(run)
        del items, expected
    torch.set_num_threads(default_threads)
    return out


def set_bytes(spec: LlamaSpec, *, arm: str) -> int:
    """Bytes of the whole version of ``spec`` in ``arm`` (:func:`engine_version`'s tensors, counted, not made)."""
    total = sum(2 * math.prod(shape) for shape in bf16_rest_shapes(spec).values())
    for n, k in linear_shapes(spec).values():
        total += (2 if arm == "bf16" else 1) * n * k
        if arm == "fp8":
            total += 4 * ceil_div(n, 128) * ceil_div(k, 128)
    return total


def table(result: dict) -> list[str]:
    """The result as a Markdown table, one row per arm and thread count."""
    lines = [
        f"engine value check of a host-staged {result['spec']} version ({result['layers']} of {result['of_layers']} "
        f"layers measured; 'whole set' scales to all of them), median of {result['repeats']}:",
        "| arm | threads | GB | now s (GB/s) | previous s (GB/s) | speedup | read floor s | now % of floor | whole set: now / previous s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['arm']} | {r['threads']} | {r['bytes'] / 1e9:.2f} | {r['now_s']:.3f} ({r['now_gbps']:.1f}) | "
            f"{r['previous_s']:.3f} ({r['previous_gbps']:.1f}) | {r['speedup_over_previous']:.1f}x | "
            f"{r['read_floor_s']:.3f} | {r['now_pct_of_read_floor']:.0f}% | "
            f"{r['now_full_set_s']:.2f} / {r['previous_full_set_s']:.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="llama-3.1-8b", help="model shapes (megatron_fp8.refit.synthetic.SPECS)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers measured (embeddings and lm_head whole)")
    p.add_argument(
        "--threads", default=None, help="comma-separated torch thread counts (default: 1 and this machine's)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="the tiny model, 1 repeat (for tests)")
    p.add_argument("--out", type=Path, default=Path("bench/results/engine_checks_cpu.json"), help="JSON output path")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.smoke:
        args.spec, args.repeats = "tiny", 1
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, torch.get_num_threads()})
    result = measure(spec_name=args.spec, layers=args.layers, threads=threads, repeats=args.repeats)
    result["smoke"] = args.smoke
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for line in table(result):
        logger.info("%s", line)
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
