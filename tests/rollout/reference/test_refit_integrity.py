"""Refit integrity of the reference FP8 engine's applier: complete by default, validated before the first
write, rolled back on any failure after it, verified byte for byte (issue 11).

Every fault test asserts: refused or rolled back, the named reason, the engine's tensors byte-identical to
the last good version, generation identical, the version counter unchanged, and the next clean version
commits. Faults are planted in a real engine of the embedded tiny model, through the real receiver
(:class:`~megatron_fp8.refit.pipeline.ColocatedRefit`) or, for values the sender itself refuses to send
(NaN), by calling the applier's protocol the way the receiver does.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from safetensors.torch import load_file

from megatron_fp8.errors import RefitError, RefitRolledBackError, WeightStreamError
from megatron_fp8.models import tiny_model_path
from megatron_fp8.quant import quantize_blockwise
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.refit.wire import TensorMeta, dtype_name
from megatron_fp8.rollout.reference.applier import ReferenceEngineApplier
from megatron_fp8.rollout.reference.engine import ReferenceFP8Engine
from megatron_fp8.vocab import SCALE_SUFFIX, kv_scale_name

QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
PROMPT = [[5, 17, 33, 40, 2], [9, 8, 7]]
TARGET = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return load_file(str(tiny_model_path("tiny") / "model.safetensors"))


def _engine(**kw) -> ReferenceFP8Engine:
    return ReferenceFP8Engine.from_hf_checkpoint(tiny_model_path("tiny"), quantization=QCFG, **kw)


def _perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: (t.float() + 0.3 * t.float().std() * torch.randn(t.shape, generator=g)).to(t.dtype)
        for n, t in weights.items()
    }


def _stream(state: dict[str, torch.Tensor], fp8_names: Iterable[str]) -> list[tuple[str, torch.Tensor]]:
    fp8 = set(fp8_names)
    out = []
    for name, t in state.items():
        if name in fp8:
            q, s = quantize_blockwise(t)
            out += [(name, q), (name + SCALE_SUFFIX, s)]
        else:
            out.append((name, t))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class Good:
    """What the engine holds and generates at its last good version."""

    def __init__(self, engine: ReferenceFP8Engine):
        self.engine = engine
        self.tensors = engine.state_dict()
        self.version = engine.version
        self.generated = engine.generate(PROMPT, max_new_tokens=6)

    def holds(self) -> None:
        now = dict(self.engine.named_weights())
        assert now.keys() == self.tensors.keys()
        changed = [n for n in now if not _same(now[n], self.tensors[n])]
        assert not changed, changed[:5]
        assert self.engine.version == self.version
        again = self.engine.generate(PROMPT, max_new_tokens=6)
        assert again.token_ids == self.generated.token_ids
        assert all(torch.equal(a, b) for a, b in zip(again.logprobs, self.generated.logprobs, strict=True))


def _apply(applier: ReferenceEngineApplier, version: int, items: list[tuple[str, torch.Tensor]]) -> None:
    """Drive the applier as the receiver does (begin with every meta, stage each, commit; abort on failure)."""
    metas = [TensorMeta(n, tuple(t.shape), dtype_name(t.dtype), 0, t.numel() * t.element_size()) for n, t in items]
    try:
        applier.begin(version, metas)
        for n, t in items:
            applier.stage(n, t)
        applier.commit(version)
    except Exception as exc:
        applier.abort(version, str(exc))
        raise


@pytest.fixture()
def served(weights):
    """An engine at refit version 1 (a clean refit), its applier, a refit session and the good state."""
    engine = _engine()
    applier = ReferenceEngineApplier(engine)
    refit = ColocatedRefit(applier, timeout=30)
    refit.refit(_stream(_perturbed(weights, 1), engine.fp8_names))
    assert applier.serving_version == 1 and applier.serving
    yield engine, applier, refit, Good(engine)
    refit.close()


def _next_clean_version_commits(engine, applier, refit, weights, version: int) -> None:
    items = _stream(_perturbed(weights, 100 + version), engine.fp8_names)
    refit.refit(items, version=version)
    assert applier.serving_version == version and applier.serving
    held = dict(engine.named_weights())
    assert all(_same(held[n], t) for n, t in items)


# ----------------------------------------------------------------------------- completeness


def test_stream_ending_early_is_refused_naming_the_missing_tensors(served, weights):
    engine, applier, refit, good = served
    items = _stream(_perturbed(weights, 2), engine.fp8_names)
    expected = applier.expected_names()
    assert len(items) == len(expected)
    with pytest.raises(WeightStreamError, match=rf"{len(expected) - 3} of the {len(expected)} tensors .* missing") as e:
        refit.refit(items[:3], version=2)
    msg = str(e.value)
    assert repr(sorted(n for n, _ in items[3:])[0]) in msg and "ended early" in msg and "partial=True" in msg
    good.holds()
    assert applier.serving_version == 1 and applier.serving
    _next_clean_version_commits(engine, applier, refit, weights, 3)


def test_partial_refit_is_an_explicit_opt_in(weights):
    engine = _engine()
    applier = ReferenceEngineApplier(engine, partial=True)
    state = _perturbed(weights, 4)
    name = "model.layers.0.self_attn.o_proj.weight"
    q, s = quantize_blockwise(state[name])
    _apply(applier, 1, [(name, q), (name + SCALE_SUFFIX, s), ("model.norm.weight", state["model.norm.weight"])])
    held = dict(engine.named_weights())
    assert _same(held[name], q) and _same(held[name + SCALE_SUFFIX], s)
    assert applier.serving_version == 1
    with pytest.raises(
        WeightStreamError, match=r"_scale_inv' of version 2: expected float32 \(2, 2\) block scales with the FP8 weight"
    ):  # still: an FP8 weight needs its scales
        _apply(applier, 2, [(name, q)])


def test_over_complete_version_is_refused_naming_the_extra_tensor(served, weights):
    engine, applier, refit, good = served
    items = _stream(_perturbed(weights, 5), engine.fp8_names)
    extra = "model.layers.1.mlp.extra_proj.weight"
    items.insert(4, (extra, torch.ones(4, 4, dtype=torch.bfloat16)))
    with pytest.raises(WeightStreamError, match=rf"'{extra}' is not a parameter of this engine .*HF name mapping"):
        refit.refit(items, version=2)
    good.holds()
    # a scale for a weight held in BF16: the sender's manifest is stale
    items = _stream(_perturbed(weights, 5), engine.fp8_names) + [("model.norm.weight" + SCALE_SUFFIX, torch.ones(1, 1))]
    with pytest.raises(WeightStreamError, match=r"model.norm.weight_scale_inv.*manifest is stale"):
        refit.refit(items, version=3)
    # KV-cache scales for an engine whose KV cache is BF16
    items = _stream(_perturbed(weights, 5), engine.fp8_names) + [(kv_scale_name(0, "k"), torch.tensor(0.02))]
    with pytest.raises(WeightStreamError, match=r"k_scale.*kv_cache_dtype='auto'"):
        refit.refit(items, version=4)
    good.holds()
    _next_clean_version_commits(engine, applier, refit, weights, 5)


def test_fp8_kv_cache_takes_all_kv_scales_or_none(weights):
    engine = _engine(kv_cache_dtype="fp8")
    applier = ReferenceEngineApplier(engine)
    refit = ColocatedRefit(applier, timeout=30)
    layers = engine.model_config.num_hidden_layers
    kv = [(kv_scale_name(i, k), torch.tensor(0.01 * (i + 1))) for i in range(layers) for k in "qkv"]
    refit.refit(_stream(_perturbed(weights, 6), engine.fp8_names) + kv)  # all: applied
    assert all(_same(dict(engine.named_weights())[n], t) for n, t in kv)
    good = Good(engine)
    with pytest.raises(WeightStreamError, match=rf"carries 1 of the {3 * layers} KV-cache scales.*every layer"):
        refit.refit(_stream(_perturbed(weights, 7), engine.fp8_names) + kv[1:2])
    good.holds()
    refit.refit(_stream(_perturbed(weights, 8), engine.fp8_names))  # none: the engine keeps its scales
    assert all(_same(dict(engine.named_weights())[n], t) for n, t in kv)
    refit.close()


# ----------------------------------------------------------------------------- validated before the first write


def test_wrong_shape_tensor_late_in_the_stream_is_refused_with_nothing_written(served, weights):
    engine, applier, refit, good = served
    items = _stream(_perturbed(weights, 9), engine.fp8_names)
    items = [(n, t) for n, t in items if n != "model.norm.weight"]
    items.append(("model.norm.weight", torch.ones(512, dtype=torch.bfloat16)))  # the last tensor of the stream
    writes = []
    real_commit = engine.commit
    engine.commit = lambda staged: writes.append(staged) or real_commit(staged)  # count writes, change none
    with pytest.raises(
        WeightStreamError, match=r"'model.norm.weight' of version 2: expected \(256,\) bfloat16, got \(512,\)"
    ):
        refit.refit(items, version=2)
    assert writes == []  # refused in begin, before the engine was asked to write anything
    good.holds()
    _next_clean_version_commits(engine, applier, refit, weights, 3)
    assert len(writes) == 1


@pytest.mark.parametrize("value", [0.0, -0.5, float("nan"), float("inf")])
def test_bad_scale_values_are_refused_naming_the_scale(served, weights, value):
    engine, applier, refit, good = served
    items = dict(_stream(_perturbed(weights, 10), engine.fp8_names))
    sname = TARGET + SCALE_SUFFIX
    bad = items[sname].clone()
    bad[1, 0] = value
    items[sname] = bad
    with pytest.raises(WeightStreamError, match=rf"'{sname}' of version 2: 1 of 8 scale\(s\) .*index \(1, 0\)"):
        _apply(applier, 2, list(items.items()))
    good.holds()
    assert applier.serving_version == 1
    _next_clean_version_commits(engine, applier, refit, weights, 3)


def test_bad_kv_scale_value_is_refused(weights):
    engine = _engine(kv_cache_dtype="fp8")
    applier = ReferenceEngineApplier(engine)
    refit = ColocatedRefit(applier, timeout=30)
    refit.refit(_stream(_perturbed(weights, 11), engine.fp8_names))
    good = Good(engine)
    kv = [
        (kv_scale_name(i, k), torch.tensor(0.02)) for i in range(engine.model_config.num_hidden_layers) for k in "qkv"
    ]
    kv[4] = (kv[4][0], torch.tensor(0.0))
    with pytest.raises(WeightStreamError, match=rf"'{kv[4][0]}' .*zero, negative"):
        _apply(applier, 2, _stream(_perturbed(weights, 12), engine.fp8_names) + kv)
    good.holds()
    refit.close()


@pytest.mark.parametrize("grid", [(2, 1), (1, 2), (4, 4)])
def test_scale_of_the_wrong_block_grid_is_refused(served, weights, grid):
    engine, applier, refit, good = served
    items = dict(_stream(_perturbed(weights, 13), engine.fp8_names))
    name = "model.layers.0.self_attn.o_proj.weight"  # [256, 256]: a (2, 2) grid of 128x128 blocks
    items[name + SCALE_SUFFIX] = torch.ones(grid)
    with pytest.raises(
        WeightStreamError,
        match=r"float32 \(2, 2\) block scales \(ceil\(256/128\) x ceil\(256/128\).*weight_block_size",
    ):
        refit.refit(list(items.items()), version=2)
    good.holds()
    _next_clean_version_commits(engine, applier, refit, weights, 3)


def test_fp8_weight_for_a_bf16_slot_and_scales_with_a_bf16_weight_are_refused(served, weights):
    engine, applier, refit, good = served
    items = dict(_stream(_perturbed(weights, 14), engine.fp8_names))
    items["model.norm.weight"] = items["model.norm.weight"].to(torch.float8_e4m3fn)
    with pytest.raises(WeightStreamError, match=r"'model.norm.weight'.*engine holds it in BF16.*manifest is stale"):
        refit.refit(list(items.items()), version=2)
    items = dict(_stream(_perturbed(weights, 14), engine.fp8_names))
    items[TARGET] = _perturbed(weights, 14)[TARGET]  # BF16 for an FP8 slot, but its scales still come along
    with pytest.raises(WeightStreamError, match=rf"'{TARGET}_scale_inv'.*send scales only with an FP8 weight"):
        refit.refit(list(items.items()), version=3)
    good.holds()


# ----------------------------------------------------------------------------- rollback and exact verification


def _plant(engine: ReferenceFP8Engine, fault) -> None:
    """Make the engine's next commit write everything, then run ``fault(engine)`` (a bug between write and verify)."""
    real_commit = engine.commit

    def faulty_commit(staged):
        out = real_commit(staged)
        fault(engine)
        engine.commit = real_commit
        return out

    engine.commit = faulty_commit


