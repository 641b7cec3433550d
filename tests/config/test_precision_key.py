"""``policy.precision`` (NeMo-RL's key) acts: its values, its refusals, where ``config --explain`` says it goes."""

from __future__ import annotations

import pytest

from megatron_fp8 import vocab
from megatron_fp8.config import load_config
from megatron_fp8.config.explain import effect_of
from megatron_fp8.config.loader import load_config_report
from megatron_fp8.errors import ConfigError


def test_default_is_bfloat16_and_nemo_rl_values_load():
    assert load_config(None).policy.precision == "bfloat16"
    for value in ("bfloat16", "float16", "float32"):
        loaded = load_config_report(None, [f"policy.precision={value}"])
        assert loaded.config.policy.precision == value
        assert "policy.precision" not in loaded.no_effect  # no longer accepted with no effect
    assert tuple(vocab.TRAINING_PRECISIONS) == ("bfloat16", "float16", "float32")


@pytest.mark.parametrize("value", ["fp16", "bf16", "float8", "half"])
def test_unknown_values_are_refused_naming_the_key_and_the_set(value):
    with pytest.raises(ConfigError, match=r"policy\.precision: expected one of 'bfloat16', 'float16', 'float32'"):
        load_config(None, [f"policy.precision={value}"])


def test_explain_says_where_it_goes():
    effect = effect_of("policy.precision")
    assert effect is not None and "make_optimizer" in effect and "loss scale" in effect
