"""DictApplier: complete by default, validated before the first write, rolled back on failure (issue 11).

Versions go through the real colocated pipeline (sender -> in-process transport -> receiver -> applier),
except values the sender itself refuses to send (NaN), which are handed to the applier's protocol the way
the receiver does. Each fault asserts: refused or rolled back with a named reason, the tensors
byte-identical to the last good version, the version unchanged, and the next clean version commits.
"""

from __future__ import annotations

import pytest
import torch

from megatron_fp8.errors import EngineNotServingError, RefitRolledBackError, WeightStreamError
from megatron_fp8.refit import DictApplier
from megatron_fp8.refit.pipeline import ColocatedRefit
from megatron_fp8.refit.synthetic import SPECS, fp8_stream, linear_shapes, synthetic_weights
from megatron_fp8.refit.wire import TensorMeta, dtype_name
from megatron_fp8.vocab import SCALE_SUFFIX

SPEC = SPECS["tiny"].shrunk(1, num_layers=2)
SCALE = "model.layers.1.mlp.down_proj.weight" + SCALE_SUFFIX


def _version(seed: int) -> list[tuple[str, torch.Tensor]]:
    return list(fp8_stream(synthetic_weights(SPEC, seed=seed), linear_shapes(SPEC)))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture()
def served():
    """A DictApplier holding version 1 (applied through the pipeline), its session and a copy of version 1."""
    v1 = _version(1)
    applier = DictApplier({n: torch.zeros_like(t) for n, t in v1})
    refit = ColocatedRefit(applier, timeout=30)
    refit.refit(v1, version=1)
    good = {n: t.clone() for n, t in applier.tensors.items()}
    yield applier, refit, good
    refit.close()


def _holds(applier: DictApplier, good: dict[str, torch.Tensor], version: int = 1) -> None:
    changed = [n for n, t in applier.tensors.items() if not _same(t, good[n])]
    assert not changed, changed[:5]
    assert applier.version == version and applier.serving


def _next_clean_version_commits(applier: DictApplier, refit: ColocatedRefit, version: int) -> None:
    items = _version(version)
    refit.refit(items, version=version)
    assert applier.version == version and applier.serving
    assert all(_same(applier.tensors[n], t) for n, t in items)


def _apply(applier: DictApplier, version: int, items: list[tuple[str, torch.Tensor]]) -> None:
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


def test_stream_ending_early_is_refused_naming_the_missing_tensors(served):
    applier, refit, good = served
    items = _version(2)
    n = len(items)
    with pytest.raises(WeightStreamError, match=rf"{n - 3} of the {n} tensors .* missing .*ended early.*partial=True"):
        refit.refit(items[:3], version=2)
    _holds(applier, good)
    _next_clean_version_commits(applier, refit, 3)


def test_partial_is_an_explicit_opt_in_and_require_all_a_deprecated_alias():
    items = _version(4)
    partial = DictApplier({n: torch.zeros_like(t) for n, t in items}, partial=True)
    _apply(partial, 1, items[:3])
    assert all(_same(partial.tensors[n], t) for n, t in items[:3]) and partial.version == 1
    with pytest.deprecated_call():
        strict = DictApplier({n: torch.zeros_like(t) for n, t in items}, require_all=True)
    assert not strict.partial and strict.require_all
    with pytest.raises(WeightStreamError, match="missing"):
        _apply(strict, 1, items[:3])
    with pytest.deprecated_call():
        assert DictApplier({}, require_all=False).partial


def test_over_complete_version_is_refused_naming_the_extra_tensor(served):
    applier, refit, good = served
    items = _version(2)
    items.insert(5, ("model.layers.0.mlp.extra_proj.weight", torch.ones(3, dtype=torch.bfloat16)))
    with pytest.raises(
        WeightStreamError, match=r"'model.layers.0.mlp.extra_proj.weight' is not a parameter .*HF name mapping"
    ):
        refit.refit(items, version=2)
    _holds(applier, good)
    _next_clean_version_commits(applier, refit, 3)


