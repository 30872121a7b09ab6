"""Soft budgets: a differentiable mix of a layer's candidate prefix sizes, for training a budget router.

While the router trains, a layer runs its largest size and weighs each unit (channel or head) by the
probability that the sampled size keeps it. Units act independently up to the next Linear, so this is
exactly the mix of the candidate prefixes' outputs; Mamba's gated norm, whose statistics depend on the
kept heads, mixes one normalisation per candidate. With one-hot weights it is the prefix view the
runtime slices. Only training passes these; inference never does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SoftSize:
    sizes: torch.Tensor  # [K] candidate prefix sizes (heads or channels), ascending
    weights: torch.Tensor  # [K] mixing weights, summing to 1

    def keep(self, n: int) -> torch.Tensor:
        """[n] weight of unit j: the total weight of the candidates that keep it (size > j)."""
        units = torch.arange(n, device=self.weights.device)[:, None]
        return ((units < self.sizes[None]).to(self.weights.dtype) * self.weights).sum(-1)

    def group_norm(self, h: torch.Tensor, weight: torch.Tensor, G: int, p: int, eps: float) -> torch.Tensor:
        """Mamba's per-group RMSNorm over rank-major heads [..., r*G*p], mixed over the candidate head
        counts: candidate k normalises over its first sizes[k] / G ranks of each group and zeroes the rest."""
        v = h.view(*h.shape[:-1], -1, G, p)
        r = v.shape[-3]
        count = torch.arange(1, r + 1, device=h.device, dtype=h.dtype)[:, None]
        ms = v.pow(2).mean(-1).cumsum(-2) / count  # [..., r, G]: mean square over the first j+1 ranks
        ranks = self.sizes // G
        inv = torch.rsqrt(ms.index_select(-2, ranks - 1) + eps)  # [..., K, G]
        keep = (torch.arange(r, device=h.device)[:, None] < ranks[None]).to(h.dtype) * self.weights.to(h.dtype)
        scale = torch.einsum("...kg,rk->...rg", inv, keep)
        return weight * (v * scale[..., None]).reshape(h.shape)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over a soft hidden width: candidate k normalises over its first sizes[k] channels and
        zeroes the rest, mixed by the weights (the runtime's `rms_norm` of the prefix, for one-hot ones)."""
        h = x.float()
        D = h.shape[-1]
        ms = h.pow(2).cumsum(-1) / torch.arange(1, D + 1, device=h.device, dtype=h.dtype)  # mean square of prefixes
        inv = torch.rsqrt(ms.index_select(-1, self.sizes - 1) + eps)  # [..., K]
        keep = (torch.arange(D, device=h.device)[:, None] < self.sizes[None]).to(h.dtype) * self.weights.to(h.dtype)
        return (weight.float() * h * torch.einsum("...k,dk->...d", inv, keep)).to(x.dtype)


SoftLayer = dict[str, SoftSize]  # axis name (as in LayerSizes) -> its soft size


def unit_weights(sl: SoftLayer | None, axis: str, n: int) -> torch.Tensor | None:
    """The first n units' weights of a soft axis, or None where the axis is not soft (the usual case)."""
    return sl[axis].keep(n) if sl and axis in sl else None
