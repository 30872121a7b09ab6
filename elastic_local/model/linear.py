"""Weights as prefix views: one helper to cut a block out of a resident weight and one to apply it.

A weight is either a plain tensor or a quantized weight object (see `elastic_local.quant`) that knows
how to cut the same blocks out of its packed bytes. Everything in the network goes through these two
functions, so budgets and precisions never meet in the model code.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.nn.functional as F

from . import gemv, kernels, pages


def block(w, r0: int, r1: int, cols: int):
    """Rows [r0, r1) and the first `cols` input columns of a [out, in] weight, without a copy."""
    if isinstance(w, torch.Tensor):
        if r0 == 0 and r1 == w.shape[0] and cols == w.shape[1]:
            return w
        return w[r0:r1, :cols]
    return w.block(r0, r1, cols)


@functools.cache
def _onednn_linear(dtype: torch.dtype):
    """oneDNN's linear on CPUs for `dtype`, probed on the first matmul (a CPU without bf16 instructions
    refuses bf16 primitives). MKL's matrix-vector product reaches a third of the memory bandwidth on
    some CPUs (AMD EPYC here: 12 GB/s against oneDNN's 35-75 GB/s), and batch-1 decode is nothing but
    matrix-vector products. oneDNN copies strided views, so those (smaller budgets) stay with MKL.

    oneDNN (also torch's CPU convolutions and attention) caches one primitive per input shape, 1024 by
    default; every prefill chunk attends to a longer cache, so that cache grew by tens of MiB per chunk.
    Measured on a 290M model at 8192 tokens (benchmarks/bench_memory.py, bench_decode.py 100m): 1024
    entries hold 1.27x the planned memory; 32 entries 1.09x but prefill and decode slow down (primitives
    rebuilt); 64 entries 1.13x at full speed. oneDNN reads the capacity when it first runs, and the
    network's first op that reaches it is this matmul, so it is set here (unless the user set it)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    try:
        op = torch.ops.mkldnn._linear_pointwise
        probe = torch.ones(2, 16, dtype=dtype)
        if not torch.backends.mkldnn.is_available() or not torch.allclose(op(probe, probe, None, "none", [], ""),
                                                                            probe @ probe.T):
            return None
        return op
    except (AttributeError, RuntimeError):
        return None


# oneDNN caches one primitive per input shape; prefill chunks and MoE expert batches come in ever new
# shapes, so only decode-sized inputs go to it (measured: the cache otherwise grows tens of MiB per chunk)
ONEDNN_MAX_ROWS = 16


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w.T for any weight: decode-sized CPU inputs on the decode kernels (gemv.py), else oneDNN or torch."""
    if isinstance(w, torch.Tensor):
        if (w.dtype in (torch.float32, torch.bfloat16) and w.ndim == 2 and w.stride(1) == 1
                and not w.requires_grad and gemv.usable(x)):
            return gemv.matvec(x, w)
        # oneDNN's op has no backward: weights being trained take F.linear; a compiled step leaves the
        # choice of matmul to inductor (tracing the probe would run it inside every step)
        if (w.device.type == "cpu" and not w.requires_grad and not torch.compiler.is_compiling()
                and w.is_contiguous() and x.dtype == w.dtype
                and w.dtype in (torch.float32, torch.bfloat16) and x.numel() <= ONEDNN_MAX_ROWS * x.shape[-1]
                and (onednn := _onednn_linear(w.dtype)) is not None):
            return onednn(x, w, None, "none", [], "")
        return F.linear(x, w)
    return w.linear(x)


class Transposed:
    """A float weight [.., out, in] kept as its transpose [.., in, out] (contiguous) for CPU inference
    where the decode kernels do not run (engine/load.cpu_layout; with them, `Panels`): torch's `x @ t`.

    `x @ t` walks the rows of t (one input channel's outputs each); a budget's view `t[:cols, r0:r1]` is a
    prefix of those rows, where the [out, in] layout sends every strided view (every smaller budget) to
    MKL's slow path. Measured on the demo model, one thread, decode tok/s full / mid / small: [out, in]
    141 / 171 / 162, this layout 203 / 199 / 261 (torch's matmul, before the kernels; docs/decode-speed.md). Float32
    only: in bfloat16 torch's `x @ t` on this CPU runs at half the speed of the [out, in] path (demo full
    budget 99 against 196 tok/s), so bf16 weights stay [out, in]. Training keeps the [out, in] tensors
    (autograd, optimizer state)."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    @classmethod
    def of(cls, w: torch.Tensor) -> Transposed:
        return cls(w.transpose(-1, -2).contiguous())

    @property
    def shape(self) -> tuple[int, ...]:
        """The [.., out, in] shape of the weight it stands for."""
        return (*self.t.shape[:-2], self.t.shape[-1], self.t.shape[-2])

    @property
    def dtype(self) -> torch.dtype:
        return self.t.dtype

    @property
    def data(self) -> torch.Tensor:
        return self.t

    def __getitem__(self, expert) -> Transposed:
        return Transposed(self.t[expert])

    def block(self, r0: int, r1: int, cols: int) -> Transposed:
        return Transposed(self.t[..., :cols, r0:r1])

    def dense(self) -> torch.Tensor:
        """[.., in, out] (a view)."""
        return self.t

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.t


PANEL = 24  # outputs per panel: gemv.c's PW, the width of its register tiles
# the column each position of a bf16 panel's row holds: pairs of columns (c, c + 8), so that one shift or one
# mask of 32-bit pairs widens 8 columns to float32, then columns 16-23 in order (gemv.c, bf16_panel_row)
BF16_COLUMNS = (*(c + h for c in range(8) for h in (0, 8)), *range(16, 24))
_BF16_NATURAL = torch.tensor(BF16_COLUMNS).argsort()  # the position each column lies at


def _fill_paired(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[..., :] = src's 24 columns in the order BF16_COLUMNS: positions 2c + h of the first 16 hold column
    8h + c (a [2, 8] -> [8, 2] transpose), the last 8 their own columns."""
    dst[..., :16].unflatten(-1, (8, 2)).copy_(src[..., :16].unflatten(-1, (2, 8)).transpose(-1, -2))
    dst[..., 16:].copy_(src[..., 16:])


class Panels:
    """A float32 weight [.., out, in] kept for the CPU decode kernels (model/gemv.c) as column panels of its
    transpose: p [.., panels, in, 24], panel q holding outputs [24q, 24q + 24) (the last one zero-padded),
    each [in, 24] contiguous. A view is (p cut to its panels and first inputs, `skip` columns of the first
    panel before its first output, `n` outputs).

    Why: batch-1 decode streams every weight once per token, and a budget's view of a plain transpose
    [in, out] that cuts the outputs is short row pieces a stride apart (expert up / down projections, out
    projections when the hidden size shrinks), which the CPU streamed 1.2-1.4x slower than the same bytes
    contiguous (scratch, 2 threads). In panels every view is one contiguous run per panel, so a small budget
    reads at the speed of a model of its own size (docs/decode-speed.md, "Budgets in column panels"); and the panels
    are the blocked product's own layout, so a prompt's tiles read them without a packing copy.

    bf16 panels (a BF16 file's weights, which the kernels widen as they read) store each row's columns in
    the order BF16_COLUMNS, the one their decode reads fastest; `dense` puts them back."""

    def __init__(self, p: torch.Tensor, skip: int, n: int):
        self.p, self.skip, self.n = p, skip, n

    @classmethod
    def of(cls, w: torch.Tensor) -> Panels:
        *lead, out, inp = w.shape
        whole, rest = divmod(out, PANEL)
        shape = (*lead, whole + (rest > 0), inp, PANEL)  # peak: w and p
        p = pages.zeros(shape, w.dtype) if w.device.type == "cpu" else w.new_zeros(shape)
        if gemv.panel_copy(w, p):  # bf16 in C: 1.7-2.7x the copy below
            return cls(p, 0, out)
        fill = _fill_paired if w.dtype == torch.bfloat16 else torch.Tensor.copy_
        fill(p[..., :whole, :, :], w[..., :whole * PANEL, :].unflatten(-2, (whole, PANEL)).transpose(-1, -2))
        if rest:
            last = w.new_zeros(*lead, inp, PANEL)
            last[..., :rest] = w[..., whole * PANEL:, :].transpose(-1, -2)
            fill(p[..., whole, :, :], last)
        return cls(p, 0, out)

    @property
    def shape(self) -> tuple[int, ...]:
        """The [.., out, in] shape of the weight (view) it stands for."""
        return (*self.p.shape[:-3], self.n, self.p.shape[-2])

    @property
    def dtype(self) -> torch.dtype:
        return self.p.dtype

    @property
    def data(self) -> torch.Tensor:
        return self.p

    def __getitem__(self, expert) -> Panels:
        return Panels(self.p[expert], self.skip, self.n)

    def block(self, r0: int, r1: int, cols: int) -> Panels:
        first = self.skip + r0
        return Panels(self.p[..., first // PANEL:-(-(self.skip + r1) // PANEL), :cols, :], first % PANEL, r1 - r0)

    def column(self, j: int) -> tuple[int, int]:
        """Where output j of the view lies: (panel, position in each of its rows)."""
        q, c = divmod(self.skip + j, PANEL)
        return q, BF16_COLUMNS.index(c) if self.p.dtype == torch.bfloat16 else c

    def dense(self) -> torch.Tensor:
        """[.., in, out] float32 (a copy): for torch's paths (no kernels, a batch of picked experts)."""
        p = self.p.movedim(-3, -2)
        if p.dtype == torch.bfloat16:
            p = p[..., _BF16_NATURAL]  # the columns back in order, in the one copy the reshape would make
        return p.reshape(*p.shape[:-2], -1)[..., self.skip:self.skip + self.n].float()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and self.p.ndim == 3 \
                and gemv.library() is not None:  # a bf16 prompt's products sum in float32, as oneDNN's do
            return gemv.panels(x, self.p, self.skip, self.n)
        return x @ self.dense().to(x.dtype)


class RowConcat:
    """Weights stacked along their output rows without being merged: q|k|v of a quantized attention layer,
    whose parts carry their own scales. Blocks cut across the parts; the matmul concatenates outputs."""

    def __init__(self, parts: list):
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    def block(self, r0: int, r1: int, cols: int):
        picked, start = [], 0
        for p in self.parts:
            end = start + p.shape[0]
            lo, hi = max(r0, start), min(r1, end)
            if lo < hi:
                picked.append(block(p, lo - start, hi - start, cols))
            start = end
        return picked[0] if len(picked) == 1 else RowConcat(picked)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([linear(x, p) for p in self.parts], dim=-1)

    def cpu_layout(self) -> RowConcat:
        """Each part in its format's CPU layout (elastic_local.quant: FP8's panels)."""
        return RowConcat([p.cpu_layout() if hasattr(p, "cpu_layout") else p for p in self.parts])


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack, with float8 tensors stacked as their bytes (every torch build stacks those)."""
    dtype = tensors[0].dtype
    if dtype.itemsize == 1 and dtype.is_floating_point:
        return torch.stack([t.view(torch.uint8) for t in tensors]).view(dtype)
    return torch.stack(tensors)


class ExpertStack(list):
    """A MoE layer's packed experts (FP8 / NVFP4 weights, `elastic_local.quant`), each still its own weight
    (`stack[e]`), whose tensors are views of one stacked tensor per field. Why: a CUDA graph's MoE step
    (moe._experts_gathered) picks the routed experts by a device tensor, never a Python int; stacked, the
    chosen experts' packed blocks are one gather away. Built from the per-expert weights, it replaces
    them: their tensors are freed with the list they came in, and no copy stays."""

    def __init__(self, experts: list):
        first = experts[0]
        names = [f.name for f in dataclasses.fields(first)
                 if f.init and isinstance(getattr(first, f.name), torch.Tensor)]
        for e, w in enumerate(experts):
            if type(w) is not type(first) or not all(isinstance(getattr(w, n), torch.Tensor) for n in names):
                raise ValueError(f"expert {e} is a {type(w).__name__} unlike expert 0's {type(first).__name__}"
                                 f" ({', '.join(names)}): a layer's experts share one format to be stacked")
        self.stacked = {n: _stack([getattr(w, n) for w in experts]) for n in names}
        super().__init__(dataclasses.replace(w, **{n: self.stacked[n][e] for n in names})
                         for e, w in enumerate(experts))

    def round_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """x as the experts' products take it (rounded to NVFP4 where they round their inputs: W4A4)."""
        return self[0].round_inputs(x)

    def dequantize(self, pick: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """[len(pick), rows, cols] in `dtype`: block (rows, cols) of the experts `pick` (a device tensor),
        the values each expert's own `dequantize` gives."""
        return type(self[0]).dequantize_picked(self.stacked, pick, rows, cols, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 over the active channels (the weight is already cut to them); a float32 prompt on
    the CPU in one C pass (kernels.cpu_rms_norm)."""
    if (out := kernels.cpu_rms_norm(x, weight, eps)) is not None:
        return out
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)