def _flip_one_code(name: str, index: int = 1234):
    def fault(engine):
        engine._tensors[name].view(torch.uint8).reshape(-1)[index] ^= 0x01

    return fault


def _scale_error(name: str, factor: float = 1.01):
    def fault(engine):
        engine._tensors[name + SCALE_SUFFIX].reshape(-1)[2] *= factor

    return fault


@pytest.mark.parametrize(
    ("fault", "pattern"),
    [
        (_flip_one_code(TARGET), rf"{TARGET}: FP8 bytes differ from what was sent \(first at flat index 1234"),
        (_scale_error(TARGET), rf"{TARGET}_scale_inv: the engine holds a different \(stale\) scale"),
        (
            _flip_one_code("model.layers.0.input_layernorm.weight", 7),
            r"model.layers.0.input_layernorm.weight: the engine holds a different tensor than was sent",
        ),
    ],
    ids=["flipped-fp8-code", "1pct-scale-error", "flipped-bf16-bit"],
)
def test_verification_failure_rolls_back_then_next_clean_version_commits(served, weights, fault, pattern):
    engine, applier, refit, good = served
    _plant(engine, fault)
    with pytest.raises(RefitRolledBackError, match=pattern) as e:
        refit.refit(_stream(_perturbed(weights, 15), engine.fp8_names), version=2)
    assert "holds version 1 again" in str(e.value)
    good.holds()  # byte-identical tensors, identical generation, version counter unchanged
    assert applier.serving and applier.serving_version == 1
    assert applier.last_snapshot_bytes > 0
    _next_clean_version_commits(engine, applier, refit, weights, 3)


