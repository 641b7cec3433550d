"""The colocated sleep / wake schedule (``rollout.sleep``) on the CPU reference engine with the recording control.

The order is generate -> sleep -> wake_up(weights) -> refit -> wake_up(kv_cache) -> KV scales rewritten and read
back -> generate. A lossy control plays vLLM 0.11's level 2 on the reference engine: waking the weights leaves them
garbage (NaN), waking the KV cache leaves the KV scales garbage (0.11 keeps them in plain device tensors that level 2
drops: vllm-project/vllm#25800). The schedule must serve exactly what an engine that never slept serves; every failure
(a refit refused while asleep, a refit failing after wake_up(weights), a failing wake-up, a KV scale that does not
read back) leaves it not serving, and a later clean refit brings it back.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from bridge_mappings.manifest import Fingerprint, Manifest
from bridge_mappings.quantized_export import quantized_stream
from megatron_fp8.errors import ConfigError, EngineNotServingError, RefitError
from megatron_fp8.models import tiny_model_path
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.rollout.engines import ReferenceRolloutEngine
from megatron_fp8.rollout.sleep import (
    ColocatedSleep,
    RecordingSleepControl,
    ReferenceKvScales,
    SleepCall,
    sleep_level_for,
)
from megatron_fp8.vocab import kv_scale_name

QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
PROMPTS = [[5, 17, 33, 40, 2], [7, 9, 11]]
ARGS = dict(max_new_tokens=6, temperature=0.0, seed=0, eos_token_id=-1)


class LossyControl(RecordingSleepControl):
    """vLLM 0.11's level 2 on the reference engine: the woken weights and KV scales hold garbage."""

    def __init__(self, engine, events):
        super().__init__()
        self.engine, self.events, self.level, self.fail_on = engine, events, 0, None

    def sleep(self, level=1):
        super().sleep(level)
        self.events.append(f"sleep:{level}")
        self.level = level

    def wake_up(self, tags=None):
        super().wake_up(tags)
        self.events.append(f"wake_up:{','.join(tags)}")
        if self.fail_on in tags:
            raise RuntimeError(f"cuMemMap failed for {self.fail_on}")
        store = self.engine.weights
        if self.level == 2:
            kv = set(store.kv_scale_names)
            for name, t in store.tensors.items():
                if (name in kv) == ("kv_cache" in tags) and (name in kv or "weights" in tags):
                    (t.view(torch.uint8).fill_(0x7F) if t.element_size() == 1 else t.fill_(float("nan")))
            store._f64.clear()


class LoggingApplier:
    def __init__(self, inner, events):
        self.inner, self.events = inner, events

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def serving(self):
        return self.inner.serving

    @property
    def kv_cache_asleep(self):  # as vLLM's applier: no prefix-cache probe while the KV cache sleeps
        return self.events[-1] == "kv_asleep:True"

    @kv_cache_asleep.setter
    def kv_cache_asleep(self, value):
        self.events.append(f"kv_asleep:{value}")

    def begin(self, version, metas):
        self.events.append("begin")
        self.inner.begin(version, metas)

    def stage(self, name, tensor):
        self.inner.stage(name, tensor)

    def commit(self, version):
        self.inner.commit(version)
        self.events.append("commit")

    def abort(self, version, reason):
        self.events.append("abort")
        self.inner.abort(version, reason)


class LoggingKv(ReferenceKvScales):
    def __init__(self, engine, events, drop=None):
        super().__init__(engine)
        self.events, self.drop = events, drop

    def write(self, scales):
        self.events.append("kv_write")
        super().write({n: v for n, v in scales.items() if n != self.drop})

    def read(self):
        self.events.append("kv_read")
        return super().read()


def _engine():
    return ReferenceRolloutEngine(
        tiny_model_path("tiny"), quantization_config=QCFG, fp8_names=None, kv_cache_dtype="fp8"
    )


def _manifest(engine, weights):
    fp8 = tuple(sorted(engine.engine.fp8_names))
    return Manifest("t", Fingerprint("x", "0", "{}", 0, 0), fp8, tuple(sorted(set(weights) - set(fp8))), (), QCFG)


