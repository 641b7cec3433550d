"""The engine worker's value check of a whole version (:func:`validate_version`), without vLLM.

In a GRPO run it reads every byte of the host-staged version on the CPU before the first write; it must refuse
each kind of bad value wherever it sits (here at the last element of a large weight, and in a non-contiguous view)
and name the tensor. Its speed is ``bench/engine_checks.py``'s.
"""

from __future__ import annotations

import pytest
import torch

from megatron_fp8.errors import WeightStreamError
from megatron_fp8.rollout.vllm.expected import ExpectedTensor, validate_version
from megatron_fp8.vocab import SCALE_SUFFIX

W = "model.layers.0.mlp.down_proj.weight"
NORM = "model.norm.weight"
KV = "model.layers.0.self_attn.attn.k_scale"


def _version(scale_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        W: torch.randint(0, 0x7E, (384, 640), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn),
        W + SCALE_SUFFIX: (torch.rand(3, 5, generator=g) + 0.5).to(scale_dtype),
        NORM: torch.randn(640, generator=g).to(torch.bfloat16),
        KV: torch.tensor(0.25),
    }


def _expected(items: dict[str, torch.Tensor]) -> dict[str, ExpectedTensor]:
    kinds = {W: "weight", W + SCALE_SUFFIX: "scale", NORM: "other", KV: "kv_scale"}
    return {
        n: ExpectedTensor(n, tuple(t.shape), (str(t.dtype).removeprefix("torch."),), kinds[n], n)
        for n, t in items.items()
    }


def _check(items: dict[str, torch.Tensor]) -> None:
    validate_version(list(items.items()), _expected(items), partial=False)


def test_a_clean_version_passes():
    _check(_version())
    _check(_version(torch.float8_e8m0fnu))


@pytest.mark.parametrize("code", [0x7F, 0xFF], ids=["+nan", "-nan"])
@pytest.mark.parametrize("where", [(0, 0), (383, 639)], ids=["first", "last"])
def test_an_fp8_nan_pattern_anywhere_in_a_weight_is_refused(code, where):
    items = _version()
    items[W].view(torch.uint8)[where] = code
    with pytest.raises(WeightStreamError, match=rf"'{W}' holds NaN or Inf"):
        _check(items)


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan")])
def test_a_nonfinite_bf16_value_is_refused_even_in_a_strided_view(value):
    items = _version()
    norm = torch.zeros(2, 640, dtype=torch.bfloat16)
    norm[1] = items[NORM]
    items[NORM] = norm[1]  # a view into a larger buffer (offset, not the whole storage)
    items[NORM][639] = value
    with pytest.raises(WeightStreamError, match=rf"'{NORM}' holds NaN or Inf"):
        _check(items)


@pytest.mark.parametrize("value", [0.0, -0.0, -1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("name", [W + SCALE_SUFFIX, KV])
def test_a_bad_scale_is_refused_naming_it(value, name):
    items = _version()
    items[name] = items[name].clone()
    items[name].view(-1)[-1] = value
    with pytest.raises(WeightStreamError, match=rf"scale '{name}' holds"):
        _check(items)


def test_a_ue8m0_scale_is_refused_only_for_its_nan_code():
    items = _version(torch.float8_e8m0fnu)
    items[W + SCALE_SUFFIX].view(torch.uint8)[2, 4] = 0xFF
    with pytest.raises(WeightStreamError, match="NaN or Inf"):
        _check(items)
