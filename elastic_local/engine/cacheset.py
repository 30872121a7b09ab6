"""The caches of one generation: one HybridCache per budget taking part, each holding the active rows in
the same order, and the moves that keep them exact.

Each cache knows how many tokens of each row it has consumed. To give next-token logits a budget first
*catches up*: it runs every token of the row it has not seen in one chunked prefill and keeps the last
position's logits. While decoding the gap is the one token just sampled; when a budget takes over — the
row's phase changed, or a live switch asked for another budget — the gap is everything since it last
ran (for a fresh budget or a row that just joined: the whole prompt). Catch-up is exact: the logits are
those of the budget run from scratch on the sequence, at the cost of one prefill of the gap. Rows one
token behind decode together; on a CPU a row's short catch-up (up to step.PREFILL_ROWS tokens: a joining
row's prompt, the tokens that close thinking) runs in the same C step as them, its states carried from
token to token (`_joins`); a longer one, or one that transplants, runs alone.
`transplant` trades exactness for speed (caches.py explains how states are reused).

Rows join (zeroed states, sized for their capacity) and leave (dropped from every cache) between steps,
which is what continuous batching needs. Everything goes through ElasticModel's API.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..model.attention import KVCache
from ..model.nemotron_h import HybridCache
from ..model.sample import Params
from ..model.step import PREFILL_ROWS
from .caches import Session, put_rows, take_rows, transplant

if TYPE_CHECKING:
    from .elastic_model import ElasticModel


@dataclass(frozen=True)
class Caught:
    """A row's budget consumed several tokens at once: how many, whether it started from another budget's
    states, and when it ended (time.perf_counter)."""

    tokens: int
    transplanted: bool
    end: float


class CacheSet:
    def __init__(self, model: ElasticModel, session: Session | None = None, mark: int | None = None):
        self.model = model
        self.caches: dict[str, HybridCache] = {}
        self.rows = 0  # rows every cache holds
        self.session, self.mark = session, mark  # mark: where each budget's cache is snapshotted (chat)
        # budget -> (rows, their own cache): the rows of a sub-batch that torch's layers step (no C step in
        # place: a GPU, another CPU), copied out once and kept while the same rows decode, put back before
        # anything else reads the batched cache. Copied out and back every step, a sub-batch paid its KV
        # caches at their whole capacity twice a step and, on a GPU, never replayed a CUDA graph (graphs.py
        # records a cache on its second step).
        self.held: dict[str, tuple[list[int], HybridCache]] = {}

    def settle(self) -> dict[str, HybridCache]:
        """Every held sub-batch put back into its budget's cache; the caches, whole (for inspection)."""
        for name, (rows, sub) in self.held.items():
            put_rows(self.caches[name], rows, sub)
        self.held = {}
        return self.caches

    # ------------------------------------------------------------------------------------------ rows

    def join(self, n: int, capacity: int) -> None:
        """Append `n` rows with zeroed states to every cache; `capacity` (0: unknown) sizes KV once."""
        for name, cache in self.settle().items():
            grown = HybridCache.stack([cache, self.model.new_cache(n, name)])
            _reserve(grown, capacity)
            self.caches[name] = grown
        self.rows += n

    def keep(self, positions: list[int]) -> None:
        """Keep only the rows at `positions` (in that order) in every cache."""
        self.caches = {name: take_rows(c, positions) for name, c in self.settle().items()}
        self.rows = len(positions)

    def retire(self, ids: list[int]) -> None:
        """Every row is done: a session keeps each live cache with the tokens it consumed (`ids`: the one
        row's tokens); without one they are freed."""
        if self.session is not None:
            for name, cache in self.settle().items():
                self.session.keep(name, cache, ids[: cache.lengths[0]])
        self.caches, self.rows, self.held = {}, 0, {}

    # ------------------------------------------------------------------------------------------ logits

    def advance(self, budget: str, positions: list[int], seqs: list[list[int]], capacity: int,
                transplant_ok: list[bool]) -> tuple[torch.Tensor, list[float], list[Caught | None]]:
        """Next-token logits [n, V] from `budget` of the rows at `positions` (their tokens: `seqs`), the
        seconds each row's forward took (with the allocation of a cache made for it), and a Caught for each
        row that consumed more than one token.
        A forward stopped half-way (an error, an interrupt) leaves no usable cache: it is dropped."""
        try:
            return self._advance(budget, positions, seqs, capacity, transplant_ok)
        except BaseException:
            self.caches.pop(budget, None)
            self.held.pop(budget, None)
            raise

    def _advance(self, budget: str, positions: list[int], seqs: list[list[int]], capacity: int,
                 transplant_ok: list[bool]) -> tuple[torch.Tensor, list[float], list[Caught | None]]:
        t = time.perf_counter()
        cache = self._cache(budget, seqs[0], capacity)
        # a new cache's allocation is part of the forward that fills it: its row's prefill (several ms on
        # a stream's thread, whose first parallel region and fresh pages the zeroing pays for), not its phase
        made = time.perf_counter() - t
        held = self.held.get(budget)
        if held is not None and held[0] != positions:  # other rows step now: the held ones go back first
            put_rows(cache, *self.held.pop(budget))
            held = None
        gaps = [len(s) - n for s, n in zip(seqs, held[1].lengths if held else [cache.lengths[p] for p in positions])]
        assert min(gaps) >= 1, "a cache consumed tokens its row does not have"
        if max(gaps) == 1:  # every row one token behind (decoding): one batched step, its logits as they come
            out = self._decode(budget, positions, [s[-1] for s in seqs])
            return out, [time.perf_counter() - t] * len(seqs), [None] * len(seqs)
        self.settle()  # catch-ups read and write the batched caches (and another budget's, to transplant)
        logits: list[torch.Tensor | None] = [None] * len(positions)
        seconds = [0.0] * len(positions)
        caught: list[Caught | None] = [None] * len(positions)
        catching = [j for j, g in enumerate(gaps) if g > 1]
        joining: list[int] = []
        if cache.batch_size > 1:  # size the batch's KV once for every row catching up
            for s in cache.layers:
                if isinstance(s, KVCache):
                    s.grow(max(len(seqs[j]) for j in catching))
            joining = [j for j in catching if self._joins(budget, positions[j], seqs[j], gaps[j], transplant_ok[j])]
        stepping = [j for j, g in enumerate(gaps) if g == 1 or j in joining]
        if joining:  # short catch-ups in the decoding rows' C step, each weight read once for all of them
            t = time.perf_counter()
            out = self.model.net.advance_rows([seqs[j][len(seqs[j]) - gaps[j]:] for j in stepping], cache,
                                              [positions[j] for j in stepping])
            if out is not None:
                # a catching row is charged its tokens' share of the call (what its prefill alone is left
                # out of: Admission, a row's phase time), a decoding row the whole call
                end = time.perf_counter()
                spent, tokens = end - t + made, sum(gaps[j] for j in stepping)
                for k, j in enumerate(stepping):
                    logits[j] = out[k]
                    seconds[j] = spent * gaps[j] / tokens if gaps[j] > 1 else spent
                    caught[j] = Caught(gaps[j], False, end) if gaps[j] > 1 else None
                stepping = []
        for j in catching:
            if logits[j] is None:  # alone: a long or transplanted catch-up, or no C step to join
                t = time.perf_counter()
                logits[j], ran, transplanted = self._catch_up(budget, positions[j], seqs[j], transplant_ok[j])
                end = time.perf_counter()
                seconds[j] = end - t + made
                caught[j] = Caught(ran, transplanted, end)
        decoding = [j for j in stepping if gaps[j] == 1]
        if decoding:
            t = time.perf_counter()
            out = self._decode(budget, [positions[j] for j in decoding], [seqs[j][-1] for j in decoding])
            dt = time.perf_counter() - t
            for k, j in enumerate(decoding):
                logits[j], seconds[j] = out[k], dt
        return (logits[0][None] if len(logits) == 1 else torch.stack(logits)), seconds, caught

    def _joins(self, budget: str, pos: int, seq: list[int], gap: int, transplant_ok: bool) -> bool:
        """Whether row `pos`'s catch-up of `gap` tokens may run in the decoding rows' step (its logits the
        bits of its tokens run alone, where the weights are panels): not past PREFILL_ROWS tokens, not a
        transplant, not across a session's snapshot mark."""
        return (gap <= PREFILL_ROWS and not (transplant_ok and self._transplant_source(budget, pos) is not None)
                and not (self.mark is not None and len(seq) - gap < self.mark <= len(seq)))

    def run_ahead(self, budget: str, seq: list[int], n: int, stops: frozenset[int],
                  halt: torch.Tensor | None, draw: tuple[Params, torch.Generator | None] | None) -> list[int] | None:
        """Up to `n` tokens of the one row after its last token `seq[-1]` in one call, greedy or drawn with
        `draw` (NemotronH's decode_ahead: at most until one of `stops`, or `halt` is set), or None where
        that cannot run: no cache one token behind the row, or no C step for it."""
        cache = self.caches.get(budget)
        if cache is None or cache.batch_size != 1 or cache.lengths[0] != len(seq) - 1:
            return None
        return self.model.net.decode_ahead(seq[-1], cache, n, stops, halt, draw)

    def _cache(self, budget: str, first: list[int], capacity: int) -> HybridCache:
        if budget not in self.caches:
            cache = self.session.take(budget, first) if self.session is not None else None
            if cache is None:
                cache = self.model.new_cache(self.rows, budget, capacity)
            self.caches[budget] = cache
        return self.caches[budget]

    def _forward(self, ids: list[int] | torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """Last-position logits [B, V]; advances `cache` (prefilled in chunks by the network)."""
        if not isinstance(ids, torch.Tensor):
            ids = torch.tensor([ids], device=self.model.device)
        return self.model.forward(ids, cache, last_only=True)[:, -1]

    def _decode(self, budget: str, positions: list[int], last: list[int]) -> torch.Tensor:
        """One token for each row at `positions` (`last`: each row's last token), batched."""
        cache = self.caches[budget]
        if cache.batch_size == 1:
            return self.model.net.decode_token(last[0], cache)
        ids = torch.tensor([[t] for t in last], device=self.model.device)
        held = self.held.get(budget)  # (_advance put back a held copy of other rows)
        if held is None:
            if positions == list(range(cache.batch_size)):
                return self._forward(ids, cache)
            if (out := self.model.net.advance_rows([[t] for t in last], cache, positions)) is not None:  # in place
                return out
            held = self.held[budget] = (positions, take_rows(cache, positions))
        return self._forward(ids, held[1])

    def _catch_up(self, budget: str, pos: int, seq: list[int], transplant_ok: bool) -> tuple[torch.Tensor, int, bool]:
        """Bring `budget`'s cache of one row up to the row's last token in one chunked prefill; returns the
        logits [V], the tokens run and whether it started from another budget's states."""
        cache = self.caches[budget]
        whole = cache.batch_size == 1
        sub = cache if whole else take_rows(cache, [pos])
        transplanted = False
        if transplant_ok and (src := self._transplant_source(budget, pos)) is not None:
            src = src if src.batch_size == 1 else take_rows(src, [pos])
            sub = transplant(src, self.model.budget(budget), lambda n, _: self.model.new_cache(n, budget))
            transplanted = True
        n, target = sub.lengths[0], len(seq)
        ran = target - n
        if self.mark is not None and n < self.mark <= target:  # snapshot where the next turn will diverge
            out = self._forward(seq[n:self.mark], sub)
            self.session.snapshot(budget, sub, seq[: self.mark])
            n = self.mark
        if n < target:
            out = self._forward(seq[n:target], sub)
        if whole:
            self.caches[budget] = sub
        else:
            put_rows(cache, [pos], sub)
        return out[0], ran, transplanted

    def _transplant_source(self, budget: str, pos: int) -> HybridCache | None:
        """The other budget's cache that has consumed the most of row `pos` (more than `budget`'s)."""
        best, n = None, self.caches[budget].lengths[pos]
        for name, c in self.caches.items():
            if name != budget and c.lengths[pos] > n:
                best, n = c, c.lengths[pos]
        return best


def holds_copies(model: ElasticModel) -> bool:
    """Whether a batch's sub-batches step on copies of their rows, held while the same rows decode
    (CacheSet.held: up to one more cache of every row), rather than where they lie (the C step)."""
    return not all(model.net.steps_rows_in_place(model.budget(b)) for b in model.budgets)


def _reserve(cache: HybridCache, capacity: int) -> None:
    """Pad every KV cache to exactly `capacity` positions (doubling, as growth does, would overshoot the
    memory a batch was admitted for)."""
    for s in cache.layers:
        if isinstance(s, KVCache) and s.k.shape[2] < capacity:
            pad = (0, 0, 0, capacity - s.k.shape[2])
            s.k, s.v = F.pad(s.k, pad), F.pad(s.v, pad)
