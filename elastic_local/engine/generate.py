"""Generation with elastic budget control: two phases on their own submodels, one cache per budget.

    prompt ... <think>| thinking ... </think>| answer ... eos
                      \\_ think budget _/     \\_ answer budget _/

Every sequence (row) is in a phase, and the phase picks the budget that produces its next token. Each
budget taking part keeps its own HybridCache, which knows how many tokens of each row it has consumed.
To get next-token logits a budget first *catches up*: it runs every token of the row it has not seen
in one chunked prefill and keeps the last position's logits. While decoding the gap is the one token
just sampled; when a budget takes over — the phase changed, or a live switch asked for another budget —
the gap is everything since it last ran (for a fresh budget: the prompt and all thinking). Catch-up is
exact: the logits are those of the budget run from scratch on the sequence, at the cost of one prefill
of the gap. `transplant=True` trades exactness for speed (caches.py explains how states are reused).

Budget control: after `max_think_tokens` thinking tokens the engine appends `think_close` and `</think>`
itself (forced tokens) and the row goes on to answer; `max_answer_tokens` ends the generation; a
switch (`Generation.switch`, from any thread) takes effect at the next token; cancel is checked before
every step, and a step is never interrupted, so every cache always holds a prefix of its row.

Batches: every cache holds the active rows in the same order. Rows finish independently (their rows
are dropped from every cache), rows in different phases run as separate sub-batches when their
budgets differ, and a row that needs a catch-up runs it alone (rows sit at different positions).
The engine knows nothing about chat templates; text is only decoded for events and stop strings.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..model.attention import KVCache
from ..model.nemotron_h import HybridCache
from .caches import Session, put_rows, take_rows, transplant
from .events import CatchUp, Done, Event, Result, Stats, Switch, Token
from .sampling import Sampling, sample

if TYPE_CHECKING:
    from .elastic_model import ElasticModel

PHASES = ("think", "answer")
# The text appended before `</think>` when the think token budget runs out (the recipe NVIDIA's and
# Qwen's budget-control examples use; "" appends `</think>` alone).
THINK_CLOSE = ("\n\nConsidering the limited time by the user, I have to give the solution based on the thinking "
               "directly now.\n")


@dataclass(frozen=True)
class Specials:
    """The token ids the phase machine reacts to."""

    think_start: int | None = None
    think_end: int | None = None
    eos: frozenset[int] = frozenset()


@dataclass
class Request:
    """Everything a generation needs besides the prompts. Budgets default to the largest resident one."""

    think_budget: str | None = None
    answer_budget: str | None = None
    max_think_tokens: int | None = 1024  # the think token budget; None: think until the model closes it
    max_answer_tokens: int | None = 1024
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings, matched in the answer text (thinking is never cut)
    stop_ids: tuple[int, ...] = ()  # extra stop token ids, in either phase
    ignore_eos: bool = False  # keep going past eos (benchmarks)
    think_close: str = THINK_CLOSE
    transplant: bool = False  # a budget taking over reuses another budget's states (approximate)

    def __post_init__(self) -> None:
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        self.stop_ids = tuple(self.stop_ids)
        for name in ("max_think_tokens", "max_answer_tokens"):
            n = getattr(self, name)
            if n is not None and n < 0:
                raise ValueError(f"{name}={n} must be >= 0 (or None)")

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)


def start_phase(prompt: list[int], sp: Specials) -> str:
    """"think" when the prompt leaves a `<think>` open, else "answer" (thinking off, or no think tokens)."""
    if sp.think_start is None or sp.think_end is None:
        return "answer"
    for tok in reversed(prompt):
        if tok == sp.think_end:
            return "answer"
        if tok == sp.think_start:
            return "think"
    return "answer"


@dataclass
class _Row:
    """One sequence being generated."""

    index: int
    ids: list[int]
    phase: str
    prompt_len: int = 0
    think_len: int = 0  # tokens appended while thinking (forced ones included)
    generated: dict[str, int] = field(default_factory=lambda: {"think": 0, "answer": 0})  # sampled only
    text: dict[str, str] = field(default_factory=lambda: {"think": "", "answer": ""})
    shown: int = 0  # answer characters emitted (the rest is held back: it may begin a stop string)
    decoder: object = None
    think_end: str | None = None
    finish_reason: str | None = None
    finish_phase: str | None = None
    prefilled: bool = False
    stats: Stats = field(default_factory=Stats)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.ids)
        self.stats.prompt_tokens = len(self.ids)


class Generation:
    """Rows, their phases and one cache per budget; `run()` yields events until every row is finished."""

    def __init__(self, model: ElasticModel, prompts: list[list[int]], req: Request,
                 session: Session | None = None, mark: int | None = None,
                 cancel: threading.Event | None = None):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if session is not None and len(prompts) != 1:
            raise ValueError("a session holds one sequence; batch generations run without one")
        self.model, self.req, self.sampling = model, req, req.sampling
        self.tokenizer, self.sp = model.tokenizer, model.specials
        largest = model.budgets[0]
        self.budget_of = {"think": req.think_budget or largest, "answer": req.answer_budget or largest}
        for name in self.budget_of.values():
            model.budget(name)  # unknown names fail here, before any work
        self.rows = [_Row(i, list(map(int, p)), start_phase(list(p), self.sp)) for i, p in enumerate(prompts)]
        self.active = [r.index for r in self.rows]  # the row order of every cache
        self.caches: dict[str, HybridCache] = {}
        self.session, self.mark = session, mark  # mark: where each budget's cache is snapshotted (chat)
        self.generator = self.sampling.generator(model.net.device)
        self.stops = (set() if req.ignore_eos else set(self.sp.eos)) | set(req.stop_ids)
        self.close_ids = []
        if self.sp.think_end is not None:
            text = self.tokenizer.encode(req.think_close) if self.tokenizer and req.think_close else []
            self.close_ids = text + [self.sp.think_end]
        self._cancel = cancel or threading.Event()
        self._switch: dict[str, str] = {}
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()

    # ------------------------------------------------------------------------------------------ control

    def switch(self, think: str | None = None, answer: str | None = None) -> None:
        """Run `think` / `answer` on other budgets from the next token on (callable from any thread)."""
        for name in (think, answer):
            if name is not None:
                self.model.budget(name)
        with self._lock:
            self._switch.update({p: n for p, n in (("think", think), ("answer", answer)) if n is not None})

    def cancel(self) -> None:
        self._cancel.set()

    # ------------------------------------------------------------------------------------------ the loop

    def run(self) -> Iterator[Event]:
        self.t0 = time.perf_counter()
        events: list[Event] = []
        for row in self.rows:
            events += self._enter(row, row.phase, at_start=True)
        self.active = [r.index for r in self.rows if r.finish_reason is None]
        yield from events
        try:
            while self.active:
                yield from self.step()
        finally:
            if self.session is not None:  # the live caches, each with the tokens it consumed
                for name, cache in self.caches.items():
                    self.session.keep(name, cache, self.rows[0].ids[: cache.lengths[0]])
        yield Done(self.results(), self._now())

    def collect(self) -> list[Result]:
        for ev in self.run():
            if isinstance(ev, Done):
                return ev.results
        raise AssertionError("unreachable: run() always ends with Done")

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """One token for every active row: each phase's budget catches up and decodes, then sampling."""
        if self._cancel.is_set():
            for i in self.active:
                self._finish(self.rows[i], "cancelled", flush=True)
            self.active = []
            return []
        events = self._apply_switch()
        groups: dict[str, list[int]] = {}  # budget -> positions in self.active
        for pos, i in enumerate(self.active):
            groups.setdefault(self.budget_of[self.rows[i].phase], []).append(pos)
        for budget, positions in groups.items():
            try:
                logits, seconds, caught = self._advance(budget, positions)
            except BaseException:
                self.caches.pop(budget, None)  # a forward stopped half-way leaves no usable cache
                raise
            t = time.perf_counter()
            tokens = sample(logits, self.sampling, self.generator).tolist()
            sample_s = time.perf_counter() - t
            events += [c for c in caught if c is not None]
            for pos, tok, s, c in zip(positions, tokens, seconds, caught):
                row = self.rows[self.active[pos]]
                self._account(row, budget, s, sample_s, c)
                events += self._accept(row, tok, budget)
        self._drop_finished()
        return events

    # ------------------------------------------------------------------------------------------ caches

    def _capacity(self) -> int:
        """Tokens a row can reach, so KV caches are allocated once (0 when a limit is open: they grow)."""
        if self.req.max_think_tokens is None or self.req.max_answer_tokens is None:
            return 0
        slack = 64  # the inserted think-closing text and </think>
        return max(len(r.ids) for r in self.rows) + self.req.max_think_tokens + self.req.max_answer_tokens + slack

    def _cache(self, budget: str) -> HybridCache:
        if budget not in self.caches:
            cache = None
            if self.session is not None:
                cache = self.session.take(budget, self.rows[self.active[0]].ids)
            if cache is None:
                cache = self.model.net.new_cache(len(self.active), self.model.budget(budget), self._capacity())
            self.caches[budget] = cache
        return self.caches[budget]

    def _advance(self, budget: str, positions: list[int]) -> tuple[torch.Tensor, list[float], list[CatchUp | None]]:
        """Next-token logits [n, V] of the rows at `positions` from `budget`, the seconds each row's forward
        took, and a CatchUp for each row that consumed more than one token."""
        cache = self._cache(budget)
        rows = [self.rows[self.active[p]] for p in positions]
        gaps = [len(r.ids) - cache.lengths[p] for r, p in zip(rows, positions)]
        assert min(gaps) >= 1, "a cache consumed tokens its row does not have"
        logits: list[torch.Tensor | None] = [None] * len(positions)
        seconds = [0.0] * len(positions)
        caught: list[CatchUp | None] = [None] * len(positions)
        catching = [j for j, g in enumerate(gaps) if g > 1]
        if catching and cache.batch_size > 1:  # size the batch's KV once for every row catching up
            for s in cache.layers:
                if isinstance(s, KVCache):
                    s.grow(max(len(rows[j].ids) for j in catching))
        for j in catching:
            t = time.perf_counter()
            logits[j], ran, transplanted = self._catch_up(budget, positions[j], rows[j])
            seconds[j] = time.perf_counter() - t
            caught[j] = CatchUp(rows[j].index, budget, ran, seconds[j], not rows[j].prefilled, transplanted,
                                self._now())
        decoding = [j for j, g in enumerate(gaps) if g == 1]
        if decoding:
            t = time.perf_counter()
            out = self._decode(budget, [positions[j] for j in decoding])
            dt = time.perf_counter() - t
            for k, j in enumerate(decoding):
                logits[j], seconds[j] = out[k], dt
        return torch.stack(logits), seconds, caught

    def _forward(self, ids: list[int] | torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """Last-position logits [B, V]; advances `cache` (prefilled in chunks by the network)."""
        if not isinstance(ids, torch.Tensor):
            ids = torch.tensor([ids], device=self.model.net.device)
        return self.model.net.forward(ids, None, cache, last_only=True)[:, -1]

    def _decode(self, budget: str, positions: list[int]) -> torch.Tensor:
        """One token for each row at `positions` (each row's last token), batched."""
        cache = self.caches[budget]
        last = torch.tensor([[self.rows[self.active[p]].ids[-1]] for p in positions], device=self.model.net.device)
        if positions == list(range(cache.batch_size)):
            return self._forward(last, cache)
        sub = take_rows(cache, positions)
        out = self._forward(last, sub)
        put_rows(cache, positions, sub)
        return out

    def _catch_up(self, budget: str, pos: int, row: _Row) -> tuple[torch.Tensor, int, bool]:
        """Bring `budget`'s cache of one row up to the row's last token in one chunked prefill; returns the
        logits [V], the tokens run and whether it started from another budget's states."""
        cache = self.caches[budget]
        whole = cache.batch_size == 1
        sub = cache if whole else take_rows(cache, [pos])
        transplanted = False
        if self.req.transplant and (src := self._transplant_source(budget, pos)) is not None:
            src = src if src.batch_size == 1 else take_rows(src, [pos])
            sub = transplant(src, self.model.budget(budget), self.model.net.new_cache)
            transplanted = True
        n, target = sub.lengths[0], len(row.ids)
        ran = target - n
        if self.mark is not None and n < self.mark <= target:  # snapshot where the next turn will diverge
            out = self._forward(row.ids[n:self.mark], sub)
            self.session.snapshot(budget, sub, row.ids[: self.mark])
            n = self.mark
        if n < target:
            out = self._forward(row.ids[n:target], sub)
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

    def _drop_finished(self) -> None:
        keep = [pos for pos, i in enumerate(self.active) if self.rows[i].finish_reason is None]
        if keep and len(keep) < len(self.active):
            self.caches = {name: take_rows(c, keep) for name, c in self.caches.items()}
        self.active = [self.active[pos] for pos in keep]

    def _apply_switch(self) -> list[Event]:
        with self._lock:
            pending, self._switch = self._switch, {}
        events: list[Event] = []
        for phase, name in pending.items():
            if self.budget_of[phase] != name:
                self.budget_of[phase] = name
                events.append(Switch(phase, name, self._now()))
        return events

    # ------------------------------------------------------------------------------------------ phases

    def _accept(self, row: _Row, tok: int, budget: str) -> list[Event]:
        """Append a sampled token and move the row's phase machine."""
        row.ids.append(tok)
        phase = row.phase
        row.generated[phase] += 1
        if phase == "think":
            row.think_len += 1
        if tok in self.stops:
            reason = "eos" if tok in self.sp.eos and not self.req.ignore_eos else "stop"
            return [self._token(row, tok, budget, self._finish(row, reason, flush=True))]
        if phase == "think" and tok == self.sp.think_end:
            events: list[Event] = [self._token(row, tok, budget, self._flush(row))]
            row.think_end = "model"
            return events + self._enter(row, "answer")
        text = self._push_text(row, tok)
        if phase == "think":
            events = [self._token(row, tok, budget, text)]
            limit = self.req.max_think_tokens
            if limit is not None and row.generated["think"] >= limit:
                events += self._close_thinking(row)
            return events
        limit = self.req.max_answer_tokens
        if row.finish_reason is None and limit is not None and row.generated["answer"] >= limit:
            text += self._finish(row, "answer_limit", flush=True)
        return [self._token(row, tok, budget, text)]

    def _enter(self, row: _Row, phase: str, at_start: bool = False) -> list[Event]:
        row.phase = phase
        row.decoder = self.tokenizer.decoder() if self.tokenizer is not None else None
        if phase == "think" and self.req.max_think_tokens == 0:
            return self._close_thinking(row)
        if phase == "answer":
            if at_start:
                row.think_end = "prompt" if self.sp.think_end in row.ids else None
            if self.req.max_answer_tokens == 0:
                self._finish(row, "answer_limit", flush=True)
        return []

    def _close_thinking(self, row: _Row) -> list[Event]:
        """The think token budget ran out: append the closing text and `</think>`, then answer."""
        budget = self.budget_of["think"]
        events: list[Event] = []
        for tok in self.close_ids[:-1]:
            row.ids.append(tok)
            row.think_len += 1
            events.append(self._token(row, tok, budget, self._push_text(row, tok), forced=True))
        row.ids.append(self.close_ids[-1])
        row.think_len += 1
        events.append(self._token(row, self.close_ids[-1], budget, self._flush(row), forced=True))
        row.think_end = "budget"
        return events + self._enter(row, "answer")

    def _push_text(self, row: _Row, tok: int) -> str:
        """New visible text of the row's phase; in the answer, stop strings are matched (and held back)."""
        piece = row.decoder.push(tok) if row.decoder is not None else ""
        row.text[row.phase] += piece
        if row.phase == "think":
            return piece
        return self._show(row, len(piece))

    def _show(self, row: _Row, new: int) -> str:
        text, stops = row.text["answer"], self.req.stop
        if stops:
            start = max(0, len(text) - new - max(map(len, stops)) + 1)
            hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
            if hits:
                row.text["answer"] = text = text[: min(hits)]
                self._finish(row, "stop")
                return self._emit(row, len(text))
            hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            return self._emit(row, len(text) - hold)
        return self._emit(row, len(text))

    def _emit(self, row: _Row, upto: int) -> str:
        out = row.text["answer"][row.shown:upto]
        row.shown = max(row.shown, upto)
        return out

    def _flush(self, row: _Row) -> str:
        """End of a phase's text: what the decoder (and, in the answer, the stop-string check) held back."""
        piece = row.decoder.flush() if row.decoder is not None else ""
        row.text[row.phase] += piece
        if row.phase == "think":
            return piece
        return self._emit(row, len(row.text["answer"]))

    def _finish(self, row: _Row, reason: str, flush: bool = False) -> str:
        """Mark the row finished; with `flush`, return the text still held back (a stop string found in
        the text finishes without it: what was held back belongs to the stop string)."""
        if row.finish_reason is not None:
            return ""
        rest = self._flush(row) if flush else ""
        row.finish_reason, row.finish_phase = reason, row.phase
        return rest

    def _token(self, row: _Row, tok: int, budget: str, text: str, forced: bool = False) -> Token:
        return Token(row.index, tok, text, row.phase, budget, forced, self._now())

    # ------------------------------------------------------------------------------------------ results

    def _account(self, row: _Row, budget: str, forward_s: float, sample_s: float, caught: CatchUp | None) -> None:
        """Time of one token: the row's first forward is the prefill; later multi-token ones are catch-ups;
        everything after the prefill counts toward the phase the token belongs to."""
        st = row.stats
        phase_s = sample_s
        if not row.prefilled:
            st.prefill_tokens += caught.tokens if caught is not None else 1
            st.prefill_s += forward_s
            row.prefilled = True
        else:
            phase_s += forward_s
            if caught is not None:
                st.catch_up_tokens += caught.tokens
                st.catch_up_s += caught.seconds
        if caught is not None and caught.transplanted:
            st.transplants += 1
        budgets = st.think_budgets if row.phase == "think" else st.answer_budgets
        if not budgets or budgets[-1] != budget:
            budgets.append(budget)
        if row.phase == "think":
            st.think_s += phase_s
        else:
            st.answer_s += phase_s

    def results(self) -> list[Result]:
        out = []
        for row in self.rows:
            p, t = row.prompt_len, row.prompt_len + row.think_len
            row.stats.think_tokens, row.stats.answer_tokens = row.think_len, len(row.ids) - t
            row.stats.think_inserted = row.think_len - row.generated["think"]
            out.append(Result(list(row.ids), p, row.ids[p:t], row.ids[t:], row.text["think"], row.text["answer"],
                              row.finish_reason or "cancelled", row.finish_phase or row.phase, row.think_end,
                              row.stats))
        return out

    def _now(self) -> float:
        return time.perf_counter() - self.t0


# ---------------------------------------------------------------------------------------------- streaming

_END = object()


@dataclass
class _Failure:
    error: BaseException


def _produce(generation: Generation, out: queue.Queue, on_done) -> None:
    """The background thread: run the generation, hand every event over. It holds no reference to the
    Stream, so a Stream dropped by its consumer is collected, and cancels its generation."""
    try:
        for ev in generation.run():
            if isinstance(ev, Done) and on_done is not None:
                on_done(ev.results)
            out.put(ev)
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer's thread
        out.put(_Failure(e))
    finally:
        out.put(_END)


class Stream:
    """Events of a generation that runs on a background thread. Iterate to receive them (one consumer);
    `switch` and `cancel` work from any thread at any time; `results()` waits for the end. Leaving a
    `with` block, or dropping the stream, cancels what is left.

        with m.stream(ids, think_budget="small") as s:
            for ev in s:
                if isinstance(ev, Token): print(ev.text, end="")
    """

    def __init__(self, generation: Generation, on_done=None):
        self.generation = generation
        self._queue: queue.Queue = queue.Queue()
        self._results: list[Result] | None = None
        self._drained = False
        self._thread = threading.Thread(target=_produce, args=(generation, self._queue, on_done),
                                        name="elastic-generate", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[Event]:
        while not self._drained:
            ev = self._queue.get()
            if ev is _END:
                self._drained = True
            elif isinstance(ev, _Failure):
                self._drained = True
                raise ev.error
            else:
                if isinstance(ev, Done):
                    self._results = ev.results
                yield ev

    def switch(self, think: str | None = None, answer: str | None = None) -> None:
        self.generation.switch(think=think, answer=answer)

    def cancel(self) -> None:
        self.generation.cancel()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def results(self) -> list[Result]:
        for _ in self:
            pass
        self._thread.join()
        if self._results is None:
            raise RuntimeError("the generation failed before it finished")
        return self._results

    @property
    def result(self) -> Result:
        return self.results()[0]

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()
        self._thread.join()

    def __del__(self) -> None:
        self.generation.cancel()
