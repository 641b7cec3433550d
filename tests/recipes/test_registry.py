"""Recipe registry: names, declared fields, errors."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_fp8.errors import ConfigError
from megatron_fp8.recipes import (
    FP32_BLOCK_SCALES_ENV,
    RECIPES,
    REQUIREMENTS,
    TRANSFORMER_CONFIG_FIELDS,
    fp8_recipe_names,
    get_recipe,
    list_recipes,
)

EXPECTED = {
    # name: (fp8, fp8_recipe, fp8_param, fp8_param_gather, TE class, padding)
    "bf16": (None, None, False, False, None, 16),
    "tensorwise": ("hybrid", "tensorwise", False, False, "Float8CurrentScaling", 16),
    "blockwise": ("e4m3", "blockwise", False, False, "Float8BlockScaling", 128),
    "fp8_param": ("e4m3", "blockwise", True, True, "Float8BlockScaling", 128),
    "delayed": ("hybrid", "delayed", False, False, "DelayedScaling", 16),
    "mxfp8": ("e4m3", "mxfp8", False, False, "MXFP8BlockScaling", 32),
}


def test_registry_names_and_order():
    assert list_recipes() == tuple(EXPECTED)
    assert fp8_recipe_names() == tuple(n for n in EXPECTED if n != "bf16")
    assert set(REQUIREMENTS) == set(RECIPES)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_recipe_declarations(name):
    r = get_recipe(name)
    fp8, fp8_recipe, fp8_param, gather, te_cls, pad = EXPECTED[name]
    assert (r.fp8, r.fp8_recipe, r.fp8_param, r.fp8_param_gather) == (fp8, fp8_recipe, fp8_param, gather)
    assert r.te_recipe_class == te_cls
    assert r.seq_padding_multiple == pad
    assert r.ddp_fields() == {"fp8_param_gather": gather}
    needs_env = name in ("blockwise", "fp8_param")
    assert (r.env == {FP32_BLOCK_SCALES_ENV: "1"}) is needs_env
    assert r.env == {} or needs_env
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.fp8 = "e4m3"  # type: ignore[misc]


def test_get_recipe_passes_recipe_through():
    r = get_recipe("blockwise")
    assert get_recipe(r) is r


@pytest.mark.parametrize("bad", ["blockwize", "", "BF16", None])
def test_unknown_recipe_lists_valid_names(bad):
    with pytest.raises(ConfigError) as info:
        get_recipe(bad)
    msg = str(info.value)
    assert repr(bad) in msg
    for name in EXPECTED:
        assert name in msg


def test_delayed_scaling_values():
    f = get_recipe("delayed").transformer_fields()
    assert (f["fp8_amax_history_len"], f["fp8_amax_compute_algo"], f["fp8_margin"]) == (1024, "max", 0)


def test_transformer_fields_bf16_layers():
    f = get_recipe("blockwise").transformer_fields(num_first_layers_in_bf16=1, num_last_layers_in_bf16=2)
    assert set(f) == set(TRANSFORMER_CONFIG_FIELDS)
    assert f["first_last_layers_bf16"] is True
    assert (f["num_layers_at_start_in_bf16"], f["num_layers_at_end_in_bf16"]) == (1, 2)
    g = get_recipe("blockwise").transformer_fields()
    assert g["first_last_layers_bf16"] is False
    assert get_recipe("tensorwise").transformer_fields(fp8_format="e4m3")["fp8"] == "e4m3"


def test_transformer_fields_errors():
    with pytest.raises(ConfigError, match="delayed"):
        get_recipe("delayed").transformer_fields(num_first_layers_in_bf16=1)
    with pytest.raises(ConfigError, match="num_last_layers_in_bf16"):
        get_recipe("blockwise").transformer_fields(num_last_layers_in_bf16=-1)
    with pytest.raises(ConfigError, match="e5m2"):
        get_recipe("blockwise").transformer_fields(fp8_format="e5m2")
