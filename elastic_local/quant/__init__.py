"""FP8 and NVFP4 weights in NVIDIA Model Optimizer's checkpoint layout, and the runtime that uses them."""

from .fp8 import FP8Weight, dequantize_fp8, quantize_fp8
from .linear import QuantizedWeight
from .nvfp4 import NVFP4Weight, dequantize_nvfp4, quantize_nvfp4

__all__ = [
    "FP8Weight",
    "NVFP4Weight",
    "QuantizedWeight",
    "dequantize_fp8",
    "dequantize_nvfp4",
    "quantize_fp8",
    "quantize_nvfp4",
]