def _stream(weights, manifest, *, seed, kv=True):
    g = torch.Generator().manual_seed(seed)
    moved = {n: (t.float() * (1 + 0.05 * torch.randn(t.shape, generator=g))).to(t.dtype) for n, t in weights.items()}
    items = list(quantized_stream(moved.items(), manifest))
    if kv:
        layers = len({n.split(".")[2] for n in weights if n.startswith("model.layers.")})
        items += [
            (kv_scale_name(i, k), torch.tensor(0.01 * (i + 2) + 0.001 * j, dtype=torch.float32))
            for i in range(layers)
            for j, k in enumerate(("q", "k", "v"))
        ]
    return items


@pytest.fixture()
def colocated():
    weights = load_file(str(tiny_model_path("tiny") / "model.safetensors"))
    engine, events = _engine(), []
    schedule = ColocatedSleep(
        control=LossyControl(engine.engine, events),
        applier=LoggingApplier(engine.applier, events),
        level=2,
        kv_scales=LoggingKv(engine.engine, events),
    )
    engine.applier = schedule.applier
    refit = ColocatedRefit(schedule.applier, timeout=30)
    return engine, schedule, refit, events, weights, _manifest(engine, weights)


def _awake_twin(weights, manifest, stream):
    twin = _engine()
    ColocatedRefit(twin.applier, timeout=30).refit(iter(stream))
    return twin.generate(PROMPTS, **ARGS).token_ids


def test_order_and_level_2_losses_are_repaired(colocated):
    engine, schedule, refit, events, weights, manifest = colocated
    engine.generate(PROMPTS, **ARGS)
    schedule.sleep()
    assert schedule.state == "asleep" and not engine.applier.serving
    stream = _stream(weights, manifest, seed=1)
    schedule.refit(lambda: refit.refit(iter(stream)))
    assert events[: events.index("commit") + 1] == [
        "kv_read", "sleep:2", "kv_asleep:True", "wake_up:weights", "begin", "commit"
    ]  # fmt: skip
    assert events[events.index("commit") + 1 :] == ["wake_up:kv_cache", "kv_asleep:False", "kv_write", "kv_read"]
    assert schedule.control.calls == [
        SleepCall("sleep", level=2), SleepCall("wake_up", tags=("weights",)), SleepCall("wake_up", tags=("kv_cache",))
    ]  # fmt: skip
    assert schedule.state == "serving" and engine.applier.serving
    held = ReferenceKvScales(engine.engine).read()
    assert all(torch.equal(held[n], v) for n, v in stream if n in held)  # the per-step scales, not the garbage
    assert engine.generate(PROMPTS, **ARGS).token_ids == _awake_twin(weights, manifest, stream)


def test_torchs_cached_gpu_memory_goes_back_before_the_kv_cache_wakes(colocated, monkeypatch):
    """The staged version and the rollback snapshot, freed by the commit, are released from torch's cache to the
    driver before ``wake_up(["kv_cache"])`` maps the KV cache back (vLLM's own allocator cannot use torch's cache)."""
    engine, schedule, refit, events, weights, manifest = colocated
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    schedule.sleep()
    schedule.refit(lambda: refit.refit(iter(_stream(weights, manifest, seed=2))))
    assert events[events.index("commit") + 1 :][:2] == ["empty_cache", "wake_up:kv_cache"]


def test_a_control_that_gives_nothing_back_leaves_the_prefix_cache_probe_on(colocated):
    engine, _, _, events, weights, manifest = colocated
    plain = _engine()
    logged = LoggingApplier(plain.applier, events)
    schedule = ColocatedSleep(
        control=RecordingSleepControl(), applier=logged, level=2, kv_scales=None, gives_memory_back=False
    )
    schedule.sleep()
    schedule.refit(lambda: ColocatedRefit(schedule.applier, timeout=30).refit(iter(_stream(weights, manifest, seed=9))))
    assert not any(e.startswith("kv_asleep") for e in events) and schedule.state == "serving"


def test_fixed_kv_scales_are_rewritten_when_the_refit_carries_none(colocated):
    engine, schedule, refit, events, weights, manifest = colocated
    fixed = ReferenceKvScales(engine.engine).read()
    schedule.sleep()
    schedule.refit(lambda: refit.refit(iter(_stream(weights, manifest, seed=2, kv=False))))
    held = ReferenceKvScales(engine.engine).read()
    assert all(torch.equal(held[n], fixed[n]) for n in fixed) and schedule.state == "serving"


