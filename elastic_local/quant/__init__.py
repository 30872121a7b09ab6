"""FP8 and NVFP4 weights in NVIDIA Model Optimizer's checkpoint layout, and the runtime that uses them.

`scheme` (what a precision stores, and its bytes) imports without torch, for the planner; the weights on
first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports

if TYPE_CHECKING:
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
__getattr__, __dir__ = exports(__name__, {
    "FP8Weight": ".fp8", "dequantize_fp8": ".fp8", "quantize_fp8": ".fp8", "QuantizedWeight": ".linear",
    "NVFP4Weight": ".nvfp4", "dequantize_nvfp4": ".nvfp4", "quantize_nvfp4": ".nvfp4"})
