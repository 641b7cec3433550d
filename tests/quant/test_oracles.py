"""Our quantizers against independent implementations (docs/oracles.md has the summary table).

* vLLM's own CPU-runnable helpers: DeepGEMM's ``per_block_cast_to_fp8`` (as vendored
  in ``vllm.utils.deep_gemm``), ``scaled_quantize`` and ``input_to_float8``;
* NVIDIA ModelOpt: ``FP8QTensor.quantize`` with 128x128 ``block_sizes`` (real
  quantization) and ``fp8_eager`` (fake quantization);
* a test-local transcription of DeepGEMM's published per-block formula;
* an independent e4m3 rounding (``reference.round_to_e4m3``) against torch's cast.

Where an oracle agrees bit for bit we assert equality; where it differs on purpose we
assert the exact documented difference.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_fp8.quant import (
    dequantize_blockwise,
    quantize_blockwise,
    quantize_per_token_group,
    quantize_tensorwise,
)
from megatron_fp8.quant.reference import round_to_e4m3

SHAPES = [(384, 512), (129, 257), (256, 128)]


def _ordered_codes(q: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes as integers ordered like the values (sign-magnitude -> two's complement)."""
    c = q.contiguous().view(torch.uint8).to(torch.int16)
    return torch.where(c >= 128, -(c - 128), c)


def _code_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 steps apart two fp8 tensors are, per element (+0 and -0 are 0 apart)."""
    return (_ordered_codes(a) - _ordered_codes(b)).abs()


def _inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.pow(2.0, torch.randint(-6, 6, (shape[0], 1), generator=g).to(torch.float32))
    return (torch.randn(shape, generator=g) * rows).to(dtype)


def _f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


# ------------------------------------------------------------ torch's e4m3 cast


def test_torch_fp8_cast_rounds_to_nearest_even_like_the_independent_rounding():
    """Every e4m3 value, every midpoint and the float32 neighbours of each midpoint."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn)
    vals = codes.to(torch.float64)
    vals = torch.unique(vals[torch.isfinite(vals)])  # sorted, -448 .. 448, one zero
    mids = (vals[1:] + vals[:-1]) / 2
    probes = torch.cat([vals, mids]).to(torch.float32)
    probes = torch.cat(
        [
            probes,
            torch.nextafter(probes, torch.full_like(probes, 1e9)),
            torch.nextafter(probes, torch.full_like(probes, -1e9)),
        ]
    )
    probes = probes[probes.abs() <= 448]
    ours = round_to_e4m3(probes.to(torch.float64))
    torch_cast = probes.to(torch.float8_e4m3fn).to(torch.float64)
    assert torch.equal(ours, torch_cast)
    # ties really go to even: 1.0625 is between 1.0 (mantissa 000) and 1.125 (001)
    assert round_to_e4m3(torch.tensor([1.0625, 1.1875], dtype=torch.float64)).tolist() == [1.0, 1.25]


# ------------------------------------------------------------ DeepGEMM formula (test-local)


