"""Bit-exact FP8 quantization in the formats vLLM and DeepGEMM load (DESIGN.md).

CUDA tensors go through Triton kernels, CPU tensors through torch; both produce
the same bytes. See :mod:`megatron_fp8.quant.formats` for the rules.
"""

from megatron_fp8.quant.blockwise import (
    blockwise_scale_shape,
    dequantize_blockwise,
    expand_block_scales,
    quantize_blockwise,
)
from megatron_fp8.quant.formats import FP8_DTYPE, FP8_MAX, SCALE_FORMATS, SCALE_RULES, is_pow2, scale_from_amax
from megatron_fp8.quant.tensorwise import (
    dequantize_per_channel,
    dequantize_tensorwise,
    quantize_per_channel,
    quantize_tensorwise,
)
from megatron_fp8.quant.token_group import dequantize_per_token_group, quantize_per_token_group

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "SCALE_FORMATS",
    "SCALE_RULES",
    "blockwise_scale_shape",
    "dequantize_blockwise",
    "dequantize_per_channel",
    "dequantize_per_token_group",
    "dequantize_tensorwise",
    "expand_block_scales",
    "is_pow2",
    "quantize_blockwise",
    "quantize_per_channel",
    "quantize_per_token_group",
    "quantize_tensorwise",
    "scale_from_amax",
]
