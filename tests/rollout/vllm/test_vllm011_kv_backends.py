"""Per-step FP8 KV scales against vLLM 0.11.0's own FlashInfer attention impl (issue 26), in ``make test-vllm011``.

vLLM 0.11's ``FlashInferImpl.forward`` derives ``bmm1_scale = q * k * scale`` and ``bmm2_scale = v`` from the
layer's host-float scales on its first call and keeps them. The forward runs here up to its first kernel call
(the FlashInfer kernels need a GPU; everything before them is vLLM's code as shipped, ``flashinfer-python`` 0.3.1
installed unmodified), so the cached values are the ones vLLM itself computes.
"""

from __future__ import annotations

import pytest
import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.rollout.vllm import layouts
from megatron_fp8.rollout.vllm.kv_backends import full_decode_graphs, kv_scale_problem, refuse_stale_kv_scales

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.11."):
    pytest.skip(f"needs vLLM 0.11.x (make test-vllm011); this is vLLM {vllm.__version__}", allow_module_level=True)
pytest.importorskip("flashinfer")

from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.v1.attention.backends.flashinfer import FlashInferBackend, FlashInferImpl  # noqa: E402

HEADS, KV_HEADS, HEAD = 4, 2, 64
SCALE = HEAD**-0.5


class _Layer(torch.nn.Module):
    """The KV-scale state vLLM 0.11's ``Attention`` holds after its FP8 KV-cache method processed the checkpoint
    (``_q/_k/_v_scale`` tensors and their ``*_float`` copies), with a real FlashInfer impl and backend."""

    def __init__(self, q: float, k: float, v: float):
        super().__init__()
        self.kv_cache_dtype, self.calculate_kv_scales = "fp8", False
        for name, value in (("q", q), ("k", k), ("v", v)):
            setattr(self, f"_{name}_scale", torch.tensor(value, dtype=torch.float32))
            setattr(self, f"_{name}_scale_float", value)
        self._o_scale_float = None
        self.attn_backend = FlashInferBackend
        self.impl = FlashInferImpl(HEADS, HEAD, SCALE, KV_HEADS, None, None, "fp8")


def _forward(layer: _Layer) -> None:
    """vLLM 0.11's FlashInferImpl.forward as far as it runs without a GPU (it caches bmm1/bmm2 first)."""
    q = torch.zeros(1, HEADS, HEAD)
    kv = torch.zeros(1, KV_HEADS, HEAD)
    with pytest.raises(Exception):  # noqa: B017  (the first FlashInfer kernel call, after the caching)
        layer.impl.forward(layer, q, kv, kv, torch.zeros(0), attn_metadata=object(), output=torch.zeros(1, HEADS, HEAD))


def test_a_refit_reaches_flashinfer_s_cached_scales():
    layer = _Layer(q=0.5, k=0.25, v=0.125)
    _forward(layer)
    assert layer.impl.bmm1_scale == 0.5 * 0.25 * SCALE and layer.impl.bmm2_scale == 0.125  # vLLM's own caching
    new = {"q": torch.tensor(2.0), "k": torch.tensor(0.75), "v": torch.tensor(0.375)}
    layouts.write_kv_scales(layer, new)
    assert layer.impl.bmm1_scale == 2.0 * 0.75 * SCALE and layer.impl.bmm2_scale == 0.375
    _forward(layer)  # the next forward keeps what it holds: the new scales
    assert layer.impl.bmm1_scale == 2.0 * 0.75 * SCALE and layer.impl.bmm2_scale == 0.375
    assert float(layer._k_scale) == 0.75 and layer._k_scale_float == 0.75  # the cache write reads these


def test_without_the_refresh_vllm_keeps_the_stale_scales():
    """What the issue found: rewriting the layer's scales alone leaves FlashInfer on the old ones."""
    layer = _Layer(q=0.5, k=0.25, v=0.125)
    _forward(layer)
    layer._q_scale_float, layer._k_scale_float, layer._v_scale_float = 2.0, 0.75, 0.375
    _forward(layer)
    assert layer.impl.bmm1_scale == 0.5 * 0.25 * SCALE and layer.impl.bmm2_scale == 0.125  # stale


def test_scales_not_derived_yet_stay_so():
    layer = _Layer(q=0.5, k=0.25, v=0.125)
    layouts.write_kv_scales(layer, {"q": torch.tensor(1.5), "k": torch.tensor(0.5), "v": torch.tensor(0.25)})
    assert layer.impl.bmm1_scale is None and layer.impl.bmm2_scale is None
    _forward(layer)
    assert layer.impl.bmm1_scale == 1.5 * 0.5 * SCALE


@pytest.mark.parametrize(
    ("backend", "mode", "refused"),
    [
        (FlashInferBackend.get_name(), CUDAGraphMode.FULL_AND_PIECEWISE, True),  # vLLM 0.11's default mode
        (FlashInferBackend.get_name(), CUDAGraphMode.FULL_DECODE_ONLY, True),
        (FlashInferBackend.get_name(), CUDAGraphMode.PIECEWISE, False),
        (FlashInferBackend.get_name(), CUDAGraphMode.NONE, False),
        ("FLASH_ATTN", CUDAGraphMode.FULL_AND_PIECEWISE, False),  # reads the scale tensors in the graph
        ("TRITON_ATTN", CUDAGraphMode.NONE, True),  # no k/v scale on CUDA, q scale must be 1.0: any mode
    ],
)
def test_setup_refuses_per_step_scales_only_where_the_kernel_cannot_see_them(backend, mode, refused):
    problem = kv_scale_problem([backend], full_decode_graphs=full_decode_graphs(mode), per_step=True)
    assert (problem is not None) == refused, problem
    if refused:
        assert "FLASH_ATTN" in problem and "kv_cache_dtype: auto" in problem
    assert kv_scale_problem([backend], full_decode_graphs=full_decode_graphs(mode), per_step=False) is None


def test_the_model_level_check_reads_each_layer_s_backend():
    model = torch.nn.Sequential(_Layer(0.5, 0.25, 0.125), _Layer(0.5, 0.25, 0.125))
    with pytest.raises(ConfigError, match="FLASHINFER attention kernels"):
        refuse_stale_kv_scales(model, CUDAGraphMode.FULL_AND_PIECEWISE, per_step=True)
    refuse_stale_kv_scales(model, CUDAGraphMode.PIECEWISE, per_step=True)
