"""Runtime for quantized Linear weights: the packed bytes stay resident, each matmul picks its path.

FP8 runs on `torch._scaled_mm` on compute capability 8.9+, NVFP4 on torch's block-scaled `_scaled_mm`
on Blackwell (10.0+) (model/cost.py holds the gates, model/kernels.py the kernel and the device's
capability). On x86 CPUs, inputs of up to a prefill chunk take model/gemv.c's kernels, which decode the
packed bytes in registers (one row of x) or into panels that register tiles run over (several). Everything
else (older GPUs, longer CPU inputs) dequantizes a tile of output rows at a time inside the matmul: the
memory saving stays, the speed-up does not, and no full-precision copy of the weight is ever held.
Elastic sub-models cut prefix blocks out of the packed tensors as views.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model import gemv, kernels

TILE_ELEMENTS = 1 << 22  # weight elements dequantized at once on the fallback path (16 MiB in fp32)
DEQUANT_KERNEL = "dequant_matmul"
CPU_KERNEL = "cpu_gemv"  # model/gemv.c, for inputs of up to gemv.MAX_PACKED_ROWS rows


def finite_amax(w: Tensor, name: str) -> Tensor:
    """max |w|, refusing NaN/Inf: a single bad value would silently poison every scale."""
    lo, hi = torch.aminmax(w)
    amax = torch.maximum(-lo, hi)
    if not torch.isfinite(amax):
        nan, inf = int(w.isnan().sum()), int(w.isinf().sum())
        raise ValueError(f"{name}: cannot quantize a tensor holding {nan} NaN and {inf} Inf values")
    return amax


def e4m3_values(device: torch.device) -> Tensor:
    """[256] fp32: the value of every e4m3 byte (only a cast of these 256 touches a float8 dtype)."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).float()


def expert_offsets(n: int, entries: int, device: torch.device) -> Tensor:
    """[n] int32: where each of n per-expert tables of `entries` rows starts in their concatenation."""
    return entries * torch.arange(n, dtype=torch.int32, device=device)


def to_blocked(scale: Tensor) -> Tensor:
    """Swizzle [rows, k/16] block scales into cuBLAS's 128x4 tile layout (zero-padded, flattened)."""
    rows, cols = scale.shape
    padded = F.pad(scale.view(torch.uint8), (0, -cols % 4, 0, -rows % 128)).view(scale.dtype)
    tiles = padded.reshape(-1, 128, padded.shape[1] // 4, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


@dataclass(eq=False)
class QuantizedWeight(ABC):
    """A quantized [out, in] weight: `linear` computes x @ W.T, `block`/`narrow` cut views out of it."""

    # The model cuts its blocks on every forward; handing back the same object keeps per-cut state
    # (NVFP4's swizzled scales) computed once.
    _views: dict[tuple[int, int, int], QuantizedWeight] = field(default_factory=dict, init=False, repr=False)
    weight: Tensor  # the packed codes; each format documents its layout
    fast_kernel: ClassVar[str]  # the name `kernel_name` reports when the GPU path runs
    min_capability: ClassVar[tuple[int, int]]

    @property
    @abstractmethod
    def shape(self) -> torch.Size:
        """Logical [out, in]."""

    @abstractmethod
    def _slice(self, r0: int, r1: int, cols: int) -> QuantizedWeight: ...

    @abstractmethod
    def _dequantize_rows(self, r0: int, r1: int, dtype: torch.dtype) -> Tensor: ...

    @classmethod
    @abstractmethod
    def dequantize_picked(cls, stacked: dict[str, Tensor], pick: Tensor, rows: int, cols: int,
                          dtype: torch.dtype) -> Tensor:
        """Block (rows, cols) of experts `pick` of a stack of this format (`model.linear.ExpertStack`:
        each field with a leading expert dimension) in `dtype`, [len(pick), rows, cols]; equal to each
        expert's `dequantize`, with nothing read back to the host (a CUDA graph records it)."""

    @abstractmethod
    def _kernel_fits(self) -> bool:
        """Whether the shape meets the GPU kernel's alignment rules."""

    @abstractmethod
    def _fast_linear(self, x: Tensor, scaled_mm: Callable) -> Tensor:
        """x [m, in] @ W.T on the GPU kernel (`torch._scaled_mm` or a stand-in with its contract)."""

    @abstractmethod
    def _cpu_linear(self, x: Tensor) -> Tensor:
        """x [.., in] @ W.T on model/gemv.c's kernel for the format."""

    def round_inputs(self, x: Tensor) -> Tensor:
        """x as this weight's products take it: itself, except where a format rounds its inputs (NVFP4's W4A4)."""
        return x

    @abstractmethod
    def step_weight(self):
        """This view as model/step.c reads it (model.step.Weight), for the C decode step."""

    def block(self, r0: int, r1: int, cols: int) -> QuantizedWeight:
        """Rows [r0, r1) and the first `cols` inputs, as views of the packed tensors."""
        out, k = self.shape
        if (r0, r1, cols) == (0, out, k):
            return self
        if not (0 <= r0 < r1 <= out and 0 < cols <= k):
            raise ValueError(f"block rows [{r0}, {r1}) x cols {cols} is outside a {out}x{k} weight")
        if (r0, r1, cols) not in self._views:
            self._views[r0, r1, cols] = self._slice(r0, r1, cols)
        return self._views[r0, r1, cols]

    def narrow(self, out_features: int, in_features: int) -> QuantizedWeight:
        """The leading [out_features, in_features] sub-block (an elastic sub-model's weight)."""
        return self.block(0, out_features, in_features)

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        return self._dequantize_rows(0, self.shape[0], dtype)

    def kernel_name(self, device: torch.device | str | None = None, rows: int = 1) -> str:
        """Which path `linear` takes for `rows` input rows on `device` (default: where the weight lives)."""
        device = self.weight.device if device is None else torch.device(device)
        if self._scaled_mm(device) is not None:
            return self.fast_kernel
        return CPU_KERNEL if gemv.serves(device, rows, gemv.MAX_PACKED_ROWS) else DEQUANT_KERNEL

    def _scaled_mm(self, device: torch.device) -> Callable | None:
        """The scaled matmul that runs this weight on `device`, or None: dequantize."""
        k = kernels.active()
        mm = k.op("scaled_mm", device)
        cap = None if mm is None else k.capability(device)
        return mm if cap is not None and cap >= self.min_capability and self._kernel_fits() else None

    def linear(self, x: Tensor) -> Tensor:
        mm = self._scaled_mm(x.device)
        if mm is not None:
            return self._fast_linear(x.reshape(-1, x.shape[-1]), mm).unflatten(0, x.shape[:-1])
        if gemv.usable(x, gemv.MAX_PACKED_ROWS):
            return self._cpu_linear(x)
        out, k = self.shape
        rows = max(1, TILE_ELEMENTS // k)
        tiles = [F.linear(x, self._dequantize_rows(r, min(r + rows, out), x.dtype)) for r in range(0, out, rows)]
        return tiles[0] if len(tiles) == 1 else torch.cat(tiles, -1)
