"""NVFP4 in NVIDIA Model Optimizer's layout, bit-exact with modelopt's `NVFP4QTensor.quantize`.

`weight` packs two E2M1 codes per byte (low nibble = first element), `weight_scale` holds one e4m3
scale per 16 inputs (plain row-major), `weight_scale_2` one fp32 scale per tensor: vLLM and
TensorRT-LLM read exactly this. Every scale depends only on its own row block and the shared per-tensor
scale, so a prefix of the packed bytes and block scales is the quantized prefix of the weight, which is
what keeps nested sub-models nested (input cuts must be multiples of 16).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from ..model import gemv, step
from ..model.cost import NATIVE_CAPABILITY
from .linear import TILE_ELEMENTS, QuantizedWeight, e4m3_values, expert_offsets, finite_amax, to_blocked

BLOCK = 16
E2M1_MAX, E4M3_MAX = 6.0, 448.0
# Indexed by code = sign << 3 | magnitude index; like modelopt, code 8 (negative zero) decodes to +0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@functools.cache
def _byte_values(device: torch.device) -> Tensor:
    """[256, 2] fp32: the two values a packed byte decodes to, low nibble first."""
    values, byte = torch.tensor(E2M1_VALUES), torch.arange(256)
    return torch.stack((values[byte & 15], values[byte >> 4]), -1).to(device)


def quantize_blocks(x: Tensor, scale_2: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., k] -> (uint8 [..., k/2], e4m3 [..., k/16]): modelopt's dynamic NVFP4, op for op, in fp32."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    scale = blocks.abs().amax(-1) / (E2M1_MAX * scale_2)
    scale = scale.masked_fill(scale == 0, 1.0)  # modelopt gives an all-zero block scale 1, not 0
    scale = scale.clamp(2**-9, E4M3_MAX).to(torch.float8_e4m3fn)  # 2**-9: e4m3's smallest subnormal
    scaled = blocks / (scale.float() * scale_2).unsqueeze(-1)
    mag = scaled.abs()
    # The nearest E2M1 magnitude's index is the number of midpoints below |x|. On a midpoint (a tie) the
    # even code wins: the lower neighbour at 0.25, 1.25, 2.5, 5, the upper one at 0.75, 1.75, 3.5.
    # Beyond 5 everything is 6 (saturation). Same codes as modelopt's searchsorted, several times faster.
    index = torch.zeros_like(mag, dtype=torch.uint8)
    for mid in (0.25, 1.25, 2.5, 5.0):
        index += mag > mid
    for mid in (0.75, 1.75, 3.5):
        index += mag >= mid
    codes = (index | (scaled < 0).to(torch.uint8) << 3).flatten(-2)
    return codes[..., 0::2] | codes[..., 1::2] << 4, scale


def round_to_nvfp4(x: Tensor, input_scale: Tensor | None) -> Tensor:
    """x [.., k] with each row rounded to NVFP4 and back, as W4A4 feeds a product: per-16 e4m3 scales under
    `input_scale`, or where that is None under the row's own amax / (6 * 448); values in float32."""
    xf = x.float()
    if input_scale is None:
        scale_2 = (xf.abs().amax(-1, keepdim=True) / (E2M1_MAX * E4M3_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
    else:
        scale_2 = input_scale.to(x.device, torch.float32).reshape(())
    packed, scales = quantize_blocks(xf, scale_2)
    codes = torch.stack((packed & 15, packed >> 4), -1).flatten(-2).long()
    values = torch.tensor(E2M1_VALUES, device=x.device)[codes].unflatten(-1, (-1, BLOCK))
    unit = scales.float() * scale_2  # a row's scale_2 [.., 1] meets its blocks [.., k / 16]
    return (values * unit.unsqueeze(-1)).flatten(-2)


def quantize_nvfp4(w: Tensor, weight_scale_2: Tensor | None = None, name: str = "weight") -> NVFP4Weight:
    """Quantize a [out, in] weight (in % 16 == 0); `weight_scale_2` defaults to amax / (6 * 448).

    Pass `weight_scale_2` to share one per-tensor scale across tensors (e.g. fused projections).
    """
    if w.ndim != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"{name}: NVFP4 needs a [out, in] weight with in % {BLOCK} == 0, got {tuple(w.shape)}")
    amax = finite_amax(w, name)
    if weight_scale_2 is None:
        scale_2 = amax.float() / (E2M1_MAX * E4M3_MAX)
    else:
        scale_2 = weight_scale_2.to(w.device, torch.float32).reshape(())
        if not (torch.isfinite(scale_2) and scale_2 > 0):
            raise ValueError(f"{name}: weight_scale_2 must be finite and positive, got {scale_2.item()}")
    out, k = w.shape
    if scale_2 == 0:  # all-zero weight: modelopt would compute 0/0; store exact zeros instead
        scales = torch.ones(out, k // BLOCK, device=w.device).to(torch.float8_e4m3fn)
        return NVFP4Weight(w.new_zeros(out, k // 2, dtype=torch.uint8), scales, scale_2)
    packed, scales = zip(*(quantize_blocks(rows, scale_2) for rows in w.split(max(1, TILE_ELEMENTS // k))))
    return NVFP4Weight(torch.cat(packed), torch.cat(scales), scale_2)


def dequantize_nvfp4(weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor, dtype: torch.dtype) -> Tensor:
    """Packed [out, in/2] -> [out, in] in `dtype`, bit-exact with modelopt's dequantize.

    Each element is e2m1 * (e4m3 * weight_scale_2) in fp32, rounded once to `dtype`. Only 256 x 256
    (block scale, byte) pairs exist, so a 256 KiB table of them makes dequantization a single gather.
    `weight_scale_2`: a scalar, or one per leading index of a stack of weights ([n] for [n, out, in/2]:
    one table each).
    """
    device, scales_2 = weight.device, weight_scale_2.reshape(-1, 1)
    block_scales = e4m3_values(device) * scales_2  # [1 or n, 256]
    tables = (_byte_values(device) * block_scales[:, :, None, None]).to(dtype).flatten(0, 2)  # [.. x 65536, 2]
    index = (weight_scale.view(torch.uint8).int() << 8).unsqueeze(-1) | weight.unflatten(-1, (-1, BLOCK // 2))
    if len(scales_2) > 1:
        index += expert_offsets(len(scales_2), 1 << 16, device).view(-1, *[1] * (index.dim() - 1))
    return tables.index_select(0, index.flatten()).view(*weight.shape[:-1], -1)


@dataclass(eq=False)
class NVFP4Weight(QuantizedWeight):
    weight: Tensor  # uint8 [out, in/2]
    weight_scale: Tensor  # float8_e4m3fn [out, in/16]
    weight_scale_2: Tensor  # fp32 scalar
    input_scale: Tensor | None = None  # fp32 scalar: calibrated activation amax / (6 * 448)
    # W4A4 where no block-scaled kernel runs (a CPU, a GPU before Blackwell): each input row rounded to NVFP4
    # before the product (load(activations="nvfp4")); the block-scaled kernel always rounds them
    quantize_inputs: bool = False
    _blocked_scale: Tensor | None = field(default=None, init=False, repr=False)  # swizzled once, on first use

    fast_kernel: ClassVar[str] = "scaled_mm_nvfp4"
    min_capability: ClassVar[tuple[int, int]] = NATIVE_CAPABILITY["nvfp4"]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.weight.shape[0], 2 * self.weight.shape[1]))

    def _slice(self, r0: int, r1: int, cols: int) -> NVFP4Weight:
        if cols % BLOCK:
            raise ValueError(f"NVFP4 input cut {cols} is not a multiple of {BLOCK} (the scale block)")
        w, s = self.weight[r0:r1, : cols // 2], self.weight_scale[r0:r1, : cols // BLOCK]
        return NVFP4Weight(w, s, self.weight_scale_2, self.input_scale, self.quantize_inputs)

    def _dequantize_rows(self, r0: int, r1: int, dtype: torch.dtype) -> Tensor:
        return dequantize_nvfp4(self.weight[r0:r1], self.weight_scale[r0:r1], self.weight_scale_2, dtype)

    @classmethod
    def dequantize_picked(cls, stacked: dict[str, Tensor], pick: Tensor, rows: int, cols: int,
                          dtype: torch.dtype) -> Tensor:
        if cols % BLOCK:
            raise ValueError(f"NVFP4 input cut {cols} is not a multiple of {BLOCK} (the scale block)")
        codes = stacked["weight"][:, :rows, : cols // 2][pick]
        scales = stacked["weight_scale"].view(torch.uint8)[:, :rows, : cols // BLOCK][pick]  # bytes, as fp8's
        return dequantize_nvfp4(codes, scales, stacked["weight_scale_2"][pick], dtype)

    def _kernel_fits(self) -> bool:
        out, k = self.shape
        return out % 16 == 0 and k % 32 == 0

    def _fast_linear(self, x: Tensor, scaled_mm) -> Tensor:
        # Activations get the weight's treatment: per-16 e4m3 scales under one float scale, the calibrated
        # input_scale or each row's own (as round_to_nvfp4, the CPU's W4A4: a row never depends on its batch)
        scale_2 = self.input_scale
        if scale_2 is None:
            amax = x.abs().amax(-1, keepdim=True).float()
            scale_2 = (amax / (E2M1_MAX * E4M3_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
        xq, xs = quantize_blocks(x, scale_2)
        if self._blocked_scale is None:
            self._blocked_scale = to_blocked(self.weight_scale)
        fp4 = torch.float4_e2m1fn_x2
        out = scaled_mm(
            xq.view(fp4),
            self.weight.view(fp4).t(),
            scale_a=to_blocked(xs),
            scale_b=self._blocked_scale,
            out_dtype=torch.bfloat16,
        )
        return (out.float() * (scale_2 * self.weight_scale_2)).to(x.dtype)

    def round_inputs(self, x: Tensor) -> Tensor:
        # rounded for W4A4, and wherever the block-scaled kernel runs: it rounds this weight's other products'
        if self.quantize_inputs or self._scaled_mm(x.device) is not None:
            return round_to_nvfp4(x, self.input_scale).to(x.dtype)
        return x

    def linear(self, x: Tensor) -> Tensor:
        if self.quantize_inputs and self._scaled_mm(x.device) is None and not gemv.usable(x, gemv.MAX_PACKED_ROWS):
            x = round_to_nvfp4(x, self.input_scale).to(x.dtype)  # the dequantizing path (the kernels round their own)
        return super().linear(x)

    def _input_scale(self) -> float:
        return 0.0 if self.input_scale is None else self.input_scale.item()

    def _cpu_linear(self, x: Tensor) -> Tensor:
        codes, scales, scale = self.weight, self.weight_scale.view(torch.uint8), self.weight_scale_2.item()
        if self.quantize_inputs:
            return gemv.nvfp4_a4(x, codes, scales, scale, self._input_scale())
        return gemv.nvfp4(x, codes, scales, scale)

    def step_weight(self) -> step.Weight:
        fmt = step.NVFP4_A4 if self.quantize_inputs else step.NVFP4
        return step.packed(fmt, self.weight, self.weight_scale.view(torch.uint8), self.weight_scale_2.item(),
                           self.shape[1], self._input_scale())
