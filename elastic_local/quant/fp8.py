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
from ..model.linear import PANEL, Panels
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

    def cpu_layout(self) -> FP8Panels:
        """This weight in column panels (FP8Panels), for a CPU load where the kernels run: its codes as bytes
        in model.linear.Panels' layout (the last panel padded with zero codes)."""
        return FP8Panels(Panels.of(self.weight.view(torch.uint8)).p, self.weight_scale, self.input_scale, 0,
                         self.shape[0])


def _rows(p: Tensor, r0: int, r1: int) -> Tensor:
    """Code rows [r0, r1) ([.., r1 - r0, in] bytes, a copy) of panels p [.., panels, in, 24]."""
    return p.transpose(-1, -2).flatten(-3, -2)[..., r0:r1, :]


@dataclass(eq=False)
class FP8Panels(FP8Weight):
    """An FP8 weight as a CPU load with the kernels keeps it: its e4m3 codes in column panels (`cpu_layout`),
    `weight` uint8 [panels, in, 24], the view's `n` outputs starting `skip` columns into its first panel,
    as model.linear.Panels keeps float weights.

    Why: a budget's view of [out, in] rows is each row's first inputs, a stride apart, and a CPU streams
    those from memory slower than contiguous bytes (likely its prefetchers fetching past each row's end):
    at 448 of 768 inputs a rows product ran 1.39x (one thread) and 1.51x (two) slower per weight than in
    panels, where a view is one contiguous run per panel (scratch, 80 weights of 768x768 cycled); gen16's
    small budget decodes 1.07-1.21x faster in panels (docs/decode-speed.md, "FP8 codes in column panels").
    The one-row decode needs no horizontal sum per output."""

    skip: int = 0
    n: int = 0

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.weight.shape[-2]))

    def _slice(self, r0: int, r1: int, cols: int) -> FP8Panels:
        first = self.skip + r0
        p = self.weight[..., first // PANEL:-(-(self.skip + r1) // PANEL), :cols, :]
        return FP8Panels(p, self.weight_scale, self.input_scale, first % PANEL, r1 - r0)

    def _dequantize_rows(self, r0: int, r1: int, dtype: torch.dtype) -> Tensor:
        return dequantize_fp8(_rows(self.weight, self.skip + r0, self.skip + r1), self.weight_scale, dtype)

    @classmethod
    def dequantize_picked(cls, stacked: dict[str, Tensor], pick: Tensor, rows: int, cols: int,
                          dtype: torch.dtype) -> Tensor:
        codes = _rows(stacked["weight"][pick][..., :cols, :], 0, rows)
        return dequantize_fp8(codes, stacked["weight_scale"][pick], dtype)

    def _scaled_mm(self, device: torch.device):
        return None  # a CPU layout: never the GPU kernel

    def _cpu_linear(self, x: Tensor) -> Tensor:
        return gemv.fp8_panels(x, self.weight, self.skip, self.n, self.weight_scale.item())

    def step_weight(self) -> step.Weight:
        p = self.weight
        return step.Weight(step.PANELS_FP8, self.n, p.shape[-2], p.stride(0), 0, p.data_ptr(), None,
                           self.weight_scale.item(), self.skip)

    def cpu_layout(self) -> FP8Panels:
        return self
