"""Issue 37 item 3 on a CPU: why the torch backend on CUDA gave other bytes than Triton on CUDA and torch on a CPU.

The scale rule divides ``amax / 448``. PyTorch's CUDA ``div`` with a CPU scalar divisor (a Python number, or any
one-element CPU tensor) computes ``a * (1 / b)`` (``aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu``: "this may
lose one bit of precision"); CPU float32 division divides, and the Triton kernel uses ``div_rn``. The reproduction
multiplies by ``RN(1/448)`` exactly as that CUDA path does: about half of all bfloat16 amax values then get another
float32 scale (one ulp off the correctly rounded quotient, the float64 oracle's), and a block's codes change with
it. The fix is on the torch side: the rules divide by :func:`~megatron_fp8.quant.formats.fp8_max_on` (a tensor on
``amax``'s device), which CUDA divides correctly; the structural test below checks, on the ``meta`` device, that no
scale rule divides by a CPU scalar any more (``test_gpu_torch_backend_on_cuda_gives_the_cpu_bytes`` checks the bytes
on a GPU).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_fp8.quant import quantize_blockwise
from megatron_fp8.quant.formats import MIN_SCALE, SCALE_RULES, fp8_max_on
from megatron_fp8.quant.grouped import _fp32_scale_
from megatron_fp8.quant.reference import quantize_blockwise_reference


def _every_bf16_amax() -> torch.Tensor:
    """Every positive finite bfloat16 value, as float32 (a bf16 block's amax is one of them)."""
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return bits.float()


def _cuda_scalar_division(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` as PyTorch's CUDA kernel computes it for a CPU-scalar divisor: ``amax * RN(1/448)``."""
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32)
    return amax * inv


def test_the_reciprocal_multiply_is_not_the_correctly_rounded_division():
    amax = _every_bf16_amax()
    exact = (amax.double() / 448).float()  # float64 quotient rounded once to float32: correctly rounded
    off = _cuda_scalar_division(amax) != exact
    assert 0.4 < off.float().mean().item() < 0.6, off.float().mean().item()
    ulps = (_cuda_scalar_division(amax)[off].view(torch.int32) - exact[off].view(torch.int32)).abs()
    assert int(ulps.max()) == 1  # one float32 ulp, never more
    for rule in (SCALE_RULES["fp32"], _fp32_scale_):  # the CPU rules divide: the correctly rounded scale
        assert torch.equal(rule(amax), exact.clamp_min(MIN_SCALE))


def test_one_ulp_of_scale_changes_the_codes_of_the_block():
    """A block whose amax is off: the CUDA-scalar scale gives other FP8 bytes than the oracle (and than Triton)."""
    amax = _every_bf16_amax()
    off = amax[(_cuda_scalar_division(amax) != (amax.double() / 448).float()) & (amax > 1e-3) & (amax < 1e3)]
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(64, 128, 128, generator=g) * 2 - 1) * off[:: max(1, off.numel() // 64)][:64, None, None]
    x = x.to(torch.bfloat16).float()
    x[:, 0, 0] = off[:: max(1, off.numel() // 64)][:64]  # the block's amax, exactly
    x = x.reshape(64 * 128, 128)
    q_ref, s_ref = quantize_blockwise_reference(x)
    q, s = quantize_blockwise(x, backend="torch")
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    bad_scale = _cuda_scalar_division(x.view(64, 128, 128).abs().amax(dim=(1, 2)))[:, None]
    q_bad = (x.view(64, 128 * 128) / bad_scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(64 * 128, 128)
    assert (bad_scale != s_ref).all()
    assert not torch.equal(q_bad.view(torch.uint8), q_ref.view(torch.uint8))


class _Divisors(TorchDispatchMode):
    """Records the divisor of every ``div`` the code under it dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.divisors: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("div", "div_"):
            self.divisors.append(args[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rule", ["fp32", "ue8m0", "grouped_fp32"])
def test_no_scale_rule_divides_by_a_cpu_scalar(rule):
    """On the meta device (as on CUDA) every divisor of the rule is a tensor on that device, not a CPU scalar."""
    fn = _fp32_scale_ if rule == "grouped_fp32" else SCALE_RULES[rule]
    amax = torch.rand(8, device="meta")
    with _Divisors() as mode:
        fn(amax)
    assert mode.divisors, "the rule divides"
    for d in mode.divisors:
        assert isinstance(d, torch.Tensor) and d.device == amax.device, f"{rule}: divides by {d!r}"
    assert fp8_max_on("meta") is fp8_max_on(torch.device("meta")) and fp8_max_on("cpu").item() == 448.0
