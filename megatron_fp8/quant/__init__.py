"""Bit-exact FP8 quantization in the formats vLLM and DeepGEMM load (DESIGN.md).

CUDA tensors go through Triton kernels, CPU tensors through torch; both produce
the same bytes. See :mod:`megatron_fp8.quant.formats` for the rules.
"""

from megatron_fp8.exports import lazy_exports

_EXPORTS = {  # exported name -> the module that defines it (resolved on first use: megatron_fp8.exports)
    "blockwise_scale_shape": "megatron_fp8.quant.blockwise",
    "dequantize_blockwise": "megatron_fp8.quant.blockwise",
    "expand_block_scales": "megatron_fp8.quant.blockwise",
    "quantize_blockwise": "megatron_fp8.quant.blockwise",
    "FP8_DTYPE": "megatron_fp8.quant.formats",
    "FP8_MAX": "megatron_fp8.quant.formats",
    "SCALE_FORMATS": "megatron_fp8.quant.formats",
    "SCALE_RULES": "megatron_fp8.quant.formats",
    "is_pow2": "megatron_fp8.quant.formats",
    "scale_from_amax": "megatron_fp8.quant.formats",
    "dequantize_per_channel": "megatron_fp8.quant.tensorwise",
    "dequantize_tensorwise": "megatron_fp8.quant.tensorwise",
    "quantize_per_channel": "megatron_fp8.quant.tensorwise",
    "quantize_tensorwise": "megatron_fp8.quant.tensorwise",
    "dequantize_per_token_group": "megatron_fp8.quant.token_group",
    "quantize_per_token_group": "megatron_fp8.quant.token_group",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
