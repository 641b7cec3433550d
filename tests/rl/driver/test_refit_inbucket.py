"""The GRPO refit stream quantizes each FP8 weight straight into its bucket: same wire, the op budget, NaN refused.

``colocated.refit_stream`` is what ``refit_phase`` hands the arm's refit target (colocated or remote: both pack with
``RefitSender``). Here it runs over the tiny model's checkpoint as a CPU (float32) trainer exports it, so the test
needs no Megatron model; the BF16-trainer branch (``refit_stream(in_bucket=True)`` through the bridge adapter) is
checked against the eager export in ``tests/bridge_mappings/test_quantized_export.py``.

Op budget (counted on CPU by :class:`OpCounter`; on a GPU each compute op is a kernel launch, each host read a sync):
the FP8 sender issues at most 8 compute ops per bucket more than the BF16 sender of the same weights, and each side
reads the host at most once per bucket.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from bridge_mappings.manifest import Fingerprint, Manifest
from bridge_mappings.quantized_export import ExportSettings, checked_stream, quantized_stream
from megatron_fp8.errors import NonFiniteError
from megatron_fp8.models import tiny_model_path
from megatron_fp8.refit import DictApplier, InProcTransport, RefitReceiver, RefitSender
from megatron_fp8.refit.buckets import pack_buckets
from megatron_fp8.refit.inbucket import PendingPart
from megatron_fp8.refit.opcount import OpCounter, OpCounts
from megatron_fp8.rl.driver import colocated

MAX_EXTRA_OPS = 8
BUCKET_BYTES = 256 << 10
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def checkpoint() -> dict[str, torch.Tensor]:
    """The tiny model's weights as a CPU trainer holds them (float32)."""
    return {n: t.float() for n, t in load_file(str(tiny_model_path("tiny") / "model.safetensors")).items()}


def _manifest(weights: dict[str, torch.Tensor]) -> Manifest:
    fp8 = {n for n in weights if any(f".{p}.weight" in n for p in LINEARS)}
    fp = Fingerprint("x", "0", "{}", 0, 0)
    return Manifest("test", fp, tuple(sorted(fp8)), tuple(sorted(set(weights) - fp8)), (), {})


def _state(weights, precision: str, monkeypatch, *, scale_format: str = "fp32"):
    """An arm state with only what ``refit_stream`` reads; the export answers ``weights`` as parameters (they
    require grad, as a trainer's do)."""
    params = {n: t.detach().clone().requires_grad_(True) for n, t in weights.items()}

    def export(model, *, cpu=True):
        assert cpu, "a CPU trainer's export goes to the host"
        return iter(list(params.items()))

    monkeypatch.setattr(colocated, "export_hf_weights", export)
    return SimpleNamespace(
        spec=SimpleNamespace(name=precision, rollout_precision=precision),
        manifest=_manifest(weights),
        export_settings=ExportSettings(scale_format=scale_format),
        kv_recorder=None,
        model=SimpleNamespace(model=[torch.nn.Linear(2, 2)]),  # float32 parameters: the CPU trainer's branch
        refit=SimpleNamespace(stream_on_device=True),  # a colocated vLLM engine (the stream stays on a GPU trainer's)
    )


def _wire(buckets):
    return [(b.index, b.is_last, b.metas, b.checksum, b.payload.clone(), b.trailer) for b in buckets]


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
@pytest.mark.parametrize("bucket_bytes", [64 << 20, 48 << 10, 1000], ids=["one", "48KiB", "1000B"])
def test_the_grpo_fp8_stream_quantizes_in_the_bucket_with_the_wire_of_the_eager_export(
    checkpoint, monkeypatch, bucket_bytes, scale_format
):
    state = _state(checkpoint, "fp8", monkeypatch, scale_format=scale_format)
    items = list(colocated.refit_stream(state))
    pending = {n for n, t in items if isinstance(t, PendingPart)}
    fp8 = state.manifest.fp8_set
    assert pending == fp8 | {n + "_scale_inv" for n in fp8}
    bf16 = colocated.rollout_dtype_stream(checkpoint.items())
    eager = checked_stream(
        quantized_stream(bf16, state.manifest, state.export_settings, nonfinite="defer"), state.manifest
    )
    want = _wire(pack_buckets(eager, version=4, bucket_bytes=bucket_bytes, stream_id=9))
    got = _wire(pack_buckets(colocated.refit_stream(state), version=4, bucket_bytes=bucket_bytes, stream_id=9))
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        assert a[:4] == b[:4] and a[5] == b[5], f"bucket {a[0]}: metadata or checksum differ"
        assert torch.equal(a[4], b[4]), f"bucket {a[0]}: payload bytes differ"


def _refit_counts(stream, targets) -> tuple[int, OpCounts, OpCounts]:
    """One refit over an in-process transport, ops counted on each side's thread (buckets of BUCKET_BYTES)."""
    transport = InProcTransport(timeout=60)
    sender = RefitSender(transport, bucket_bytes=BUCKET_BYTES, timeout=60)
    receiver = RefitReceiver(transport, apply=DictApplier(targets), timeout=60)
    box: dict[str, object] = {}

    def receive() -> None:
        try:
            with OpCounter() as c:
                receiver.receive(timeout=60)
            box["counts"] = c.counts
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=receive)
    thread.start()
    with OpCounter() as c:
        report = sender.send(stream, version=1)
    thread.join(60)
    transport.close()
    assert "error" not in box, box.get("error")
    return report.num_buckets, c.counts, box["counts"]  # type: ignore[return-value]