def test_without_the_kv_rewrite_the_engine_would_serve_garbage(colocated):
    """The lossy control does lose the scales: a schedule with no KV access ends serving NaN scales."""
    engine, _, _, events, weights, manifest = colocated
    plain = _engine()
    blind = ColocatedSleep(control=LossyControl(plain.engine, events), applier=plain.applier, level=2, kv_scales=None)
    blind.sleep()
    blind.refit(lambda: ColocatedRefit(blind.applier, timeout=30).refit(iter(_stream(weights, manifest, seed=1))))
    assert all(torch.isnan(v) for v in ReferenceKvScales(plain.engine).read().values())


def test_refit_refused_while_asleep(colocated):
    engine, schedule, refit, events, weights, manifest = colocated
    schedule.sleep()
    with pytest.raises(RefitError, match=r"refused: the engine is asleep \(level 2\).*wake_up\(\['weights'\]\)"):
        refit.refit(iter(_stream(weights, manifest, seed=1)))
    assert "begin" not in events and schedule.state == "asleep"
    with pytest.raises(EngineNotServingError, match="asleep"):
        engine.generate(PROMPTS, **ARGS)
    stream = _stream(weights, manifest, seed=3)
    schedule.refit(lambda: refit.refit(iter(stream)))
    assert engine.generate(PROMPTS, **ARGS).token_ids == _awake_twin(weights, manifest, stream)


def test_failure_after_wake_up_weights_leaves_it_not_serving_until_a_clean_refit(colocated):
    engine, schedule, refit, events, weights, manifest = colocated
    schedule.sleep()
    bad = _stream(weights, manifest, seed=4)
    name = next(n for n, _ in bad if n.endswith("_scale_inv"))
    bad = [(n, torch.zeros_like(t) if n == name else t) for n, t in bad]
    with pytest.raises(RefitError, match=name):
        schedule.refit(lambda: refit.refit(iter(bad)))
    # the inner applier refused before its first write and would keep serving its version; but those weights were
    # dropped at level 2 and the woken memory holds garbage: the schedule does not serve
    assert schedule.applier.inner.serving and schedule.state == "not_serving"
    assert "wake_up:kv_cache" not in events
    with pytest.raises(EngineNotServingError, match="failed at the refit"):
        engine.generate(PROMPTS, **ARGS)
    with pytest.raises(EngineNotServingError, match="sleep refused"):
        schedule.sleep()
    stream = _stream(weights, manifest, seed=5)
    schedule.refit(lambda: refit.refit(iter(stream)))
    assert events.count("wake_up:weights") == 1
    assert events[-4:] == ["wake_up:kv_cache", "kv_asleep:False", "kv_write", "kv_read"]
    assert engine.generate(PROMPTS, **ARGS).token_ids == _awake_twin(weights, manifest, stream)


def test_failing_kv_wake_up_and_a_kv_scale_that_does_not_read_back(colocated):
    engine, schedule, refit, events, weights, manifest = colocated
    schedule.sleep()
    schedule.control.fail_on = "kv_cache"
    with pytest.raises(RuntimeError, match="cuMemMap failed for kv_cache"):
        schedule.refit(lambda: refit.refit(iter(_stream(weights, manifest, seed=6))))
    assert schedule.state == "not_serving" and not engine.applier.serving
    schedule.control.fail_on = None
    schedule.kv_scales.drop = kv_scale_name(0, "k")  # a write that loses one scale
    with pytest.raises(RefitError, match=r"read back differ.*layers\.0\.self_attn\.attn\.k_scale"):
        schedule.refit(lambda: refit.refit(iter(_stream(weights, manifest, seed=7))))
    assert schedule.state == "not_serving"
    schedule.kv_scales.drop = None
    schedule.refit(lambda: refit.refit(iter(_stream(weights, manifest, seed=8))))
    assert schedule.state == "serving" and engine.generate(PROMPTS, **ARGS).token_ids


def test_sleep_levels_and_the_recording_controls_checks():
    assert sleep_level_for(configured=None, refit_complete=True) == 2
    assert sleep_level_for(configured=None, refit_complete=False) == 1
    assert sleep_level_for(configured=0, refit_complete=True) == 0
    with pytest.raises(ConfigError, match="sleep_level 2 drops the engine's weights"):
        sleep_level_for(configured=2, refit_complete=False)
    with pytest.raises(ConfigError, match="not one of"):
        sleep_level_for(configured=3, refit_complete=True)
    control = RecordingSleepControl()
    with pytest.raises(ValueError, match="not one of vLLM's"):
        control.sleep(level=3)
    with pytest.raises(ValueError, match="not vLLM's"):
        control.wake_up(tags=["weight"])
    control.wake_up()
    assert control.calls == [SleepCall("wake_up", tags=None)]
