"""Capability verdicts on synthetic environments, and the probe of this machine."""

from __future__ import annotations

import sys

import pytest

from megatron_fp8.recipes import (
    CPU_EMULATION_NOTE,
    Environment,
    check,
    check_all,
    list_recipes,
    probe_environment,
)

H100_CUDA129 = Environment(
    gpu_name="NVIDIA H100 80GB HBM3",
    compute_capability=(9, 0),
    gpu_count=8,
    torch_version="2.8.0a0+5228986c39.nv25.06",
    torch_cuda="12.9",
    cublas_version="12.9.1.4",
    transformer_engine="2.5.0+f05f12c9",
)
H100_CUDA128 = Environment(
    gpu_name="NVIDIA H100 80GB HBM3",
    compute_capability=(9, 0),
    gpu_count=8,
    torch_version="2.7.1+cu128",
    torch_cuda="12.8",
    cublas_version="12.8.4.1",
    transformer_engine="2.5.0",
)
A100 = Environment(
    gpu_name="NVIDIA A100-SXM4-80GB",
    compute_capability=(8, 0),
    gpu_count=8,
    torch_version="2.8.0+cu129",
    torch_cuda="12.9",
    transformer_engine="2.5.0",
)
B200 = Environment(
    gpu_name="NVIDIA B200",
    compute_capability=(10, 0),
    gpu_count=8,
    torch_version="2.8.0+cu129",
    torch_cuda="12.9",
    transformer_engine="2.5.0",
)
CPU = Environment(torch_version="2.13.0+cpu", torch_cuda=None, gpu_probe="none")


def _supported(env):
    return {v.name for v in check_all(env) if v.supported}


def test_h100_cuda129_te_supports_hopper_recipes():
    assert _supported(H100_CUDA129) == {"bf16", "tensorwise", "blockwise", "fp8_param", "delayed"}
    mx = check("mxfp8", H100_CUDA129)
    assert not mx.supported
    assert "compute capability" in mx.reasons[0] and "9.0" in mx.reasons[0]


def test_h100_cuda128_blockwise_unsupported_with_exact_remedy():
    v = check("blockwise", H100_CUDA128)
    assert not v.supported
    assert (
        "blockwise needs torch built with CUDA >= 12.9; this torch was built with 12.8; "
        "use the image from `make image` (NGC PyTorch, CUDA 12.9, TransformerEngine)"
    ) in v.reasons
    assert any("cuBLAS >= 12.9" in r and "12.8.4.1" in r for r in v.reasons)
    assert CPU_EMULATION_NOTE not in v.reasons  # there is a GPU: no emulation note
    assert check("tensorwise", H100_CUDA128).supported
    assert not check("fp8_param", H100_CUDA128).supported


def test_a100_supports_only_bf16():
    assert _supported(A100) == {"bf16"}
    v = check("tensorwise", A100)
    assert any("8.0" in r and "compute capability" in r for r in v.reasons)


def test_blackwell_supports_mxfp8_but_not_hopper_only_blockwise():
    assert check("mxfp8", B200).supported
    assert not check("blockwise", B200).supported


def test_old_te_is_named():
    env = Environment(**{**H100_CUDA129.__dict__, "transformer_engine": "2.2.1"})
    v = check("blockwise", env)
    assert not v.supported
    assert any("TransformerEngine >= 2.3.0.dev0" in r and "2.2.1" in r for r in v.reasons)
    assert check("tensorwise", env).supported


def test_unknown_cublas_does_not_block():
    env = Environment(**{**H100_CUDA129.__dict__, "cublas_version": None})
    assert check("blockwise", env).supported


def test_cpu_every_fp8_recipe_unsupported_with_gpu_reasons():
    for v in check_all(CPU):
        if v.name == "bf16":
            assert v.supported and v.reasons == ()
            continue
        assert not v.supported
        assert any("GPU" in r for r in v.reasons)
        assert any("CUDA" in r for r in v.reasons)
        assert v.reasons[-1] == CPU_EMULATION_NOTE


def test_verdict_to_dict_schema():
    d = check("blockwise", CPU).to_dict()
    assert set(d) == {"name", "supported", "reasons"}
    assert isinstance(d["reasons"], list)


def test_probe_this_machine_is_cheap_and_consistent():
    heavy = ("vllm", "megatron.core", "transformer_engine")
    before = {m for m in heavy if m in sys.modules}
    env = probe_environment(use_torch=False)
    assert {m for m in heavy if m in sys.modules} == before
    import torch

    assert env.torch_version == torch.__version__.split("+")[0] or env.torch_version == torch.__version__
    assert env.torch_cuda == torch.version.cuda
    d = env.to_dict()
    assert d["compute_capability"] is None or "." in d["compute_capability"]
    if not torch.cuda.is_available():
        assert all(not check(n, probe_environment(use_torch=True)).supported for n in list_recipes() if n != "bf16")


@pytest.mark.gpu
def test_probe_on_gpu_matches_torch():
    import torch

    env = probe_environment(use_torch=True)
    assert env.has_gpu
    assert env.compute_capability == torch.cuda.get_device_capability(0)
    assert env.gpu_name == torch.cuda.get_device_name(0)
    smi = probe_environment(use_torch=False)
    if smi.gpu_probe == "nvidia-smi":
        assert smi.compute_capability == env.compute_capability


@pytest.mark.parametrize("cc", [(10, 0), (10, 3), (12, 0)])
def test_blockwise_is_refused_not_warned_from_compute_capability_10(cc):
    env = Environment(**{**H100_CUDA129.__dict__, "compute_capability": cc, "gpu_name": "NVIDIA B200"})
    v = check("blockwise", env)
    assert not v.supported and any("Hopper (compute capability 9.x)" in r for r in v.reasons)
