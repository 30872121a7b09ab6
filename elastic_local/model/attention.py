"""Grouped-query attention with no positional encoding (Nemotron-H's attention layers use none).

Query heads are resident rank-major (layout.py): position j is rank j // KV of KV group j % KV, so a
budget keeping q heads per KV group uses the first q*KV rows of q_proj and columns of o_proj.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .linear import block, linear
from .soft import SoftSize


@dataclass
class AttentionWeights:
    qkv: torch.Tensor  # [(Hq + 2*KV) * hd, D]: q (rank-major heads) | k | v
    o_proj: torch.Tensor  # [D, Hq * hd]

    def q_heads(self, head_dim: int, kv_heads: int) -> int:
        return self.qkv.shape[0] // head_dim - 2 * kv_heads


@dataclass
class KVCache:
    k: torch.Tensor  # [B, KV, capacity, hd]
    v: torch.Tensor

    def grow(self, needed: int) -> None:
        cap = self.k.shape[2]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap, 64)
        pad = (0, 0, 0, new_cap - cap)
        self.k, self.v = F.pad(self.k, pad), F.pad(self.v, pad)


def attention(x: torch.Tensor, w: AttentionWeights, heads: int, cfg, kv: KVCache | None, start: int = 0,
              lengths: torch.Tensor | None = None, soft: SoftSize | None = None, static: bool = False) -> torch.Tensor:
    """Attention over the active `heads` query heads. With a cache, every row has `start` tokens cached,
    or, for one-token decode steps of rows at different positions, `lengths[b]` tokens. `static` (the
    compiled decode step): attend over the cache's whole capacity with a mask, so no shape depends on the
    positions (the caller has grown the cache)."""
    bsz, T, d = x.shape
    hd, KV = cfg.head_dim, cfg.num_key_value_heads
    hq_res = w.q_heads(hd, KV)
    r = heads // KV
    if heads == hq_res and d == w.qkv.shape[1]:
        q, k, v = linear(x, w.qkv).split([heads * hd, KV * hd, KV * hd], dim=-1)
    else:
        q = linear(x, block(w.qkv, 0, heads * hd, d))
        k, v = linear(x, block(w.qkv, hq_res * hd, (hq_res + 2 * KV) * hd, d)).split(KV * hd, dim=-1)
    # group-major queries for SDPA's GQA (query head i reads KV head i // r)
    q = q.view(bsz, T, r, KV, hd).permute(0, 3, 2, 1, 4).reshape(bsz, KV * r, T, hd)
    k = k.view(bsz, T, KV, hd).transpose(1, 2)
    v = v.view(bsz, T, KV, hd).transpose(1, 2)

    mask = None
    if kv is not None:
        if lengths is None:
            end = start + T
            kv.grow(end)
            kv.k[:, :, start:end] = k
            kv.v[:, :, start:end] = v
            if start > 0 and T > 1:  # a chunk after a cached prefix: query i sees keys <= start + i
                mask = torch.ones(T, end, dtype=torch.bool, device=x.device).tril(start)
        else:
            if T != 1:
                raise ValueError("rows at different positions can only decode one token at a time")
            if static:
                end = kv.k.shape[2]
            else:
                end = int(lengths.max()) + 1
                kv.grow(end)
            rows = torch.arange(bsz, device=x.device)
            kv.k[rows, :, lengths] = k[:, :, 0]
            kv.v[rows, :, lengths] = v[:, :, 0]
            mask = (torch.arange(end, device=x.device) <= lengths[:, None])[:, None, None, :]
        k, v = kv.k[:, :, :end], kv.v[:, :, :end]
    causal = mask is None and T > 1 and start == 0
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=r > 1)
    out = out.view(bsz, KV, r, T, hd).permute(0, 3, 2, 1, 4).reshape(bsz, T, heads * hd)
    if soft is not None:  # rank-major head positions, so a prefix of heads is a prefix of positions
        out = (out.view(bsz, T, heads, hd) * soft.keep(heads).to(out.dtype)[:, None]).view(bsz, T, heads * hd)
    return linear(out, block(w.o_proj, 0, d, heads * hd))
