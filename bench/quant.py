"""Quantizer benchmark: blockwise 128x128 FP8 cast of bf16 weights (``make bench``).

On CUDA it measures, in one run and side by side:

* device-to-device copy bandwidth (``dst.copy_(src)`` of a 1 GiB buffer, bytes
  read + written / time): the ceiling for a memory-bound kernel;
* the Triton kernel alone (:func:`megatron_fp8.quant.triton_kernels.launch_blockwise`)
  as effective GB/s = (bytes read + bytes written) / time, and its % of copy
  bandwidth (goal: >= 92% on H100 for 4096x4096 .. 14336x4096);
* the public API with the Triton backend (kernel + non-finite check, which syncs);
* the torch path on the GPU, for reference; and whether its bytes equal the kernel's.

On CPU it compares the chunked torch path with the naive permute-based float64
reference (:mod:`megatron_fp8.quant.reference`): time, speedup, equal bytes.

Shapes: 4096x4096, 14336x4096, 4096x14336, 6144x4096 and a Llama-3.1-8B-shaped
weight set (per layer q 4096x4096, k/v 1024x4096, o 4096x4096, gate/up
14336x4096, down 4096x14336; random data). Bytes moved per weight
``[N, K]`` bf16: ``2NK`` read + ``NK`` written + 4 bytes per block scale.

Usage::

    python bench/quant.py --out bench/results/quant.json [--layers N] [--smoke] [--sweep]
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_fp8.quant import blockwise_scale_shape, quantize_blockwise
from megatron_fp8.quant.reference import quantize_blockwise_naive, quantize_blockwise_reference

SHAPES: tuple[tuple[int, int], ...] = ((4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096))
SMOKE_SHAPES: tuple[tuple[int, int], ...] = ((256, 384), (130, 200))

LLAMA_8B_LAYER: tuple[tuple[str, tuple[int, int]], ...] = (
    ("q_proj", (4096, 4096)),
    ("k_proj", (1024, 4096)),
    ("v_proj", (1024, 4096)),
    ("o_proj", (4096, 4096)),
    ("gate_proj", (14336, 4096)),
    ("up_proj", (14336, 4096)),
    ("down_proj", (4096, 14336)),
)
LLAMA_8B_LAYERS = 32
SMOKE_LAYER: tuple[tuple[str, tuple[int, int]], ...] = tuple(
    (name, (n // 32, k // 32)) for name, (n, k) in LLAMA_8B_LAYER
)

TARGET_PCT_OF_COPY = 92.0
COPY_BUFFER_BYTES = 1 << 30
DTYPE = torch.bfloat16

ROW_KEYS = (
    "shape", "elements", "bytes_moved", "torch_ms", "torch_gbs", "naive_ms", "speedup_vs_naive", "bytes_equal_naive",
    "reference_ms", "speedup_vs_reference",
    "bytes_equal_reference", "triton_ms", "triton_gbs", "pct_of_copy", "triton_api_ms", "copy_same_size_gbs",
    "bytes_equal_torch", "best_config", "triton_api_defer_ms", "api_over_kernel", "api_defer_over_kernel",
    "torchao_ms", "torchao_gbs",
)  # fmt: skip


def bytes_moved(shape: tuple[int, int], elem_bytes: int = 2) -> int:
    """Bytes a blockwise cast must move: input read + fp8 written + float32 scales written."""
    n, k = shape
    return elem_bytes * n * k + n * k + 4 * math.prod(blockwise_scale_shape((n, k)))


def _median_cpu(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _median_cuda(fn: Callable[[], object], *, warmup: int, reps: int, inner: int = 1) -> float:
    """Median milliseconds of one ``fn()`` call, timed with CUDA events over ``inner`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def _inner_for(nbytes: int) -> int:
    """Calls per timed region so each region moves >= 1 GiB (hides launch latency and event overhead)."""
    return max(1, math.ceil((1 << 30) / nbytes))


def _gbs(nbytes: int, ms: float | None) -> float | None:
    return None if not ms else nbytes / (ms * 1e-3) / 1e9


def _empty_row(shape: tuple[int, int]) -> dict:
    row = dict.fromkeys(ROW_KEYS)
    row["shape"] = list(shape)
    row["elements"] = shape[0] * shape[1]
    row["bytes_moved"] = bytes_moved(shape)
    return row


def _same_bytes(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return bool(torch.equal(a[1], b[1]) and torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)))


# ------------------------------------------------------------------ CUDA


def copy_bandwidth_gbs(nbytes: int, *, warmup: int, reps: int) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written per second)."""
    src = torch.empty(nbytes // 2, dtype=DTYPE, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = _median_cuda(lambda: dst.copy_(src), warmup=warmup, reps=reps, inner=_inner_for(2 * nbytes))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def _sweep_configs(x3: torch.Tensor, nbytes: int, *, warmup: int, reps: int) -> tuple[dict, float]:
    from megatron_fp8.quant import triton_kernels

    best: tuple[dict, float] | None = None
    for cols in (1, 2, 4):
        for warps in (4, 8, 16):
            cfg = {"cols_per_program": cols, "num_warps": warps}
            ms = _median_cuda(
                lambda cfg=cfg: triton_kernels.launch_blockwise(x3, 128, 128, "fp32", **cfg),
                warmup=warmup, reps=reps, inner=_inner_for(nbytes),
            )  # fmt: skip
            if best is None or ms < best[1]:
                best = (cfg, ms)
    assert best is not None
    return best


def _torchao_blockwise() -> Callable | None:
    """torchao's plain Triton 128x128 weight quantizer (``x -> (q, scales)``), when torchao is installed."""
    try:
        from torchao.prototype.blockwise_fp8_training.kernels import triton_fp8_blockwise_weight_quant_rhs
    except Exception:  # not installed, or another layout of the package
        return None
    return lambda x: triton_fp8_blockwise_weight_quant_rhs(x, block_size=128)


def bench_shape_cuda(shape: tuple[int, int], copy_gbs: float, *, warmup: int, reps: int, sweep: bool) -> dict:
    from megatron_fp8.quant import triton_kernels

    row = _empty_row(shape)
    nbytes = row["bytes_moved"]
    x = torch.randn(shape, dtype=DTYPE, device="cuda")
    x3 = x.unsqueeze(0)
    inner = _inner_for(nbytes)
    kernel_ms = _median_cuda(
        lambda: triton_kernels.launch_blockwise(x3, 128, 128, "fp32"), warmup=warmup, reps=reps, inner=inner
    )
    if sweep:
        cfg, ms = _sweep_configs(x3, nbytes, warmup=warmup, reps=reps)
        row["best_config"] = {
            **cfg,
            "ms": ms,
            "gbs": _gbs(nbytes, ms),
            "pct_of_copy": 100 * _gbs(nbytes, ms) / copy_gbs,
        }
    row["triton_ms"] = kernel_ms
    row["triton_gbs"] = _gbs(nbytes, kernel_ms)
    row["pct_of_copy"] = 100 * row["triton_gbs"] / copy_gbs
    row["triton_api_ms"] = _median_cuda(
        lambda: quantize_blockwise(x, backend="triton"), warmup=warmup, reps=reps, inner=inner
    )
    row["triton_api_defer_ms"] = _median_cuda(
        lambda: quantize_blockwise(x, backend="triton", nonfinite="defer"), warmup=warmup, reps=reps, inner=inner
    )
    row["api_over_kernel"] = row["triton_api_ms"] / kernel_ms
    row["api_defer_over_kernel"] = row["triton_api_defer_ms"] / kernel_ms
    torchao = _torchao_blockwise()
    if torchao is not None:
        try:
            row["torchao_ms"] = _median_cuda(lambda: torchao(x), warmup=warmup, reps=reps, inner=inner)
            row["torchao_gbs"] = _gbs(nbytes, row["torchao_ms"])
        except Exception as exc:  # another torchao version, another signature: say so, keep the run
            row["torchao_ms"] = f"failed: {type(exc).__name__}: {exc}"[:200]
    row["torch_ms"] = _median_cuda(lambda: quantize_blockwise(x, backend="torch"), warmup=1, reps=max(3, reps // 4))
    row["torch_gbs"] = _gbs(nbytes, row["torch_ms"])
    row["bytes_equal_torch"] = _same_bytes(
        quantize_blockwise(x, backend="triton"), quantize_blockwise(x, backend="torch")
    )
    # what a plain copy of this tensor achieves: small tensors cannot reach the big-buffer figure
    dst = torch.empty_like(x)
    copy_ms = _median_cuda(lambda: dst.copy_(x), warmup=warmup, reps=reps, inner=_inner_for(2 * x.nbytes))
    row["copy_same_size_gbs"] = _gbs(2 * x.nbytes, copy_ms)
    return row


_LEAN = {"clamp": False, "division": "reciprocal_noselect"}
_ONLY = {**_LEAN, "division": "reciprocal_only"}
_BITS_UNMASKED = {"amax_bits": True, "unmasked": True}
LEAN_VARIANTS: dict[str, dict] = {
    "no_clamp": {"clamp": False},
    "lean": _LEAN,
    "lean_amax_bits": {**_LEAN, "amax_bits": True},
    "lean_unmasked": {**_LEAN, "unmasked": True},
    "lean_amax_bits_unmasked": {**_LEAN, "amax_bits": True, "unmasked": True},
    "lean_recip_only": _ONLY,
    "lean_recip_only_amax_bits_unmasked": {**_ONLY, **_BITS_UNMASKED},
    "lean_recip_only_chunks4": {**_ONLY, "chunks": 4},
    "lean_recip_only_amax_bits_unmasked_chunks4": {**_ONLY, **_BITS_UNMASKED, "chunks": 4},
    "lean_recip_only_amax_bits_unmasked_chunks8": {**_ONLY, **_BITS_UNMASKED, "chunks": 8},
}
"""The grouped kernel's same-bytes options ``bench_layer_set_cuda`` times at 4, 8 and 16 warps (JSON keys
``grouped_ms_<name>_by_num_warps`` and ``grouped_<name>_same_bytes``); ``lean`` is the refit's setting."""


def normalized(options: dict) -> dict:
    """A grouped launch's same-bytes options (those ``LEAN_VARIANTS`` set) with ``launch_blockwise_grouped``'s own
    defaults filled in: what the kernel is compiled with."""
    from megatron_fp8.quant.triton_grouped import launch_blockwise_grouped

    params = inspect.signature(launch_blockwise_grouped).parameters
    defaults = {k: params[k].default for k in ("division", "clamp", "amax_bits", "unmasked", "chunks")}
    return {**defaults, **{k: v for k, v in options.items() if k in defaults}}


def best_grouped_setting(layer_set: dict) -> dict | None:
    """The fastest same-bytes setting among the timed ``LEAN_VARIANTS`` next to the refit's own quantizer setting.

    Args:
        layer_set: ``bench_layer_set_cuda``'s result (``grouped_ms_<variant>_by_num_warps``,
            ``grouped_<variant>_same_bytes``, ``grouped_ms``, ``grouped_pct_of_copy``).

    Returns:
        ``{"variant", "options", "num_warps", "ms", "pct_of_copy", "refit": {"variant", "num_warps", "ms"},
        "speedup_over_refit"}``, or ``None`` when no variant was timed with the same bytes. ``refit`` is the variant
        whose options are the refit's (``INTO_BUCKET_*`` of ``megatron_fp8/quant/triton_grouped.py``, the clamp off as
        on CUDA), at its warps; ``None`` there when no variant matches.
    """
    from megatron_fp8.quant import triton_grouped as tg

    ms_per_pct = layer_set["grouped_ms"] * layer_set["grouped_pct_of_copy"]  # pct_of_copy is inverse to ms
    timed = [
        (ms, name, int(warps))
        for name in LEAN_VARIANTS
        if layer_set.get(f"grouped_{name}_same_bytes") is True
        for warps, ms in layer_set.get(f"grouped_ms_{name}_by_num_warps", {}).items()
        if isinstance(ms, (int, float))
    ]
    if not timed:
        return None
    ms, name, warps = min(timed)
    refit_options = normalized({"division": tg.INTO_BUCKET_DIVISION, "clamp": False,
                                 "amax_bits": tg.INTO_BUCKET_AMAX_BITS, "unmasked": tg.INTO_BUCKET_UNMASKED,
                                 "chunks": tg.INTO_BUCKET_CHUNKS})  # fmt: skip
    refit_name = next((n for n, o in LEAN_VARIANTS.items() if normalized(o) == refit_options), None)
    refit_ms = layer_set.get(f"grouped_ms_{refit_name}_by_num_warps", {}).get(str(tg.INTO_BUCKET_NUM_WARPS))
    refit = {"variant": refit_name, "num_warps": tg.INTO_BUCKET_NUM_WARPS, "ms": refit_ms} if refit_name else None
    return {
        "variant": name,
        "options": LEAN_VARIANTS[name],
        "num_warps": warps,
        "ms": ms,
        "pct_of_copy": ms_per_pct / ms,
        "refit": refit,
        "speedup_over_refit": refit_ms / ms if isinstance(refit_ms, (int, float)) else None,
    }


def bench_layer_set_cuda(layer: tuple, layers: int, copy_gbs: float, *, warmup: int, reps: int) -> dict:
    from megatron_fp8.quant import triton_kernels

    weights = [torch.randn(shape, dtype=DTYPE, device="cuda") for _ in range(layers) for _, shape in layer]
    stacks = [w.unsqueeze(0) for w in weights]
    nbytes = sum(bytes_moved(tuple(w.shape)) for w in weights)

    def all_kernels():
        for w3 in stacks:
            triton_kernels.launch_blockwise(w3, 128, 128, "fp32")

    def all_api(backend: str, nonfinite: str = "raise"):
        for w in weights:
            quantize_blockwise(w, backend=backend, nonfinite=nonfinite)

    from megatron_fp8.layout import block_scale_shape
    from megatron_fp8.quant.triton_grouped import GroupedItem, launch_blockwise_grouped

    # one grouped launch per ~1 GiB of FP8 codes, as a refit bucket quantizes its weights
    items = [
        GroupedItem(
            w3,
            torch.empty(w3.shape, dtype=torch.float8_e4m3fn, device="cuda"),
            torch.empty(block_scale_shape(tuple(w3.shape), (128, 128)), device="cuda"),
        )
        for w3 in stacks
    ]
    groups: list[list[GroupedItem]] = [[]]
    for it in items:
        if groups[-1] and sum(g.q.numel() for g in groups[-1]) + it.q.numel() > 1 << 30:
            groups.append([])
        groups[-1].append(it)

    def all_grouped():
        for g in groups:
            launch_blockwise_grouped(g, 128, 128, "fp32")

    out = _layer_set_header(layer, layers, weights, nbytes)
    out["triton_ms"] = _median_cuda(all_kernels, warmup=warmup, reps=reps)
    out["triton_gbs"] = _gbs(nbytes, out["triton_ms"])
    out["pct_of_copy"] = 100 * out["triton_gbs"] / copy_gbs
    out["grouped_launches"] = len(groups)
    out["grouped_ms"] = _median_cuda(all_grouped, warmup=warmup, reps=reps)
    out["grouped_gbs"] = _gbs(nbytes, out["grouped_ms"])
    out["grouped_pct_of_copy"] = 100 * out["grouped_gbs"] / copy_gbs
    sweep = {}
    for warps in (4, 8, 16):  # the launch's own default is 16 for 128x128 tiles
        sweep[str(warps)] = _median_cuda(
            lambda warps=warps: [launch_blockwise_grouped(g, 128, 128, "fp32", num_warps=warps) for g in groups],
            warmup=warmup,
            reps=reps,
        )
    out["grouped_ms_by_num_warps"] = sweep
    # x / scale through the tile's reciprocal (the default) against an IEEE division per element: time, and the
    # bytes of every weight of the set compared between the two
    out["grouped_ms_by_division"] = {
        division: _median_cuda(
            lambda division=division: [
                launch_blockwise_grouped(g, 128, 128, "fp32", division=division) for g in groups
            ],
            warmup=warmup,
            reps=reps,
        )
        for division in ("reciprocal", "rn", "reciprocal_noselect")
    }
    same = True
    for g in groups:
        launch_blockwise_grouped(g, 128, 128, "fp32", division="rn")
        ref = [(it.q.view(torch.uint8).clone(), it.scales.clone()) for it in g]
        for division in ("reciprocal", "reciprocal_noselect"):
            launch_blockwise_grouped(g, 128, 128, "fp32", division=division)
            same = same and all(_same_bytes((it.q, it.scales), r) for it, r in zip(g, ref, strict=True))
        del ref
    out["grouped_divisions_same_bytes"] = same

    # without the clamp to +-448 (two instructions per element fewer, the same codes for finite tiles), at each
    # num_warps: the kernel is ALU-bound (ncu, docs/gpu.md), so this is the next thing to measure
    # and "lean": no clamp and the select-free division (four instructions per element fewer; the refit's setting);
    # from it, the amax from bit patterns (two integer ops per element for four) and unmasked loads and stores
    # (every tile of the 8B set is whole), each and both
    def timed(warps: int, options: dict) -> float | str:
        try:  # a variant that does not compile on this Triton is reported, and the rest of the run kept
            return _median_cuda(
                lambda: [launch_blockwise_grouped(g, 128, 128, "fp32", num_warps=warps, **options) for g in groups],
                warmup=warmup,
                reps=reps,
            )
        except Exception as exc:
            return f"failed: {type(exc).__name__}: {exc}"[:300]

    for variant, options in LEAN_VARIANTS.items():
        out[f"grouped_ms_{variant}_by_num_warps"] = {str(warps): timed(warps, options) for warps in (4, 8, 16)}
        same = True
        for g in groups:
            launch_blockwise_grouped(g, 128, 128, "fp32")
            ref = [(it.q.view(torch.uint8).clone(), it.scales.clone()) for it in g]
            try:
                launch_blockwise_grouped(g, 128, 128, "fp32", **options)
            except Exception:  # its timings say why
                same = False
                break
            same = same and all(_same_bytes((it.q, it.scales), r) for it, r in zip(g, ref, strict=True))
            del ref
        out[f"grouped_{variant}_same_bytes"] = same
    out["grouped_best"] = best_grouped_setting(out)
    all_grouped()
    out["grouped_bytes_equal_per_weight"] = all(
        _same_bytes((it.q, it.scales), triton_kernels.launch_blockwise(it.x3, 128, 128, "fp32")[:2])
        for it in items[:: max(1, len(items) // 16)]
    )
    out["triton_api_ms"] = _median_cuda(lambda: all_api("triton"), warmup=1, reps=max(3, reps // 4))
    out["triton_api_defer_ms"] = _median_cuda(lambda: all_api("triton", "defer"), warmup=1, reps=max(3, reps // 4))
    torchao = _torchao_blockwise()
    if torchao is not None:
        try:
            out["torchao_ms"] = _median_cuda(lambda: [torchao(w) for w in weights], warmup=1, reps=max(3, reps // 4))
        except Exception as exc:  # another torchao version: say so, keep the run
            out["torchao_ms"] = f"failed: {type(exc).__name__}: {exc}"[:200]
    out["torch_ms"] = _median_cuda(lambda: all_api("torch"), warmup=1, reps=3)
    out["torch_gbs"] = _gbs(nbytes, out["torch_ms"])
    return out


# ------------------------------------------------------------------ CPU


def bench_shape_cpu(shape: tuple[int, int], *, reps: int, reference: bool) -> dict:
    row = _empty_row(shape)
    x = torch.randn(shape, dtype=DTYPE)
    ours = quantize_blockwise(x, backend="torch")  # also warms up
    row["torch_ms"] = _median_cpu(lambda: quantize_blockwise(x, backend="torch"), reps)
    row["torch_gbs"] = _gbs(row["bytes_moved"], row["torch_ms"])
    naive = quantize_blockwise_naive(x)  # warm-up, and its bytes
    row["naive_ms"] = _median_cpu(lambda: quantize_blockwise_naive(x), reps)
    row["speedup_vs_naive"] = row["naive_ms"] / row["torch_ms"]
    row["bytes_equal_naive"] = _same_bytes(ours, naive)
    if reference:
        t0 = time.perf_counter()
        ref = quantize_blockwise_reference(x)
        row["reference_ms"] = (time.perf_counter() - t0) * 1e3
        row["speedup_vs_reference"] = row["reference_ms"] / row["torch_ms"]
        row["bytes_equal_reference"] = _same_bytes(ours, ref)
    return row


def bench_layer_set_cpu(layer: tuple, layers: int, *, reps: int) -> dict:
    weights = [torch.randn(shape, dtype=DTYPE) for _ in range(layers) for _, shape in layer]
    nbytes = sum(bytes_moved(tuple(w.shape)) for w in weights)
    out = _layer_set_header(layer, layers, weights, nbytes)

    def run():
        for w in weights:
            quantize_blockwise(w, backend="torch")

    out["torch_ms"] = _median_cpu(run, reps)
    out["torch_gbs"] = _gbs(nbytes, out["torch_ms"])
    return out


def _layer_set_header(layer: tuple, layers: int, weights: list[torch.Tensor], nbytes: int) -> dict:
    return {
        "model": "Llama-3.1-8B weight shapes, random bf16 data",
        "per_layer": {name: list(shape) for name, shape in layer},
        "layers": layers,
        "layers_full_model": LLAMA_8B_LAYERS,
        "matrices": len(weights),
        "elements": sum(w.numel() for w in weights),
        "bytes_moved": nbytes,
        "torch_ms": None,
        "torch_gbs": None,
        "triton_ms": None,
        "triton_gbs": None,
        "pct_of_copy": None,
        "triton_api_ms": None,
    }


# ------------------------------------------------------------------ driver


def _versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # not installed, or broken: report it, do not fail the benchmark
        triton_version = None
    return {
        "torch_version": torch.__version__,
        "triton_version": triton_version,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
    }


def run(args: argparse.Namespace) -> dict:
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here")
    if use_cuda:
        from megatron_fp8.quant import triton_kernels

        if not triton_kernels.available():
            raise SystemExit("CUDA is up but Triton does not import: install triton or run with --device cpu")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    layer = SMOKE_LAYER if args.smoke else LLAMA_8B_LAYER
    layers = args.layers if args.layers is not None else (2 if args.smoke else (LLAMA_8B_LAYERS if use_cuda else 1))
    result: dict = {
        "schema": 1,
        "mode": "cuda" if use_cuda else "cpu",
        "device": torch.cuda.get_device_name() if use_cuda else (platform.processor() or platform.machine()),
        "cpu_threads": torch.get_num_threads(),
        **_versions(),
        "dtype": str(DTYPE).removeprefix("torch."),
        "block_size": [128, 128],
        "scale_format": "fp32",
        "smoke": bool(args.smoke),
        "target_pct_of_copy": TARGET_PCT_OF_COPY,
        "copy_bandwidth_gbs": None,
        "shapes": [],
        "layer_set": None,
        "notes": [],
    }
    if use_cuda:
        copy_gbs = copy_bandwidth_gbs(COPY_BUFFER_BYTES, warmup=args.warmup, reps=args.reps)
        result["copy_bandwidth_gbs"] = copy_gbs
        for shape in shapes:
            result["shapes"].append(
                bench_shape_cuda(shape, copy_gbs, warmup=args.warmup, reps=args.reps, sweep=args.sweep)
            )
        result["layer_set"] = bench_layer_set_cuda(layer, layers, copy_gbs, warmup=args.warmup, reps=args.reps)
        result["notes"].append(
            "triton_ms: kernel only (launch_blockwise, no non-finite check); triton_api_ms: quantize_blockwise "
            "(kernel + amax check, one host sync per call); triton_api_defer_ms: the same with nonfinite='defer' "
            "(no host sync); torchao_ms: torchao's plain Triton blockwise weight kernel where torchao is installed; "
            "torch_ms: the torch path on the GPU."
        )
    else:
        reps = args.reps if args.reps_given else (1 if args.smoke else 3)
        for shape in shapes:
            result["shapes"].append(bench_shape_cpu(shape, reps=reps, reference=not args.no_reference))
        result["layer_set"] = bench_layer_set_cpu(layer, layers, reps=reps)
        result["notes"].append(
            f"CPU run ({torch.get_num_threads()} threads): our torch path vs the naive permute-based float32 "
            f"baseline (speedup), and the float64 reference (bytes); "
            f"layer set with {layers} of {LLAMA_8B_LAYERS} layers (--layers N for more). No Triton figures without CUDA."
        )
    return result


def _fmt(v: object, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    cuda = result["mode"] == "cuda"
    title = f"blockwise 128x128 FP8 cast of bf16 weights on {result['device']}"
    if cuda:
        title += f" (copy bandwidth {result['copy_bandwidth_gbs']:.0f} GB/s)"
    table = Table(title=title)
    table.add_column("shape")
    table.add_column("MB moved", justify="right")
    if cuda:
        cols = [("triton ms", "triton_ms", ".4f"), ("triton GB/s", "triton_gbs", ".0f"),
                ("% of copy", "pct_of_copy", ".1f"), ("API ms", "triton_api_ms", ".4f"),
                ("API defer ms", "triton_api_defer_ms", ".4f"), ("torchao ms", "torchao_ms", ".4f"),
                ("torch ms", "torch_ms", ".3f"), ("torch GB/s", "torch_gbs", ".0f"),
                ("same bytes", "bytes_equal_torch", "")]  # fmt: skip
    else:
        cols = [("ours ms", "torch_ms", ".1f"), ("ours GB/s", "torch_gbs", ".2f"),
                ("naive fp32 ms", "naive_ms", ".1f"), ("speedup", "speedup_vs_naive", ".1f"),
                ("= naive", "bytes_equal_naive", ""), ("f64 ref ms", "reference_ms", ".0f"),
                ("= f64 ref", "bytes_equal_reference", "")]  # fmt: skip
    for header, _, _ in cols:
        table.add_column(header, justify="right")
    rows = [(("x".join(str(d) for d in r["shape"])), r) for r in result["shapes"]]
    ls = result["layer_set"]
    if ls:
        rows.append((f"Llama-8B {ls['layers']}/{ls['layers_full_model']}L", ls))
        if cuda and "grouped_ms" in ls:
            grouped = {**ls, "triton_ms": ls["grouped_ms"], "triton_gbs": ls["grouped_gbs"],
                       "pct_of_copy": ls["grouped_pct_of_copy"], "triton_api_ms": None, "triton_api_defer_ms": None,
                       "torchao_ms": None, "torch_ms": None, "torch_gbs": None,
                       "bytes_equal_torch": ls["grouped_bytes_equal_per_weight"]}  # fmt: skip
            rows.append((f"  grouped: {ls['grouped_launches']} launches", grouped))
    for label, r in rows:
        table.add_row(label, f"{r['bytes_moved'] / 1e6:.1f}", *(_fmt(r.get(key), spec) for _, key, spec in cols))
    Console(width=max(Console().width, 140)).print(table)
    if ls and cuda and "grouped_ms_by_division" in ls:
        by = ls["grouped_ms_by_division"]
        Console().print(
            f"grouped, x / scale: reciprocal + fma {by['reciprocal']:.3f} ms (select-free "
            f"{by['reciprocal_noselect']:.3f} ms), IEEE division {by['rn']:.3f} ms "
            f"({by['rn'] / by['reciprocal']:.2f}x), same bytes on every weight: "
            f"{'yes' if ls['grouped_divisions_same_bytes'] else 'NO'}; by num_warps: {ls['grouped_ms_by_num_warps']}"
        )
        for variant, options in LEAN_VARIANTS.items():
            Console().print(
                f"grouped {variant} ({options}), by num_warps: {ls[f'grouped_ms_{variant}_by_num_warps']}, same bytes "
                f"on every weight: {'yes' if ls[f'grouped_{variant}_same_bytes'] else 'NO'}"
            )
    best = ls.get("grouped_best") if ls else None
    if best:
        refit = best["refit"] or {}
        Console().print(
            f"fastest same-bytes grouped setting: {best['variant']} at {best['num_warps']} warps, {best['ms']:.3f} ms "
            f"({best['pct_of_copy']:.1f}% of copy); the refit's ({refit.get('variant')}, {refit.get('num_warps')} "
            f"warps): {_fmt(refit.get('ms'), '.3f')} ms; to use it, set INTO_BUCKET_* in "
            "megatron_fp8/quant/triton_grouped.py to its options"
        )
    for r in result["shapes"]:
        if r.get("best_config"):
            Console().print(f"best config for {r['shape']}: {r['best_config']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/quant.json"), help="JSON output path")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one rep: checks the script runs")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers of the Llama-3.1-8B set (default 32 on CUDA, 1 on CPU, 2 with --smoke)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed repetitions (median); default 20 on CUDA, 3 on CPU (the CPU reference runs once)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sweep", action="store_true", help="CUDA: also try cols_per_program x num_warps per shape")
    p.add_argument("--no-reference", action="store_true", help="CPU: skip the (slow) float64 reference")
    args = p.parse_args(argv)
    args.reps_given = args.reps is not None
    if args.reps is None:
        args.reps = 1 if args.smoke else 20
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