def test_wrong_shape_tensor_late_in_the_stream_is_refused_with_nothing_written(served):
    applier, refit, good = served
    items = _version(2)
    name, t = items[-1]
    items[-1] = (name, torch.ones(t.shape[0] * 2, *t.shape[1:], dtype=t.dtype))
    with pytest.raises(WeightStreamError, match=rf"'{name}': got \({t.shape[0] * 2},.*disagree on this parameter"):
        refit.refit(items, version=2)
    _holds(applier, good)
    _next_clean_version_commits(applier, refit, 3)


def _apply_at_once(applier: DictApplier, version: int, items: list[tuple[str, torch.Tensor]]) -> None:
    """As :func:`_apply`, with the whole version staged in one ``stage_many`` (what the receiver calls)."""
    metas = [TensorMeta(n, tuple(t.shape), dtype_name(t.dtype), 0, t.numel() * t.element_size()) for n, t in items]
    try:
        applier.begin(version, metas)
        applier.stage_many(items)
        applier.commit(version)
    except Exception as exc:
        applier.abort(version, str(exc))
        raise


@pytest.mark.parametrize("stage", [_apply, _apply_at_once], ids=["one-by-one", "whole-version"])
@pytest.mark.parametrize("value", [0.0, -0.0, -1.0, float("nan"), float("inf")])
def test_bad_scale_values_are_refused_naming_the_scale(served, value, stage):
    """Whole-version staging checks every scale in a few multi-tensor ops; a bad one is still named, after
    every other scale of the version was good (here a late layer's)."""
    applier, refit, good = served
    items = dict(_version(2))
    bad = items[SCALE].clone()
    bad[0, 1] = value
    items[SCALE] = bad
    with pytest.raises((WeightStreamError, ValueError), match=SCALE):
        stage(applier, 2, list(items.items()))
    _holds(applier, good)
    _next_clean_version_commits(applier, refit, 3)


def test_scale_of_the_wrong_block_grid_is_refused(served):
    applier, refit, good = served
    items = dict(_version(2))
    rows, cols = items[SCALE].shape
    items[SCALE] = torch.ones(cols, rows)  # transposed grid
    with pytest.raises(WeightStreamError, match=rf"'{SCALE}': got \({cols}, {rows}\).*holds \({rows}, {cols}\)"):
        refit.refit(list(items.items()), version=2)
    _holds(applier, good)
    _next_clean_version_commits(applier, refit, 3)


def _flip_a_code(applier: DictApplier) -> None:
    applier.tensors["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8).reshape(-1)[77] ^= 0x04


def _scale_off_by_one_percent(applier: DictApplier) -> None:
    applier.tensors[SCALE].reshape(-1)[1] *= 1.01


def _device_error(applier: DictApplier) -> None:
    raise RuntimeError("device error after the copies")


@pytest.mark.parametrize(
    ("fault", "pattern"),
    [
        (_flip_a_code, r"q_proj.weight' reads back different bytes after copy \(first at flat index 77\)"),
        (_scale_off_by_one_percent, rf"'{SCALE}' reads back different bytes"),
        (_device_error, "device error after the copies"),
    ],
    ids=["flipped-fp8-code", "1pct-scale-error", "exception-after-write"],
)
def test_failure_after_the_first_write_rolls_back(served, fault, pattern):
    applier, refit, good = served
    applier.after_write = fault
    with pytest.raises(RefitRolledBackError, match=pattern):
        refit.refit(_version(2), version=2)
    applier.after_write = None
    _holds(applier, good)
    _next_clean_version_commits(applier, refit, 3)


def test_without_rollback_a_failed_version_is_not_served_until_a_clean_one_commits():
    v1 = _version(1)
    applier = DictApplier({n: t.clone() for n, t in v1}, version=1, rollback=False)
    applier.after_write = _flip_a_code
    with pytest.raises(EngineNotServingError, match="rollback=False"):
        _apply(applier, 2, _version(2))
    assert not applier.serving and applier.version == 1
    applier.after_write = None
    _apply(applier, 3, _version(3))
    assert applier.serving and applier.version == 3
