"""Weights as prefix views: one helper to cut a block out of a resident weight and one to apply it.

A weight is either a plain tensor or a quantized weight object (see `elastic_local.quant`) that knows
how to cut the same blocks out of its packed bytes. Everything in the network goes through these two
functions, so budgets and precisions never meet in the model code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block(w, r0: int, r1: int, cols: int):
    """Rows [r0, r1) and the first `cols` input columns of a [out, in] weight, without a copy."""
    if isinstance(w, torch.Tensor):
        if r0 == 0 and r1 == w.shape[0] and cols == w.shape[1]:
            return w
        return w[r0:r1, :cols]
    return w.block(r0, r1, cols)


def _onednn_linear():
    """oneDNN's linear on CPUs. MKL's matrix-vector product reaches a third of the memory bandwidth on
    some CPUs (AMD EPYC here: 12 GB/s against oneDNN's 35-75 GB/s), and batch-1 decode is nothing but
    matrix-vector products. oneDNN copies strided views, so those (smaller budgets) stay with MKL."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
        probe = torch.ones(2, 16)
        if not torch.backends.mkldnn.is_available() or not torch.allclose(op(probe, probe, None, "none", [], ""),
                                                                            probe @ probe.T):
            return None
        return op
    except (AttributeError, RuntimeError):
        return None


_ONEDNN = _onednn_linear()
# oneDNN caches one primitive per input shape; prefill chunks and MoE expert batches come in ever new
# shapes, so only decode-sized inputs go to it (measured: the cache otherwise grows tens of MiB per chunk)
ONEDNN_MAX_ROWS = 16


def linear(x: torch.Tensor, w) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        # oneDNN's op has no backward: weights being trained take F.linear
        if (_ONEDNN is not None and w.device.type == "cpu" and not w.requires_grad and w.is_contiguous()
                and x.dtype == w.dtype and w.dtype in (torch.float32, torch.bfloat16)
                and x.numel() <= ONEDNN_MAX_ROWS * x.shape[-1]):
            return _ONEDNN(x, w, None, "none", [], "")
        return F.linear(x, w)
    return w.linear(x)


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 over the active channels (the weight is already cut to them)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)
