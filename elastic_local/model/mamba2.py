"""Mamba2 mixer: chunked SSD prefill in pure torch, one-token recurrent decode, gated RMSNorm per group.

Heads are resident rank-major (see layout.py): head j is rank j // G of group j % G, so activations are
viewed as [..., r, G, p] with r = active heads per group. B and C have one row per group and broadcast
over r, which also saves computing C.B once per head.

Math (SPEC §3): dt = softplus(dt + dt_bias), clamped only to time_step_limit as the shipped model does;
A = -exp(A_log); h_t = exp(dt A) h_{t-1} + dt x_t B_t; y = C.h + D x; out = out_proj(norm(y * silu(z))).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kernels
from .linear import block, linear
from .soft import SoftSize


@dataclass
class MambaWeights:
    in_proj: torch.Tensor  # [2*n*p + 2*G*N + n, D]: z | x | B | C | dt, heads rank-major
    conv_weight: torch.Tensor  # [n*p + 2*G*N, K]
    conv_bias: torch.Tensor | None  # [n*p + 2*G*N]
    dt_bias: torch.Tensor  # [n] float32
    A: torch.Tensor  # [n] float32, = -exp(A_log)
    D: torch.Tensor  # [n] float32
    norm: torch.Tensor  # [n*p]
    out_proj: torch.Tensor  # [D, n*p]

    @property
    def heads(self) -> int:
        return self.A.shape[0]


@dataclass(frozen=True)
class MambaState:
    """Advanced in place, never rebound: the C decode step points at a cache's tensors once (step.py)."""

    conv: torch.Tensor  # [B, k*p + 2*G*N, K]: the last K inputs of the convolution
    ssm: torch.Tensor  # [B, G, r, p, N] float32 (group-major, the layout of the scan and its kernels)


def _gated_norm(h: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, G: int, p: int, eps: float) -> torch.Tensor:
    """RMSNorm of h silu(z) within each of G groups of rank-major heads ([..., r, G, p]: over (r, p)); in
    one C pass for a float32 prompt on the CPU (kernels.cpu_rms_norm)."""
    if (out := kernels.cpu_rms_norm(h, weight, eps, G, p, gate=z)) is not None:
        return out
    return _group_norm(h * F.silu(z.float()), weight, G, p, eps)


def _group_norm(h: torch.Tensor, weight: torch.Tensor, G: int, p: int, eps: float) -> torch.Tensor:
    # h: [..., k*p] rank-major -> [..., r, G, p]; RMS over (r, p) within each group
    v = h.view(*h.shape[:-1], -1, G, p)
    v = v * torch.rsqrt(v.pow(2).mean(dim=(-3, -1), keepdim=True) + eps)
    return weight * v.reshape(h.shape)


def mamba_mixer(x: torch.Tensor, w: MambaWeights, heads: int, cfg, state: MambaState | None,
                observe: Callable[[torch.Tensor], None] | None = None, soft: SoftSize | None = None) -> torch.Tensor:
    """One Mamba2 mixer with `heads` active heads (a multiple of G); x's width is the active hidden size."""
    bsz, T, d = x.shape
    G, N, p = cfg.n_groups, cfg.ssm_state_size, cfg.mamba_head_dim
    n_res, k = w.heads, heads
    r, gn = k // G, G * N
    ip = w.in_proj
    if k == n_res and d == ip.shape[1]:
        z, xBC, dt = linear(x, ip).split([k * p, k * p + 2 * gn, k], dim=-1)
        conv_w, conv_b = w.conv_weight, w.conv_bias
    else:  # four prefix views of the same resident in_proj: z, x, B|C, dt
        o = 2 * n_res * p
        z = linear(x, block(ip, 0, k * p, d))
        xs = linear(x, block(ip, n_res * p, n_res * p + k * p, d))
        bc = linear(x, block(ip, o, o + 2 * gn, d))
        dt = linear(x, block(ip, o + 2 * gn, o + 2 * gn + k, d))
        xBC = torch.cat([xs, bc], dim=-1)
        conv_w = torch.cat([w.conv_weight[: k * p], w.conv_weight[n_res * p:]])
        conv_b = None if w.conv_bias is None else torch.cat([w.conv_bias[: k * p], w.conv_bias[n_res * p:]])

    xBC = kernels.causal_conv1d(xBC, conv_w, conv_b, None if state is None else state.conv)
    xs, B, C = xBC.split([k * p, gn, gn], dim=-1)
    dt = F.softplus(dt.float() + w.dt_bias[:k])
    lo, hi = cfg.time_step_limit
    if lo > 0.0 or hi != math.inf:
        dt = dt.clamp(lo, hi)

    # rank-major channels [.., r, G, p] seen group-major [.., G, r, p] (a view), the layout of the scan
    xs = xs.float().view(bsz, T, r, G, p).transpose(2, 3)
    dt = dt.view(bsz, T, r, G).transpose(2, 3)
    A, D = w.A[:k].view(r, G).t(), w.D[:k].view(r, G).t()
    B = B.float().view(bsz, T, G, N)
    C = C.float().view(bsz, T, G, N)
    if state is not None and T == 1:
        y = kernels.ssm_step(state.ssm, xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])[:, None]
        y = (y + D[..., None] * xs).transpose(2, 3).reshape(bsz, T, k * p)
    else:
        y = kernels.mamba_scan(xs, dt, A, D, B, C, cfg.chunk_size, None if state is None else state.ssm)
    if soft is None:
        y = _gated_norm(y, z, w.norm[: k * p].float(), G, p, cfg.layer_norm_epsilon)
    else:
        y = soft.group_norm(y * F.silu(z.float()), w.norm[: k * p].float(), G, p, cfg.layer_norm_epsilon)
    if observe is not None:
        observe(y)
    return linear(y.to(x.dtype), block(w.out_proj, 0, d, k * p))