def test_bf16_sent_for_fp8_slot_is_verified_against_its_requantization(served, weights):
    engine, applier, refit, good = served
    state = _perturbed(weights, 16)
    items = [(n, t) for n, t in _stream(state, engine.fp8_names) if not n.startswith(TARGET)] + [
        (TARGET, state[TARGET])
    ]
    _plant(engine, _flip_one_code(TARGET, 99))
    with pytest.raises(RefitRolledBackError, match=rf"{TARGET}: FP8 bytes differ from the re-quantization"):
        refit.refit(items, version=2)
    good.holds()
    refit.refit(items, version=3)  # unfaulted: the requantization matches exactly
    q, s = quantize_blockwise(state[TARGET])
    held = dict(engine.named_weights())
    assert _same(held[TARGET], q) and _same(held[TARGET + SCALE_SUFFIX], s)
    assert 0 < applier.last_verify.max_rel_error < 0.07 and applier.last_verify.worst == TARGET


def test_exception_mid_copy_rolls_back(served, weights):
    engine, applier, refit, good = served

    def commit_dying_halfway(staged):  # a device error after the first half of the copies
        names = sorted(staged.targets)
        with torch.no_grad():
            for n in names[: len(names) // 2]:
                engine._tensors[n].copy_(staged._updates[n])
        raise RuntimeError("device lost mid-copy")

    real_commit, engine.commit = engine.commit, commit_dying_halfway
    with pytest.raises(RefitRolledBackError, match="device lost mid-copy"):
        refit.refit(_stream(_perturbed(weights, 17), engine.fp8_names), version=2)
    engine.commit = real_commit
    good.holds()
    _next_clean_version_commits(engine, applier, refit, weights, 3)


def test_verify_catches_any_single_flipped_code_and_small_scale_errors(served, weights):
    engine, applier, refit, _ = served
    sent = dict(_stream(_perturbed(weights, 1), engine.fp8_names))  # version 1, as the fixture sent it
    assert applier.verify(1, sent).checked == len(engine.weights.specs)
    g = torch.Generator().manual_seed(0)
    names = sorted(engine.fp8_names)
    for trial in range(20):
        name = names[trial % len(names)]
        flat = engine._tensors[name].view(torch.uint8).reshape(-1)
        i = int(torch.randint(flat.numel(), (1,), generator=g))
        bit = 1 << int(torch.randint(7, (1,), generator=g))
        flat[i] ^= bit
        with pytest.raises(RefitError, match=rf"{name}: FP8 bytes differ .*flat index {i}:"):
            applier.verify(1, sent)
        flat[i] ^= bit
    for factor in (1.01, 0.99, 1.0 + 2**-20):
        scale = engine._tensors[TARGET + SCALE_SUFFIX]
        old = scale.clone()
        scale[0, 1] *= factor
        with pytest.raises(RefitError, match=rf"{TARGET}_scale_inv: .*different \(stale\) scale"):
            applier.verify(1, sent)
        scale.copy_(old)
    assert applier.verify(1, sent).max_rel_error == 0.0
