"""Tests of the private patches: TE import stand-ins and the SequentialMLP export fix (bridge_mappings._patches),
and Megatron-Core's CPU device answer (patch 3, through the adapter)."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from bridge_mappings import _patches as te_shim
from bridge_mappings import adapter
from bridge_mappings import adapter as cpu_patches
from bridge_mappings.adapter import import_bridge
from megatron_fp8.errors import TransformerEngineMissingError

pytestmark = pytest.mark.megatron

needs_no_te = pytest.mark.skipif(te_shim.real_te_available(), reason="real TransformerEngine installed")
needs_bridge = pytest.mark.skipif(adapter.bridge_version() is None, reason="megatron-bridge is not installed")


@needs_no_te
def test_install_is_idempotent_and_bridge_imports():
    assert te_shim.install_te_standins() is True
    assert te_shim.install_te_standins() is True
    assert te_shim.te_standins_installed()
    bridge = import_bridge()
    assert hasattr(bridge, "AutoBridge")
    assert not te_shim.real_te_available()


@needs_no_te
def test_standins_fail_loudly_with_the_remedy():
    te_shim.install_te_standins()
    import transformer_engine.pytorch as te

    with pytest.raises(TransformerEngineMissingError, match="make image"):
        te.Linear(4, 4)
    with pytest.raises(TransformerEngineMissingError, match="needs a GPU build"):
        te.ops.Sequential()
    with pytest.raises(AttributeError, match="TransformerEngine is not installed"):
        _ = te.fp8_autocast
    with pytest.raises(ImportError):
        importlib.import_module("transformer_engine.pytorch.float8_tensor")
    with pytest.raises(ImportError):
        importlib.import_module("transformer_engine_torch")


@needs_no_te
def test_megatron_core_keeps_its_non_te_paths():
    te_shim.install_te_standins()
    import_bridge()
    importlib.import_module("megatron.bridge.models.qwen.qwen3_moe_bridge")
    assert te_shim.mcore_modules_that_saw_the_shim() == []
    for name in (
        "megatron.core.models.gpt.gpt_layer_specs",
        "megatron.core.transformer.mlp",
        "megatron.core.fp8_utils",
    ):
        assert importlib.import_module(name).HAVE_TE is False, name
    # The unguarded name Megatron-Core's MoE router reads is bound to its "not available" value.
    assert importlib.import_module("megatron.core.transformer.moe.moe_utils").te_general_gemm is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patch is inactive with CUDA")
def test_cpu_device_patch_is_scoped():
    original = torch.cuda.current_device
    with cpu_patches.cpu_device_patches() as active:
        assert active is True
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.zeros(1).to(device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.cuda.current_device is original


def test_sequential_expert_export_fix_is_idempotent():
    te_shim.install_te_standins()
    import_bridge()
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    assert te_shim.fix_sequential_expert_export()
    first = MegatronParamMapping.gather_from_ep_ranks
    assert te_shim.fix_sequential_expert_export()
    assert MegatronParamMapping.gather_from_ep_ranks is first


def _param_mapping_cls() -> type:
    import_bridge()
    return importlib.import_module("megatron.bridge.models.conversion.param_mapping").MegatronParamMapping


@needs_bridge
def test_import_bridge_applies_the_sequential_mlp_fix_on_the_installed_bridge(monkeypatch):
    version = adapter.bridge_version()
    assert version is not None and version.startswith(te_shim.PATCHED_VERSIONS), version
    mapping_cls = _param_mapping_cls()
    unpatched = getattr(mapping_cls.gather_from_ep_ranks, "__wrapped__", mapping_cls.gather_from_ep_ranks)
    monkeypatch.setattr(mapping_cls, "gather_from_ep_ranks", unpatched)
    assert not getattr(mapping_cls.gather_from_ep_ranks, te_shim.SHIM_MARKER, False)

    import_bridge()

    patched = mapping_cls.gather_from_ep_ranks
    assert getattr(patched, te_shim.SHIM_MARKER, False) is True
    assert patched.__wrapped__ is unpatched
    import_bridge()
    assert mapping_cls.gather_from_ep_ranks is patched  # applied once, never wrapped twice


@needs_bridge
def test_untested_bridge_version_gets_no_export_fix_and_a_warning(monkeypatch, caplog):
    mapping_cls = _param_mapping_cls()
    current = mapping_cls.gather_from_ep_ranks
    unpatched = getattr(current, "__wrapped__", current)

    # an already patched bridge is not wrapped again (and nothing raises)
    with caplog.at_level(logging.WARNING, logger=te_shim.__name__):
        te_shim.apply("9.9.9")
    assert mapping_cls.gather_from_ep_ranks is current

    # an unpatched bridge stays unpatched, with a warning naming the version
    monkeypatch.setattr(mapping_cls, "gather_from_ep_ranks", unpatched)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=te_shim.__name__):
        te_shim.apply("9.9.9")
    assert mapping_cls.gather_from_ep_ranks is unpatched
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == te_shim.__name__]
    assert len(warnings) == 1
    assert "9.9.9" in warnings[0].getMessage() and "not applied" in warnings[0].getMessage()