def test_the_grpo_fp8_refit_costs_at_most_8_ops_per_bucket_more_than_bf16_and_one_host_read(checkpoint, monkeypatch):
    runs = {}
    for precision in ("bf16", "bf16", "fp8", "fp8"):  # the first of each warms per-process caches
        state = _state(checkpoint, precision, monkeypatch)
        targets = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in colocated.refit_stream(state)}
        runs[precision] = (*_refit_counts(colocated.refit_stream(state), targets), targets)
    nb_bf16, snd_bf16, rcv_bf16, _ = runs["bf16"]
    nb_fp8, snd_fp8, rcv_fp8, held = runs["fp8"]
    assert nb_fp8 >= 4 and nb_bf16 >= 4
    per_bucket_bf16, per_bucket_fp8 = snd_bf16.num_compute / nb_bf16, snd_fp8.num_compute / nb_fp8
    assert per_bucket_fp8 <= per_bucket_bf16 + MAX_EXTRA_OPS, (per_bucket_fp8, per_bucket_bf16, dict(snd_fp8.compute))
    for (nb, side), what in zip(
        [(nb_bf16, snd_bf16), (nb_bf16, rcv_bf16), (nb_fp8, snd_fp8), (nb_fp8, rcv_fp8)],
        ["bf16 sender", "bf16 receiver", "fp8 sender", "fp8 receiver"],
        strict=True,
    ):
        assert side.num_host_reads <= nb, (what, nb, dict(side.host_reads))
    state = _state(checkpoint, "fp8", monkeypatch)
    eager = dict(
        quantized_stream(colocated.rollout_dtype_stream(checkpoint.items()), state.manifest, nonfinite="defer")
    )
    assert set(held) == set(eager)
    for name, t in eager.items():
        assert torch.equal(held[name].view(torch.uint8), t.view(torch.uint8)), name


def test_a_nan_in_a_grpo_fp8_weight_is_refused_naming_it(checkpoint, monkeypatch):
    bad = dict(checkpoint)
    name = "model.layers.2.mlp.up_proj.weight"
    bad[name] = bad[name].clone()
    bad[name][300, 7] = float("nan")
    state = _state(bad, "fp8", monkeypatch)
    with pytest.raises(NonFiniteError, match=rf"'{name}' of version 5 .*first at index \(300, 7\)"):
        list(pack_buckets(colocated.refit_stream(state), version=5, bucket_bytes=48 << 10))


class _GpuParameter:
    """What ``refit_stream`` reads of a GPU trainer's first parameter (no GPU here)."""

    is_cuda = True
    dtype = torch.bfloat16


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("on_device", [True, False], ids=["vllm-colocated", "host-target"])
def test_a_gpu_trainer_exports_on_its_gpu_exactly_when_the_target_takes_a_device_stream(
    monkeypatch, precision, on_device
):
    """The BF16 export and the FP8 refit stream are asked for host tensors only when the target wants them."""
    asked: list[bool] = []

    def export(model, *, cpu=True):
        asked.append(cpu)
        return iter(())

    def stream(model, manifest, settings, *, in_bucket, cpu=True):
        assert in_bucket
        asked.append(cpu)
        return iter(())

    monkeypatch.setattr(colocated, "export_hf_weights", export)
    monkeypatch.setattr(colocated, "bridge_refit_stream", stream)
    state = SimpleNamespace(
        spec=SimpleNamespace(name=precision, rollout_precision=precision),
        manifest=_manifest({"model.layers.0.mlp.up_proj.weight": torch.zeros(1)}),
        export_settings=ExportSettings(),
        kv_recorder=None,
        model=SimpleNamespace(model=[SimpleNamespace(parameters=lambda: iter([_GpuParameter()]))]),
        refit=SimpleNamespace(stream_on_device=on_device),
    )
    list(colocated.refit_stream(state))
    assert asked == [not on_device]
    assert colocated.exports_to_host(state.model, stream_on_device=on_device) is (not on_device)
    route = colocated.refit_route(state.model, stream_on_device=on_device)  # what the run's log says
    assert ("stays on the trainer's GPU" in route) is on_device


def test_which_targets_take_a_device_stream():
    """vLLM's applier keeps the version on its worker's device (the receiver stages there for it: the host for a CPU
    engine, the GPU for a colocated one), also behind the sleep schedule: its colocated target takes the stream on the
    GPU; the reference engine's applier and the separate rollout ranks' link take host tensors."""
    from megatron_fp8.rl.cluster.remote import RemoteRollout
    from megatron_fp8.rollout.reference.applier import ReferenceEngineApplier
    from megatron_fp8.rollout.sleep import ColocatedSleep, RecordingSleepControl
    from megatron_fp8.rollout.vllm.applier import VllmApplier

    vllm = object.__new__(VllmApplier)  # building one needs an engine (tests/rollout/vllm): its worker's device set
    vllm._staging = torch.device("cpu")
    slept = ColocatedSleep(control=RecordingSleepControl(), applier=vllm, level=2, kv_scales=None).applier
    reference = object.__new__(ReferenceEngineApplier)
    assert RemoteRollout.stream_on_device is False
    for applier, on_device in ((vllm, True), (slept, True), (reference, False)):
        target = colocated.ColocatedTarget(SimpleNamespace(applier=applier), bucket_bytes=1 << 20, timeout=1.0)
        try:
            assert target.stream_on_device is on_device, applier
            assert target.staging == ("host" if on_device else "copy")
            assert target._refit.receiver.applier is applier and target._refit.transport._queue.maxsize == 1
        finally:
            target.close()
    vllm._staging = torch.device("cuda", 0)  # an engine worker on the trainer's GPU, in this process
    target = colocated.ColocatedTarget(SimpleNamespace(applier=slept), bucket_bytes=1 << 20, timeout=1.0)
    try:
        assert target.stream_on_device and target.staging == "device" and target.shard_plan is None
    finally:
        target.close()
