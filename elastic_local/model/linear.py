"""Weights as prefix views: one helper to cut a block out of a resident weight and one to apply it.

A weight is either a plain tensor or a quantized weight object (see `elastic_local.quant`) that knows
how to cut the same blocks out of its packed bytes. Everything in the network goes through these two
functions, so budgets and precisions never meet in the model code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Weight = torch.Tensor  # or a quantized weight with .block(r0, r1, cols) and .linear(x)


def block(w, r0: int, r1: int, cols: int):
    """Rows [r0, r1) and the first `cols` input columns of a [out, in] weight, without a copy."""
    if isinstance(w, torch.Tensor):
        if r0 == 0 and r1 == w.shape[0] and cols == w.shape[1]:
            return w
        return w[r0:r1, :cols]
    return w.block(r0, r1, cols)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    return w.linear(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 over the active channels (the weight is already cut to them)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)
