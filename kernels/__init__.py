"""Low-precision MoE kernels: MXFP8 / NVFP4 / DeepSeek FP8 numerics (pure jnp, bit-exact), a custom-VJP
quantized (grouped) linear with selectable recipes, grouped GEMMs (XLA fallback, Pallas, Mosaic, jax-triton)
behind a registry, and fused quantize + permute. See docs/kernels.md. Nothing here imports a GPU-only
module at import time; `kernels` imports nothing from `models`."""

from kernels.fp8_deepseek import (
    dequantize_fp8_blocks,
    dequantize_fp8_tiles,
    quantize_fp8_blocks,
    quantize_fp8_tiles,
)
from kernels.grouped_gemm import grouped_matmul, grouped_matmul_reference, grouped_matmul_xla
from kernels.mxfp8 import MXTensor, dequantize_mx, quantize_mx
from kernels.nvfp4 import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4
from kernels.permute import permute_quantize_mx
from kernels.qlinear import RECIPES, Recipe, get_recipe, quantized_grouped_linear, quantized_linear

__all__ = [
    "MXTensor", "NVFP4Tensor", "RECIPES", "Recipe", "dequantize_fp8_blocks", "dequantize_fp8_tiles",
    "dequantize_mx", "dequantize_nvfp4", "get_recipe", "grouped_matmul", "grouped_matmul_reference",
    "grouped_matmul_xla", "permute_quantize_mx", "quantize_fp8_blocks", "quantize_fp8_tiles", "quantize_mx",
    "quantize_nvfp4", "quantized_grouped_linear", "quantized_linear",
]
