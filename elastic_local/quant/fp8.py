"""Per-tensor FP8 (E4M3) in NVIDIA Model Optimizer's layout, bit-exact with modelopt.

`weight` is float8_e4m3fn and `weight_scale` = amax / 448 in fp32, what modelopt's HF export writes.
modelopt computes the codes as `(w / weight_scale).to(float8_e4m3fn)`, which for bf16/fp16 weights
divides in the weight's dtype and so rounds twice; on CUDA torch even rounds the fp32 scale to bf16
first. We divide in fp32 and round through the weight's dtype: modelopt-on-CPU's codes, on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..model import gemv, step
from ..model.cost import NATIVE_CAPABILITY
from .linear import QuantizedWeight, e4m3_values, expert_offsets, finite_amax

E4M3_MAX = 448.0


def quantize_fp8(w: Tensor, name: str = "weight", weight_scale: Tensor | None = None) -> FP8Weight:
    """Quantize a [out, in] weight with one fp32 scale (its own, or a given one: a slice quantized with its
    parent's scale equals the slice of the quantized parent)."""
    amax = finite_amax(w, name)
    # the scale lives with the codes: `_scaled_mm` takes every operand from one device
    scale = amax.float() / E4M3_MAX if weight_scale is None else weight_scale.to(w.device, torch.float32)
    if scale == 0:  # all-zero weight: modelopt would compute 0/0; store exact zeros instead
        return FP8Weight(torch.zeros_like(w, dtype=torch.float8_e4m3fn), scale)
    return FP8Weight((w.float() / scale).to(w.dtype).to(torch.float8_e4m3fn), scale)


def dequantize_fp8(weight: Tensor, weight_scale: Tensor, dtype: torch.dtype) -> Tensor:
    """One fp32 product per element, rounded once to `dtype`, looked up in a 256-entry table
    (torch's elementwise e4m3 cast is several times slower on CPUs). `weight_scale`: a scalar, or one per
    leading index of a stack of weights ([n] for [n, out, in]: one table each)."""
    scales = weight_scale.reshape(-1, 1)
    tables = (e4m3_values(weight.device) * scales).to(dtype)  # [1 or n, 256]
    index = weight.view(torch.uint8).int()
    if len(scales) > 1:
        index += expert_offsets(len(scales), 256, weight.device).view(-1, *[1] * (weight.dim() - 1))
    return tables.flatten().index_select(0, index.flatten()).view(weight.shape)


@dataclass(eq=False)
class FP8Weight(QuantizedWeight):
    weight: Tensor  # float8_e4m3fn [out, in]
    weight_scale: Tensor  # fp32 scalar
    input_scale: Tensor | None = None  # fp32 scalar: calibrated activation amax / 448

    fast_kernel: ClassVar[str] = "scaled_mm_fp8"
    min_capability: ClassVar[tuple[int, int]] = NATIVE_CAPABILITY["fp8"]

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def _slice(self, r0: int, r1: int, cols: int) -> FP8Weight:
        return FP8Weight(self.weight[r0:r1, :cols], self.weight_scale, self.input_scale)

    def _dequantize_rows(self, r0: int, r1: int, dtype: torch.dtype) -> Tensor:
        return dequantize_fp8(self.weight[r0:r1], self.weight_scale, dtype)

    @classmethod
    def dequantize_picked(cls, stacked: dict[str, Tensor], pick: Tensor, rows: int, cols: int,
                          dtype: torch.dtype) -> Tensor:
        codes = stacked["weight"].view(torch.uint8)[:, :rows, :cols][pick]  # bytes: no float8 indexing needed
        return dequantize_fp8(codes, stacked["weight_scale"][pick], dtype)

    def _kernel_fits(self) -> bool:
        out, k = self.shape
        return out % 16 == 0 and k % 16 == 0

    def _fast_linear(self, x: Tensor, scaled_mm) -> Tensor:
        # Per-tensor activation scale: the calibrated one, else this batch's amax.
        scale = self.input_scale
        if scale is None:
            scale = (x.abs().amax().float() / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        xq = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return scaled_mm(xq, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=x.dtype)

    def _cpu_linear(self, x: Tensor) -> Tensor:
        return gemv.fp8(x, self.weight.view(torch.uint8), self.weight_scale.item())

    def step_weight(self) -> step.Weight:
        return step.packed(step.FP8, self.weight.view(torch.uint8), None, self.weight_scale.item(), self.shape[1])
