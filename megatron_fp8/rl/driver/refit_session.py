"""Refit a rollout engine from a Megatron model: FP8 vs BF16 payload, time and error.

What ``megatron-fp8 refit`` runs. The trainer side is a real Megatron-Core model
built through Megatron-Bridge; the stream is the HF-named export, quantized to
FP8 for exactly the names in vLLM's manifest; the transport is in-process or a
real ``torch.distributed`` gloo group with the engine in another process. On CPU
the engine is the reference FP8 engine (an emulator and oracle of vLLM's W8A8
blockwise numerics, not a serving engine): vLLM's FP8 kernels need CUDA.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import logging
import multiprocessing as mp
import statistics
import time
from collections.abc import Iterable, Iterator
from multiprocessing.queues import Queue
from pathlib import Path

import torch
import torch.distributed as dist

from bridge_mappings.manifest import Manifest
from bridge_mappings.quantized_export import checked_stream, quantized_stream, refit_stream
from megatron_fp8.errors import RefitError
from megatron_fp8.megatron import MegatronModel, export_hf_weights
from megatron_fp8.quant import dequantize_blockwise
from megatron_fp8.refit import RefitReceiver, RefitSender, TorchDistTransport
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.rollout.reference.applier import ReferenceEngineApplier
from megatron_fp8.rollout.reference.engine import ReferenceFP8Engine
from megatron_fp8.vocab import SCALE_SUFFIX

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RefitRun:
    """One precision's refits of the same parameters over one transport.

    Attributes:
        precision: ``"fp8"`` or ``"bf16"``.
        transport: ``"inproc"`` or ``"gloo"``.
        versions: refit versions applied.
        payload_bytes: bytes on the wire per class of the last refit (fp8 / scales / bf16 / other).
        manifest_param_bytes: bytes of the manifest's parameters (FP8 + scales, or BF16).
        seconds: median wall time of one refit (export + quantize + send + apply + verify).
        verified: every refit passed the engine-side read-back.
        max_rel_weight_error: max over manifest params of ||engine - trainer|| / ||trainer||.
        generated: token ids greedily generated after the last refit.
    """

    precision: str
    transport: str
    versions: tuple[int, ...]
    payload_bytes: dict[str, int]
    manifest_param_bytes: int
    seconds: float
    verified: bool
    max_rel_weight_error: float
    generated: tuple[int, ...]


def _counting(
    stream: Iterable[tuple[str, torch.Tensor]], names: frozenset[str], box: dict[str, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    box["bytes"] = 0
    for name, t in stream:
        base = name.removesuffix(SCALE_SUFFIX)
        if base in names:
            box["bytes"] += t.numel() * t.element_size()
        yield name, t


def _max_rel_error(held: dict[str, torch.Tensor], trainer: dict[str, torch.Tensor], names: Iterable[str]) -> float:
    worst = 0.0
    for name in names:
        h = held[name]
        if h.dtype == torch.float8_e4m3fn:
            h = dequantize_blockwise(h, held[name + SCALE_SUFFIX])
        ref = trainer[name].float()
        ref = ref.detach()
        worst = max(worst, float((h.detach().float() - ref).norm()) / max(float(ref.norm()), 1e-30))
    return worst


def _make_engine(model_path: Path, precision: str, qcfg: dict | None, fp8_names: tuple[str, ...]) -> ReferenceFP8Engine:
    if precision == "fp8":
        return ReferenceFP8Engine.from_hf_checkpoint(model_path, quantization=qcfg, fp8_names=fp8_names)
    return ReferenceFP8Engine.from_hf_checkpoint(model_path, quantization=None)


@dataclasses.dataclass(frozen=True)
class _ReceiverArgs:
    """What the spawned rollout process of ``--transport gloo`` needs (pickled to it)."""

    store_port: int
    model_path: str
    precision: str
    qcfg: dict | None
    fp8_names: tuple[str, ...]
    timeout: float
    repeats: int
    prompt: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _ReceiverResult:
    """What the rollout process sends back (pickled through the queue).

    Attributes:
        error: ``"Type: message"`` of the failure, ``""`` on success.
        verified: every refit passed the engine-side read-back.
        generated: token ids greedily generated after the last refit.
        held: ``torch.save`` bytes of the engine's FP8 weights and scales after the last refit.
    """

    error: str = ""
    verified: bool = False
    generated: tuple[int, ...] = ()
    held: bytes = b""


def _receiver_main(args: _ReceiverArgs, queue: Queue[_ReceiverResult]) -> None:
    """Rollout process for ``--transport gloo``: receive refits into a reference engine."""
    try:
        timeout = datetime.timedelta(seconds=args.timeout)
        store = dist.TCPStore("127.0.0.1", args.store_port, 2, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timeout)
        engine = _make_engine(Path(args.model_path), args.precision, args.qcfg, args.fp8_names)
        applier = ReferenceEngineApplier(engine)
        receiver = RefitReceiver(TorchDistTransport(src=0, timeout=args.timeout), apply=applier, timeout=args.timeout)
        verified = []
        for _ in range(args.repeats):
            report = receiver.receive(first_timeout=args.timeout)
            verified.append(applier.last_verify is not None and applier.last_verify.version == report.version)
        gen = engine.generate([list(args.prompt)], max_new_tokens=8)
        fp8_names = set(args.fp8_names)
        held = {n: t.clone() for n, t in engine.named_weights() if n in fp8_names or n.endswith(SCALE_SUFFIX)}
        buf = io.BytesIO()
        torch.save(held, buf)  # plain bytes: tensors shared by file descriptor die with this process
        queue.put(_ReceiverResult(verified=all(verified), generated=tuple(gen.token_ids[0]), held=buf.getvalue()))
    except BaseException as exc:  # reported to the trainer process
        queue.put(_ReceiverResult(error=f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_refits(
    m: MegatronModel,
    model_path: Path,
    manifest: Manifest,
    *,
    precision: str,
    repeats: int = 3,
    prompt: tuple[int, ...] = (1, 2, 3, 4),
    timeout: float = 120.0,
) -> RefitRun:
    """Refit an in-process engine ``repeats`` times from the Megatron model ``m`` and measure.

    Timed per refit: the Megatron-Bridge export, quantization (FP8), packing, transfer and the
    engine's apply + read-back verification.

    Args:
        m: a built :class:`~megatron_fp8.megatron.MegatronModel` (trainer side).
        model_path: its HF checkpoint (to build the engine).
        manifest: vLLM's FP8 manifest (:class:`bridge_mappings.manifest.Manifest`).
        precision: ``"fp8"`` (quantize before transfer) or ``"bf16"`` (same params in BF16).
        repeats: refits to time (the median is reported).
        prompt: token ids greedily continued after the last refit.
        timeout: seconds any single refit wait may take.
    """
    names = manifest.fp8_set
    box: dict[str, int] = {}
    engine = _make_engine(model_path, precision, manifest.quantization_config, manifest.fp8_params)
    applier = ReferenceEngineApplier(engine)
    session = ColocatedRefit(applier, timeout=timeout)
    times, versions, verified = [], [], []
    try:
        for _ in range(repeats):
            src = refit_stream(m, manifest, in_bucket=True) if precision == "fp8" else export_hf_weights(m)
            result = session.refit(_counting(src, names, box))
            times.append(result.seconds)
            versions.append(result.version)
            verified.append(applier.last_verify is not None and applier.last_verify.version == result.version)
    finally:
        session.close()
    trainer = {n: t for n, t in export_hf_weights(m) if n in names}
    return RefitRun(
        precision,
        "inproc",
        tuple(versions),
        dict(result.send.payload_bytes),
        box["bytes"],
        statistics.median(times),
        all(verified),
        _max_rel_error(dict(engine.named_weights()), trainer, names),
        tuple(engine.generate([list(prompt)], max_new_tokens=8).token_ids[0]),
    )


def run_refits_over_gloo(
    weights: dict[str, torch.Tensor],
    model_path: Path,
    manifest: Manifest,
    *,
    precision: str,
    repeats: int,
    prompt: tuple[int, ...],
    timeout: float,
) -> RefitRun:
    """Refit a reference engine in a second process over a real 2-process gloo group.

    ``weights`` is the trainer's BF16 HF-named export, taken beforehand (Megatron owns this
    process's default group while the model exists).

    Timed per refit: quantization (FP8), packing, broadcast and the receiver's apply + verify.

    Raises:
        RefitError: the rollout process failed (its error is in the message).
    """
    names = manifest.fp8_set
    box: dict[str, int] = {}

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        if precision == "fp8":
            src = checked_stream(quantized_stream(weights.items(), manifest, in_bucket=True), manifest)
        else:
            src = iter(weights.items())
        return _counting(src, names, box)

    ctx = mp.get_context("spawn")
    queue: Queue[_ReceiverResult] = ctx.Queue()
    if dist.is_initialized():
        raise RefitError("--transport gloo needs its own process group; run it outside another torch.distributed job")
    # the trainer binds the rendezvous port itself (0: the OS picks one, no probe another process could race)
    store = dist.TCPStore(
        "127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )
    receiver_args = _ReceiverArgs(
        store_port=store.port,
        model_path=str(model_path),
        precision=precision,
        qcfg=manifest.quantization_config,
        fp8_names=tuple(manifest.fp8_params),
        timeout=timeout,
        repeats=repeats,
        prompt=tuple(prompt),
    )
    child = ctx.Process(target=_receiver_main, args=(receiver_args, queue), daemon=True)
    child.start()
    times: list[float] = []
    pg = None
    try:
        pg = _init_pair(store, timeout)
        sender = RefitSender(TorchDistTransport(src=0, timeout=timeout), timeout=timeout)
        for v in range(1, repeats + 1):
            start = time.perf_counter()
            report = sender.send(stream(), version=v)
            times.append(time.perf_counter() - start)
        payload = dict(report.payload_bytes)
        result = queue.get(timeout=timeout)
    finally:
        child.join(timeout)
        if child.is_alive():
            child.kill()
        _close_pair(pg)
    if result.error:
        raise RefitError(f"rollout process (rank 1) failed: {result.error}")
    trainer = {n: t for n, t in weights.items() if n in names}
    held = torch.load(io.BytesIO(result.held), weights_only=True)
    return RefitRun(
        precision,
        "gloo",
        tuple(range(1, repeats + 1)),
        payload,
        box["bytes"],
        statistics.median(times),
        result.verified,
        _max_rel_error(held, trainer, names),
        result.generated,
    )


def _init_pair(store: dist.Store, timeout: float) -> dist.ProcessGroup | None:
    """Join the trainer (rank 0) to the 2-process gloo group of the store it hosts."""
    dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=datetime.timedelta(seconds=timeout))
    return dist.group.WORLD


def _close_pair(pg: dist.ProcessGroup | None) -> None:
    if pg is not None and dist.is_initialized():
        dist.destroy_process_group()
