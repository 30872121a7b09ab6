"""The caches a generation keeps, one per budget: moving rows between batches, snapshots, transplants,
and the session that lets a conversation reuse them.

A cache knows how many tokens each row consumed (`HybridCache.lengths`); the engine knows the tokens.
Mamba states cannot be rewound, so reuse works by snapshots: a copy of the recurrent states (small,
constant in the context length) taken at a chosen position, with the KV tensors shared — a KV entry
below a cache's length is never written again, so a snapshot sees exactly the keys it had.

Transplant (approximate, off by default) gives a budget another budget's states instead of a catch-up
prefill. Shapes line up because heads are resident rank-major: a budget with fewer heads keeps the
first heads of every group, so its Mamba x-channels and SSM heads are a prefix of a larger budget's;
B/C conv channels, KV heads and head_dim are the same in every budget (the hidden width changes no
cache shape). Going to a budget with *more* heads, the extra heads have no state to take: they start
from zero, as if they had seen no context. Transplanted states are what another submodel computed,
so the result is not exact; benchmarks/bench_generate.py measures what it costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.attention import KVCache
from ..model.budget import Budget
from ..model.mamba2 import MambaState
from ..model.nemotron_h import HybridCache


def take_rows(cache: HybridCache, rows: list[int]) -> HybridCache:
    """A new cache holding copies of `rows` of `cache`, in that order."""
    idx = torch.tensor(rows, device=_device(cache))
    layers: list[KVCache | MambaState | None] = []
    for s in cache.layers:
        if isinstance(s, MambaState):
            layers.append(MambaState(s.conv[idx], s.ssm[idx]))
        elif isinstance(s, KVCache):
            layers.append(KVCache(s.k[idx], s.v[idx]))
        else:
            layers.append(None)
    return HybridCache(cache.budget, layers, [cache.lengths[i] for i in rows])


def put_rows(cache: HybridCache, rows: list[int], sub: HybridCache) -> None:
    """Write the rows of `sub` back into `rows` of `cache` (in place; KV capacity grows when needed)."""
    idx = torch.tensor(rows, device=_device(cache))
    for s, t in zip(cache.layers, sub.layers):
        if isinstance(s, MambaState):
            s.conv[idx] = t.conv
            s.ssm[idx] = t.ssm
        elif isinstance(s, KVCache):
            n = t.k.shape[2]
            s.grow(n)
            s.k[idx, :, :n] = t.k
            s.v[idx, :, :n] = t.v
    for i, n in zip(rows, sub.lengths):
        cache.lengths[i] = n


def snapshot(cache: HybridCache) -> HybridCache:
    """A frozen copy: Mamba states cloned, KV tensors shared (entries below `lengths` never change)."""
    layers: list[KVCache | MambaState | None] = []
    for s in cache.layers:
        if isinstance(s, MambaState):
            layers.append(MambaState(s.conv.clone(), s.ssm.clone()))
        elif isinstance(s, KVCache):
            layers.append(KVCache(s.k, s.v))
        else:
            layers.append(None)
    return HybridCache(cache.budget, layers, list(cache.lengths))


def transplant(src: HybridCache, budget: Budget, new_cache) -> HybridCache:
    """A cache of `budget` at `src`'s positions, built from `src`'s states (see the module docstring).
    `new_cache(batch_size, budget)` allocates the zeroed target."""
    dst = new_cache(src.batch_size, budget)
    for s, d in zip(src.layers, dst.layers):
        if isinstance(s, MambaState) and isinstance(d, MambaState):
            # conv channels: x of k heads (k*p, rank-major) | B | C (2*G*N, the same in every budget)
            bc = 2 * s.ssm.shape[1] * s.ssm.shape[4]
            n = min(s.conv.shape[1], d.conv.shape[1]) - bc
            d.conv[:, :n] = s.conv[:, :n]
            d.conv[:, -bc:] = s.conv[:, -bc:]
            r = min(s.ssm.shape[2], d.ssm.shape[2])  # ssm [b, G, r, p, N]: heads per group, a prefix
            d.ssm[:, :, :r] = s.ssm[:, :, :r]
        elif isinstance(s, KVCache) and isinstance(d, KVCache):
            d.k, d.v = s.k.clone(), s.v.clone()  # KV heads are shared by every budget: same shapes
        elif isinstance(d, KVCache):  # a layer the source skips: no keys to take; zeros up to the position
            d.grow(max(src.lengths))
    dst.lengths = list(src.lengths)
    return dst


def _device(cache: HybridCache) -> torch.device:
    for s in cache.layers:
        if isinstance(s, MambaState):
            return s.conv.device
        if isinstance(s, KVCache):
            return s.k.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------- session


@dataclass
class Saved:
    ids: list[int]  # the tokens the cache consumed, in order
    cache: HybridCache
    frozen: bool  # a snapshot (restored by copy) rather than a live cache (handed over as is)


class Session:
    """The caches one conversation keeps between turns, per budget name: the live cache left by the last
    generation that used the budget and a few snapshots. A state is reusable for a new context exactly
    when the tokens it consumed are a strict prefix of that context; then only the rest is prefilled.
    Single-sequence only (batch generations keep no session)."""

    def __init__(self, max_snapshots: int = 4):
        self.max_snapshots = max_snapshots
        self.saved: dict[str, list[Saved]] = {}

    def take(self, budget: str, ids: list[int]) -> HybridCache | None:
        """The cache of `budget` that consumed the longest strict prefix of `ids`, or None. States longer
        than it are forgotten: they may share its KV tensors, which the caller is about to write."""
        states = self.saved.get(budget, [])
        best = None
        for s in states:
            n = len(s.ids)
            if n < len(ids) and (best is None or n > len(best.ids)) and ids[:n] == s.ids:
                best = s
        if best is None:
            return None
        n = len(best.ids)
        self.saved[budget] = [s for s in states if len(s.ids) < n or (s is best and best.frozen)]
        return snapshot(best.cache) if best.frozen else best.cache

    def snapshot(self, budget: str, cache: HybridCache, ids: list[int]) -> None:
        states = self.saved.setdefault(budget, [])
        states.append(Saved(list(ids), snapshot(cache), True))
        frozen = [s for s in states if s.frozen]
        for s in frozen[: max(0, len(frozen) - self.max_snapshots)]:
            states.remove(s)

    def keep(self, budget: str, cache: HybridCache, ids: list[int]) -> None:
        """The live cache at the end of a generation (replaces the budget's previous live cache)."""
        states = [s for s in self.saved.get(budget, []) if s.frozen]
        self.saved[budget] = states + [Saved(list(ids), cache, False)]
