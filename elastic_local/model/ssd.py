"""The Mamba2 scan in pure torch: the reference every platform can run, and the CPU path.

Shapes use grouped heads: r heads per group, G groups (see layout.py), p head dim, N state size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T] with out[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the diagonal."""
    T = a.size(-1)
    a = a[..., None].expand(*a.shape, T)  # a[..., i, j] = a_i
    strict = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), -1)
    cs = a.masked_fill(~strict, 0).cumsum(-2)
    return cs.masked_fill(~torch.tril(torch.ones_like(strict), 0), -math.inf)


def ssd_chunked(x, dt, A, B, C, chunk: int, initial_state: torch.Tensor | None):
    """State-space duality scan over chunks (Mamba2 §6; mamba_ssm's minimal reference, grouped heads).

    x: [b, T, G, r, p], dt: [b, T, G, r] (after softplus), A: [G, r], B, C: [b, T, G, N],
    initial_state: [b, G, r, p, N] or None. Returns y [b, T, G, r, p] (without the D skip) and the
    final state, all float32. Quadratic only inside a chunk; chunks are linked by a short recurrence.
    """
    b, T, G, r, p = x.shape
    pad = (-T) % chunk
    if pad:  # dt = 0 on padding: no decay and no input, so the final state is exact
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    c = x.shape[1] // chunk
    x = x.reshape(b, c, chunk, G, r, p)
    dt = dt.reshape(b, c, chunk, G, r)
    B = B.reshape(b, c, chunk, G, -1)
    C = C.reshape(b, c, chunk, G, -1)

    a = (dt * A).permute(0, 3, 4, 1, 2)  # [b, G, r, c, l]
    a_cs = a.cumsum(-1)
    xdt = x * dt[..., None]

    # 1. within each chunk: attention-like, y_l = sum_s C_l.B_s exp(a_{s+1..l}) x_s dt_s
    CB = torch.einsum("bclgn,bcsgn->bcgls", C, B)
    L = torch.exp(segsum(a))  # [b, G, r, c, l, s]
    y = torch.einsum("bcgls,bgrcls,bcsgrp->bclgrp", CB, L, xdt)

    # 2. the state each chunk ends with, from its own inputs
    decay_states = torch.exp(a_cs[..., -1:] - a_cs)  # [b, G, r, c, l]
    states = torch.einsum("bclgn,bgrcl,bclgrp->bcgrpn", B, decay_states, xdt)

    # 3. carry states across chunks
    if initial_state is None:
        initial_state = torch.zeros_like(states[:, 0])
    states = torch.cat([initial_state[:, None].float(), states], dim=1)
    decay_chunk = torch.exp(segsum(F.pad(a_cs[..., -1], (1, 0))))  # [b, G, r, c+1, c+1]
    states = torch.einsum("bgrzc,bcgrpn->bzgrpn", decay_chunk, states)
    states, final = states[:, :-1], states[:, -1]

    # 4. what each chunk's starting state contributes to its outputs
    y = y + torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", C, states, torch.exp(a_cs))
    return y.reshape(b, c * chunk, G, r, p)[:, :T], final


def ssm_step(ssm: torch.Tensor, x, dt, A, B, C) -> torch.Tensor:
    """One recurrent step, updating `ssm` [b, G, r, p, N] in place. x: [b, G, r, p], dt: [b, G, r],
    A: [G, r], B, C: [b, G, N]."""
    dA = torch.exp(dt * A)
    ssm.mul_(dA[..., None, None]).add_((dt[..., None] * x)[..., None] * B[:, :, None, None, :])
    return torch.einsum("bgrpn,bgn->bgrp", ssm, C)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  state: torch.Tensor | None) -> torch.Tensor:
    """silu(depthwise causal conv) of x [b, T, C] with weight [C, K]. With a state [b, C, K] holding the
    last K inputs, the convolution continues from it and the state is updated in place."""
    T, K = x.shape[1], weight.shape[1]
    if state is not None and T == 1:  # decode: shift the window by one and take one dot product per channel
        state.copy_(torch.cat([state[:, :, 1:], x.transpose(1, 2).to(state.dtype)], dim=-1))
        out = (state * weight).sum(-1)
        if bias is not None:
            out = out + bias
        return F.silu(out)[:, None].to(x.dtype)
    xt = x.transpose(1, 2)
    if state is None:
        window = F.pad(xt, (K - 1, 0))
    else:
        window = torch.cat([state[:, :, 1:].to(xt.dtype), xt], dim=-1)
        full = torch.cat([state.to(xt.dtype), xt], dim=-1)
        state.copy_(full[:, :, -K:])
    out = F.conv1d(window, weight[:, None, :].to(xt.dtype), bias, groups=weight.shape[0])
    return F.silu(out[:, :, -T:]).transpose(1, 2)