def _deepgemm_per_block_cast(x: torch.Tensor, *, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's published ``per_block_cast_to_fp8``, transcribed from its description.

    Pad to multiples of 128 with zeros, view ``[n/128, 128, k/128, 128]``, amax over
    (1, 3) clamped at 1e-4, ``x * (448 / amax)`` cast to e4m3, scale ``amax / 448``;
    the UE8M0 variant rounds the scale up with ``2 ** ceil(log2(scale))`` and
    multiplies by its reciprocal.
    """
    n, k = x.shape
    pn, pk = -(-n // 128) * 128, -(-k // 128) * 128
    padded = torch.zeros((pn, pk), dtype=x.dtype)
    padded[:n, :k] = x
    view = padded.view(pn // 128, 128, pk // 128, 128)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    if ue8m0:
        sf = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
        q = (view * (1.0 / sf)).to(torch.float8_e4m3fn)
    else:
        sf = amax / 448.0
        q = (view * (448.0 / amax)).to(torch.float8_e4m3fn)
    return q.view(pn, pk)[:n, :k].contiguous(), sf.view(pn // 128, pk // 128)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepgemm_formula_fp32_scales(shape, dtype):
    x = _inputs(shape, dtype, seed=1)
    q, s = quantize_blockwise(x)
    dq, ds = _deepgemm_per_block_cast(x, ue8m0=False)
    assert torch.equal(s, ds), "amax/448 is the same float32 division when amax >= 1e-4"
    # x * (448/amax) rounds twice (the reciprocal, then the product) where we divide once:
    # the float32 quotients differ by a few ulps, which moves a value across an e4m3
    # rounding boundary only rarely, and then by one step.
    dist = _code_distance(q, dq)
    assert dist.max() <= 1
    assert dist.float().mean() < 0.01


@pytest.mark.parametrize("shape", SHAPES)
def test_deepgemm_formula_ue8m0_agrees_away_from_powers_of_two(shape):
    x = _inputs(shape, torch.bfloat16, seed=2)
    q, s = quantize_blockwise(x, scale_format="ue8m0")
    dq, ds = _deepgemm_per_block_cast(x, ue8m0=True)
    assert torch.equal(s, ds)
    assert torch.equal(q.view(torch.uint8), dq.view(torch.uint8))  # pow2 scale: multiply == divide


def test_deepgemm_ue8m0_log2_rounds_down_just_above_a_power_of_two():
    """float32 log2 of 16 * (1 + 2**-23) rounds to exactly 4.0: DeepGEMM picks 16, we pick 32.

    Their scale is then *below* amax/448, so the block maximum maps to 448.00006,
    which the e4m3 cast rounds to 448 (within rounding, not clamped). Ours derives
    the exponent from the float32 bits and never rounds the scale down.
    """
    x = torch.zeros(128, 128)
    x[0, 0] = 448.0 * 16 * (1 + 2**-23)
    q, s = quantize_blockwise(x, scale_format="ue8m0")
    dq, ds = _deepgemm_per_block_cast(x, ue8m0=True)
    assert s.item() == 32.0 and ds.item() == 16.0
    assert q[0, 0].to(torch.float32).item() == 224.0 and dq[0, 0].to(torch.float32).item() == 448.0


def test_deepgemm_zero_and_tiny_blocks_use_the_1e4_floor():
    x = torch.zeros(256, 128)
    x[128:, :] = 1e-6  # amax below DeepGEMM's 1e-4 floor
    q, s = quantize_blockwise(x)
    dq, ds = _deepgemm_per_block_cast(x, ue8m0=False)
    floor = _f32(_f32(1e-4) / 448.0)
    assert s[0, 0].item() == 1.0 and ds[0, 0].item() == floor  # zero block: 1.0 vs 1e-4/448
    assert torch.equal(q[:128].view(torch.uint8), dq[:128].view(torch.uint8))  # both all zero codes
    assert s[1, 0].item() == _f32(_f32(1e-6) / 448.0) and ds[1, 0].item() == floor
    # ours maps the tiny block to full range (448); DeepGEMM's floor leaves it at 1e-6 / (1e-4/448)
    assert q[128, 0].to(torch.float32).item() == 448.0
    assert dq[128, 0].to(torch.float32).item() == round_to_e4m3(torch.tensor([4.48], dtype=torch.float64)).item()


# ------------------------------------------------------------ vLLM's helpers


@pytest.fixture(scope="module")
def vllm_helpers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.model_executor.layers.quantization.utils.fp8_utils import input_to_float8
        from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, scaled_quantize
        from vllm.utils import deep_gemm
    # per_block_cast_to_fp8 is wrapped in torch.compile; the eager original is the oracle
    # (compiling on CPU would take minutes and computes the same thing).
    per_block = getattr(deep_gemm.per_block_cast_to_fp8, "_torchdynamo_orig_callable", None)
    if per_block is None:
        per_block = deep_gemm.per_block_cast_to_fp8
    return {
        "per_block_cast_to_fp8": per_block,
        "scaled_quantize": scaled_quantize,
        "GroupShape": GroupShape,
        "input_to_float8": input_to_float8,
    }


@pytest.mark.parametrize("shape", SHAPES)
def test_vllm_per_block_cast_fp32_input_bit_exact(vllm_helpers, shape):
    x = _inputs(shape, torch.float32, seed=3)
    q, s = quantize_blockwise(x)
    vq, vs = vllm_helpers["per_block_cast_to_fp8"](x, [128, 128])
    assert torch.equal(s, vs)
    # vLLM multiplies by 1/sf; with float32 input and these data the codes agree exactly,
    # and in general they can be at most one e4m3 step apart
    assert _code_distance(q, vq).max() <= 1
    assert _code_distance(q, vq).float().mean() < 0.01


@pytest.mark.parametrize("shape", SHAPES)
def test_vllm_per_block_cast_bf16_and_ue8m0(vllm_helpers, shape):
    x = _inputs(shape, torch.bfloat16, seed=4)
    q, s = quantize_blockwise(x)
    vq, vs = vllm_helpers["per_block_cast_to_fp8"](x, [128, 128])
    assert torch.equal(s, vs)
    assert _code_distance(q, vq).max() <= 1  # x * (1/sf): one extra rounding of the reciprocal
    qu, su = quantize_blockwise(x, scale_format="ue8m0")
    vqu, vsu = vllm_helpers["per_block_cast_to_fp8"](x, [128, 128], use_ue8m0=True)
    assert torch.equal(su, vsu)
    assert torch.equal(qu.view(torch.uint8), vqu.view(torch.uint8))


def test_vllm_ue8m0_scale_rounding_down_case(vllm_helpers):
    x = torch.zeros(128, 128)
    x[0, 0] = 448.0 * 16 * (1 + 2**-23)
    _, s = quantize_blockwise(x, scale_format="ue8m0")
    _, vs = vllm_helpers["per_block_cast_to_fp8"](x, [128, 128], use_ue8m0=True)
    assert s.item() == 32.0 and vs.item() == 16.0  # same log2 rounding as DeepGEMM (see above)


@pytest.mark.parametrize("group_shape", [(128, 128), (1, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_scaled_quantize_reciprocal_scale(vllm_helpers, group_shape, dtype):
    """vLLM's ``scaled_quantize`` computes ``448/amax``, multiplies, and returns its reciprocal.

    The returned scale is ``1 / float32(448 / amax)``: within 2 float32 ulps of our
    ``amax / 448`` (two roundings); codes at most one e4m3 step apart.
    """
    x = _inputs((256, 384), dtype, seed=5)
    gs = vllm_helpers["GroupShape"](*group_shape)
    vq, vs = vllm_helpers["scaled_quantize"](x, gs, torch.float8_e4m3fn, compute_dtype=torch.float32)
    if group_shape == (1, 128):
        q, s = quantize_per_token_group(x)
    else:
        q, s = quantize_blockwise(x)
    vs = vs.reshape(s.shape)
    amax = s.to(torch.float64) * 448  # s = float32(amax/448), so this is amax to ~2**-24
    expected = (1.0 / (448.0 / amax.to(torch.float32))).to(torch.float32)
    rel = ((vs.to(torch.float64) - s.to(torch.float64)).abs() / s.to(torch.float64)).max().item()
    assert rel <= 2.0**-22, f"scaled_quantize scale is {rel * 2**23:.2f} ulps from amax/448"
    assert ((vs - expected).abs() <= expected * 2.0**-22).all()
    dist = _code_distance(q, vq)
    assert dist.max() <= 1 and dist.float().mean() < 0.01


def test_vllm_input_to_float8_tensorwise(vllm_helpers):
    x = _inputs((64, 300), torch.float32, seed=6)
    q, s = quantize_tensorwise(x)
    vq, vs = vllm_helpers["input_to_float8"](x, torch.float8_e4m3fn)
    assert abs(vs.item() - s.item()) <= s.item() * 2.0**-22
    assert _code_distance(q, vq).max() <= 1
    # bfloat16 input: vLLM computes 448/amax in bfloat16, so its scale is the reciprocal of a
    # bfloat16-rounded number (up to 2**-9 relative away from ours)
    xb = x.to(torch.bfloat16)
    _, sb = quantize_tensorwise(xb)
    _, vsb = vllm_helpers["input_to_float8"](xb, torch.float8_e4m3fn)
    amax_b = xb.abs().max()
    assert vsb.item() == (torch.tensor(448.0, dtype=torch.bfloat16) / amax_b).float().reciprocal().item()
    assert abs(vsb.item() - sb.item()) <= sb.item() * 2.0**-8


# ------------------------------------------------------------ NVIDIA ModelOpt


@pytest.fixture(scope="module")
def modelopt_fp8():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor
        from modelopt.torch.quantization.tensor_quant import fp8_eager
    return FP8QTensor, fp8_eager


@pytest.mark.parametrize("shape", SHAPES)
def test_modelopt_block_quantizer_fp32_bit_exact(modelopt_fp8, shape):
    fp8qtensor, _ = modelopt_fp8
    x = _inputs(shape, torch.float32, seed=7)
    q, s = quantize_blockwise(x)
    mq, ms = fp8qtensor.quantize(x, block_sizes={-1: 128, -2: 128})
    assert torch.equal(ms, s)
    assert torch.equal(mq._quantized_data.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(
        mq.dequantize(torch.float32, scale=ms, block_sizes={-1: 128, -2: 128}), dequantize_blockwise(q, s)
    )


def test_modelopt_block_quantizer_bf16_keeps_input_dtype(modelopt_fp8):
    """For bf16 input ModelOpt computes ``amax / 448`` in bfloat16: its scale is ours rounded to bf16."""
    fp8qtensor, _ = modelopt_fp8
    x = _inputs((384, 512), torch.bfloat16, seed=8)
    q, s = quantize_blockwise(x)
    mq, ms = fp8qtensor.quantize(x, block_sizes={-1: 128, -2: 128})
    assert ms.dtype == torch.bfloat16 and torch.equal(ms, s.to(torch.bfloat16))
    # quantizing the float32 upcast instead gives our bytes exactly
    mq32, ms32 = fp8qtensor.quantize(x.float(), block_sizes={-1: 128, -2: 128})
    assert torch.equal(ms32, s) and torch.equal(mq32._quantized_data.view(torch.uint8), q.view(torch.uint8))


def test_modelopt_zero_block_gives_nan_where_ours_gives_scale_one(modelopt_fp8):
    fp8qtensor, _ = modelopt_fp8
    x = torch.randn(256, 128)
    x[:128] = 0
    q, s = quantize_blockwise(x)
    mq, ms = fp8qtensor.quantize(x, block_sizes={-1: 128, -2: 128})
    assert ms[0, 0].item() == 0.0 and s[0, 0].item() == 1.0
    assert torch.isnan(mq._quantized_data[:128].to(torch.float32)).all()  # 0 / 0
    assert (q[:128].view(torch.uint8) == 0).all()
    assert torch.equal(mq._quantized_data[128:].view(torch.uint8), q[128:].view(torch.uint8))


def test_modelopt_fake_quant_matches_dequantized_values(modelopt_fp8):
    """ModelOpt's CPU fake quant (``x * 448/amax`` -> e4m3 -> ``* (1 / (448/amax))``) vs ``q * amax/448``."""
    _, fp8_eager = modelopt_fp8
    x = _inputs((256, 384), torch.float32, seed=9)
    q, s = quantize_blockwise(x)
    amax = x.view(2, 128, 3, 128).abs().amax(dim=(1, 3), keepdim=True)
    fake = fp8_eager(x.view(2, 128, 3, 128), amax).view(256, 384)
    ours = dequantize_blockwise(q, s)
    rel = (fake.double() - ours.double()).abs() / ours.double().abs().clamp_min(1e-30)
    same_code = rel <= 2.0**-21  # equal codes; scales 1/(448/amax) vs amax/448 within 2 ulps
    step = dequantize_blockwise(torch.ones_like(q, dtype=torch.float32).to(torch.float8_e4m3fn), s).double()
    v = x.double() / step
    _, e = torch.frexp(v.abs())
    spacing = torch.ldexp(torch.ones_like(v), torch.clamp(e - 1, min=-6) - 3) * step
    assert ((fake.double() - ours.double()).abs() <= spacing * (1 + 2.0**-20)).all()
    assert same_code.float().mean() > 0.99
