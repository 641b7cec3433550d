"""Applying recipes to real Megatron-Core configs on CPU."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="needs Megatron-Core (make install); a GPU box with torch only skips")
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_fp8.errors import ConfigError, RecipeUnsupportedError
from megatron_fp8.recipes import (
    CPU_EMULATION_NOTE,
    FP32_BLOCK_SCALES_ENV,
    MATH_MODES,
    Environment,
    apply_recipe,
    apply_recipe_with_report,
    list_recipes,
)

CPU = Environment(torch_version="2.13.0+cpu", gpu_probe="none")
H100 = Environment(
    gpu_name="NVIDIA H100",
    compute_capability=(9, 0),
    gpu_count=1,
    torch_cuda="12.9",
    cublas_version="12.9.1.4",
    transformer_engine="2.5.0",
)
A100 = Environment(gpu_name="NVIDIA A100", compute_capability=(8, 0), gpu_count=1, torch_cuda="12.9")


def _tc(**kw):
    return TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=4, **kw)


@pytest.mark.parametrize("name", list_recipes())
def test_apply_each_recipe_to_transformer_config(name):
    base = _tc()
    env: dict[str, str] = {}
    rep = apply_recipe_with_report(base, name, environment=CPU, env=env)
    cfg = rep.config
    assert isinstance(cfg, TransformerConfig)
    assert cfg is not base and base.fp8 is None  # input untouched
    for key, value in rep.fields_set.items():
        assert getattr(cfg, key) == value
    assert rep.fields_absent == ("fp8_param_gather",)
    if name == "bf16":
        assert cfg.fp8 is None and rep.math == "bf16"
    else:
        assert cfg.fp8 in ("e4m3", "hybrid")
        assert cfg.fp8_recipe == rep.fields_set["fp8_recipe"]
        assert rep.math == "bf16-emulated"
        assert MATH_MODES["bf16-emulated"] == rep.math_note and "BF16" not in rep.math_note
        assert rep.verdict is not None and CPU_EMULATION_NOTE in rep.verdict.reasons
    assert env == ({FP32_BLOCK_SCALES_ENV: "1"} if name in ("blockwise", "fp8_param") else {})
    assert rep.env_set == env


def test_fp8_param_on_transformer_and_ddp_config():
    cfg = apply_recipe(_tc(), "fp8_param", environment=CPU, env={})
    assert cfg.fp8_param is True and cfg.fp8_recipe == "blockwise" and cfg.fp8 == "e4m3"
    ddp = apply_recipe_with_report(DistributedDataParallelConfig(), "fp8_param", environment=CPU, env={})
    assert ddp.config.fp8_param_gather is True
    assert "fp8" in ddp.fields_absent and set(ddp.fields_set) == {"fp8_param_gather"}


def test_first_last_layers_bf16():
    cfg = apply_recipe(_tc(), "tensorwise", num_first_layers_in_bf16=1, num_last_layers_in_bf16=2, environment=CPU)
    assert cfg.first_last_layers_bf16 is True
    assert (cfg.num_layers_at_start_in_bf16, cfg.num_layers_at_end_in_bf16) == (1, 2)
    plain = apply_recipe(_tc(), "tensorwise", environment=CPU)
    assert plain.first_last_layers_bf16 is False


def test_bf16_layers_beyond_stage_rejected():
    with pytest.raises(ConfigError, match="num_first_layers_in_bf16=5"):
        apply_recipe(_tc(), "blockwise", num_first_layers_in_bf16=5, environment=CPU, env={})


def test_delayed_rejects_bf16_layers():
    with pytest.raises(ConfigError, match="delayed"):
        apply_recipe(_tc(), "delayed", num_last_layers_in_bf16=1, environment=CPU)


def test_megatron_validation_runs_on_result():
    # fp8_param without fp8 is rejected by Megatron-Core's own __post_init__; we re-run it via replace().
    cfg = apply_recipe(_tc(), "fp8_param", environment=CPU, env={})
    back = apply_recipe(cfg, "bf16", environment=CPU)
    assert back.fp8 is None and back.fp8_param is False


def test_emulation_disallowed_raises():
    with pytest.raises(RecipeUnsupportedError) as info:
        apply_recipe(_tc(), "blockwise", environment=CPU, allow_cpu_emulation=False, env={})
    msg = str(info.value)
    assert "allow_cpu_emulation=False" in msg and "CUDA" in msg


def test_unsupported_on_gpu_raises_even_with_emulation():
    with pytest.raises(RecipeUnsupportedError, match="A100"):
        apply_recipe(_tc(), "blockwise", environment=A100, allow_cpu_emulation=True, env={})
    env: dict[str, str] = {}
    rep = apply_recipe_with_report(_tc(), "blockwise", environment=A100, check_capability=False, env=env)
    assert rep.math == "unchecked" and rep.verdict is None and env == {FP32_BLOCK_SCALES_ENV: "1"}


def test_supported_gpu_reports_fp8_math():
    rep = apply_recipe_with_report(_tc(), "blockwise", environment=H100, env={})
    assert rep.math == "fp8" and rep.verdict.supported
    assert rep.te_recipe_class == "Float8BlockScaling" and rep.seq_padding_multiple == 128


def test_conflicting_env_var_rejected():
    env = {FP32_BLOCK_SCALES_ENV: "0"}
    with pytest.raises(ConfigError, match=FP32_BLOCK_SCALES_ENV):
        apply_recipe(_tc(), "blockwise", environment=CPU, env=env)
    assert env == {FP32_BLOCK_SCALES_ENV: "0"}


def test_config_without_fields_rejected():
    with pytest.raises(ConfigError, match="none of the recipe fields"):
        apply_recipe(object(), "blockwise", environment=CPU, env={})


def test_bridge_mixed_precision_config():
    from bridge_mappings.adapter import import_bridge

    import_bridge()
    from megatron.bridge.training.mixed_precision import MixedPrecisionConfig

    from megatron_fp8.recipes import build_bridge_mixed_precision

    env: dict[str, str] = {}
    mp = build_bridge_mixed_precision("fp8_param", num_last_layers_in_bf16=1, environment=CPU, env=env)
    assert isinstance(mp, MixedPrecisionConfig)
    assert (mp.fp8, mp.fp8_recipe, mp.fp8_param, mp.fp8_param_gather) == ("e4m3", "blockwise", True, True)
    assert mp.bf16 is True and mp.first_last_layers_bf16 is True and mp.num_layers_at_end_in_bf16 == 1
    assert env == {FP32_BLOCK_SCALES_ENV: "1"}
    tc = apply_recipe(_tc(), "fp8_param", num_last_layers_in_bf16=1, environment=CPU, env={})
    mp.setup(tc)  # Bridge copies its fields onto the model config: must agree with ours
    assert tc.fp8_param is True and tc.num_layers_at_end_in_bf16 == 1
