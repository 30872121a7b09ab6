"""Generation with elastic budget control: the loop that ties rows, caches and sampling together.

    step():  for each budget in use:  caches catch up and decode  ->  sample  ->  rows accept the tokens

Every sequence (a Row, phases.py) is in a phase, and the phase picks the budget that produces its next
token; rows on the same budget decode together, each budget from its own cache (cacheset.py). Budget
control lives in the rows (think token budget, answer limit, stop strings); a live switch
(`Generation.switch`, from any thread) takes effect at the next token; cancel is checked before every
step, and a step is never interrupted, so every cache always holds a prefix of its row. A step may run a
lone row several tokens ahead in one call of the C decode step (`run(ahead=True)`), greedy or sampled (its
uniform numbers drawn from its generator beforehand, the unused ones given back), up to the next decision
only its Row can make; a switch or cancel stops such a run at the token it arrives in.

Rows may carry their own Request (budgets, limits, sampling, stops) and may join (`add`) and leave
between steps: finished rows are dropped from every cache and, for a batch runner, handed out by
`take_finished`. Rows that share a Request share its seeded random generator. The thread that streams
events lives in stream.py; the engine knows nothing about chat templates.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .caches import Session
from .cacheset import CacheSet
from .events import CatchUp, Done, Event, Result, Switch, Token
from .phases import Piece, Request, Row, Rules, Specials
from .sampling import Sampling, sample

if TYPE_CHECKING:
    from ..model.nemotron_h import HybridCache
    from .elastic_model import ElasticModel

__all__ = ["Generation", "Request", "Specials"]

# KV caches are allocated once for a row's whole reach (prompt + every token it may generate) up to this
# many positions; a larger limit (max_tokens 10**9, or a 256K context) grows them by doubling instead, so
# memory follows the tokens actually generated, not the limit.
PREALLOC_TOKENS = 32768

# How far `run(ahead=True)` lets a lone row run ahead of its events in one call (model.decode_ahead):
# as many tokens as the last ones say fit in this time. On the demo model a token is 60-130 us, and the
# Python around each step (the call, sampling, the loop) a fifth to a third of it (docs/decode-speed.md, "Greedy tokens
# ahead"); a model whose token takes longer than this runs one token a call.
RUN_AHEAD_S = 0.002
# collect()'s runs ahead: nobody reads its events between tokens (a cancel still stops a run at its token),
# so a run goes on to the row's next decision, bounded only so that, with no token limit set, a run's KV
# cache grows by this much time's tokens at most (one call for a 48-token demo answer instead of two to
# four: 0.5-1.7 us a token less, each call's Python after 3 ms of C running on cold caches).
QUIET_RUN_AHEAD_S = 0.05


def preallocated(capacity: int) -> int:
    """The KV positions to allocate up front for `capacity` reachable tokens (0: grow as needed)."""
    return capacity if capacity <= PREALLOC_TOKENS else 0


def check_prompt(prompt: Sequence[int], vocab: int, context: int | None) -> None:
    """A prompt is one or more token ids of the vocabulary, shorter than the context; else a ValueError."""
    if len(prompt) == 0:
        raise ValueError("every prompt needs at least one token")
    for t in prompt:
        try:
            ok = not isinstance(t, bool) and 0 <= operator.index(t) < vocab
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"prompt token {t!r} is not an id of the vocabulary of {vocab} (0..{vocab - 1})")
    if context is not None and len(prompt) >= context:
        raise ValueError(f"the prompt has {len(prompt)} tokens, but the model's context is {context} "
                         "(max_position_embeddings in config.json), prompt and reply included; shorten it")


@dataclass
class _Options:
    """A Request as the loop uses it: the rows' rules, its sampling and seeded generator, its budgets."""

    req: Request
    rules: Rules
    sampling: Sampling
    generator: torch.Generator | None
    budget_of: dict[str, str]  # phase -> budget name


class Generation:
    """Rows, their phases and one cache per budget; `run()` yields events until every row is finished,
    or drive it with `add` / `step` / `take_finished` (continuous batching)."""

    def __init__(self, model: ElasticModel, prompts: Sequence[Sequence[int]], req: Request,
                 session: Session | None = None, mark: int | None = None,
                 cancel: threading.Event | None = None):
        for p in prompts:
            check_prompt(p, model.config.vocab_size, model.context_limit)
        if session is not None and len(prompts) != 1:
            raise ValueError("a session holds one sequence; batch generations run without one")
        self.model, self.req = model, req
        self.tokenizer, self.sp = model.tokenizer, model.specials
        self.rows: dict[int, Row] = {}
        self.active: list[int] = []  # the row order of every cache
        self.options: dict[int, _Options] = {}  # row index -> its request's options (shared objects)
        self.states = CacheSet(model, session, mark)
        self.session = session
        self._next = 0
        self._pending: list[Event] = []  # events of rows that started between steps
        self._cancel = cancel or threading.Event()
        self._inference = torch.inference_mode()  # one object: a new one a step cost 0.9 us more
        self._switch: dict[str, str] = {}
        self._lock = threading.Lock()
        self._halt = torch.zeros(1, dtype=torch.int32)  # set by switch / cancel: a run ahead stops at its token
        self._halt_flag = self._halt.numpy()  # the same int, set through numpy: 0.1 us where torch's [0] took 2
        self._quiet = False  # collect(): no Token events are built, nobody would read them
        self.t0 = time.perf_counter()
        self._default = self._compile(req)
        for p in prompts:
            self._add(p, self._default)

    @property
    def caches(self) -> dict[str, HybridCache]:
        """Budget name -> its cache (for inspection)."""
        return self.states.settle()

    # ------------------------------------------------------------------------------------------ rows

    def add(self, prompt: Sequence[int], req: Request | None = None) -> int:
        """Start another row (its own Request, default: the generation's); it joins at the next step.
        Returns its index (the `row` of its events). Unknown budget names raise KeyError here."""
        check_prompt(prompt, self.model.config.vocab_size, self.model.context_limit)
        if self.session is not None:
            raise ValueError("a session holds one sequence; batch generations run without one")
        return self._add(prompt, self._default if req is None else self._compile(req))

    def _compile(self, req: Request) -> _Options:
        largest = self.model.budgets[0]
        budget_of = {"think": req.think_budget or largest, "answer": req.answer_budget or largest}
        for name in budget_of.values():
            self.model.budget(name)  # unknown names fail here, before any work
        sampling = req.sampling
        rules = Rules.of(req, self.sp, self.tokenizer, self.model.context_limit)
        return _Options(req, rules, sampling, sampling.generator(self.model.device), budget_of)

    def _add(self, prompt: Sequence[int], opts: _Options) -> int:
        index, self._next = self._next, self._next + 1
        row = Row(index, [int(t) for t in prompt], opts.rules, self.tokenizer)
        self.rows[index], self.options[index] = row, opts
        self._pending += self._tokens(row, row.start(), opts.budget_of["think"])
        if not row.finished:
            self.states.join(1, preallocated(row.capacity))
            self.active.append(index)
        return index

    def take_finished(self) -> list[tuple[int, Result]]:
        """(index, Result) of every row finished since the last call; the generation then forgets them."""
        done = [(i, row.result()) for i, row in self.rows.items() if row.finished]
        for i, _ in done:
            del self.rows[i], self.options[i]
        return done

    # ------------------------------------------------------------------------------------------ control

    def switch(self, think: str | None = None, answer: str | None = None) -> None:
        """Run `think` / `answer` on other budgets from the next token on (callable from any thread)."""
        for name in (think, answer):
            if name is not None:
                self.model.budget(name)
        with self._lock:
            self._switch.update({p: n for p, n in (("think", think), ("answer", answer)) if n is not None})
        self._halt_flag[0] = 1

    def cancel(self) -> None:
        self._cancel.set()
        self._halt_flag[0] = 1

    # ------------------------------------------------------------------------------------------ the loop

    def run(self, ahead: bool = False) -> Iterator[Event]:
        """Events until every row is finished. With `ahead`, a lone row may run up to RUN_AHEAD_S of
        tokens in one step, their events yielded together after it: for consumers that do not act between
        tokens (collect, a Stream, whose switch and cancel stop a run ahead at the token they arrive in;
        a `cancel` Event set directly is seen after it). The tokens are the same either way."""
        try:
            yield from self._take_pending()
            while self.active:
                yield from self.step(ahead)
        finally:
            if self.session is not None and self.rows:
                self.states.retire(self.rows[0].ids)
        yield Done(self.results(), self._now())

    def collect(self) -> list[Result]:
        """Every row's Result; the Token events no caller reads are not built (a demo token 2-8% faster)."""
        self._quiet = True
        *_, done = self.run(ahead=True)
        return done.results

    def _take_pending(self) -> list[Event]:
        events, self._pending = self._pending, []
        return events

    def step(self, ahead: bool = False) -> list[Event]:
        """One token for every active row: each budget in use catches up and decodes, then sampling (with
        `ahead`, a lone row's run ahead instead: see `run`). A row's phase is charged the step's whole
        wall time, less its prefill: what a caller waited for its token (the forward alone left out 10-20 us
        of a demo model's 70-120: sampling, text, events)."""
        with self._inference:
            return self._step(ahead)

    def _step(self, ahead: bool) -> list[Event]:
        start = time.perf_counter()
        self._halt_flag[0] = 0  # a switch or cancel from now on stops a run ahead
        events = self._take_pending()
        if self._cancel.is_set():
            for i in self.active:
                self.rows[i].cancel()
            self.active = []
            return events
        events += self._apply_switch()
        if ahead and len(self.active) == 1 and (tokens := self._run_ahead(start)) is not None:
            return events + tokens
        groups: dict[str, list[int]] = {}  # budget -> positions in self.active
        for pos, i in enumerate(self.active):
            groups.setdefault(self.options[i].budget_of[self.rows[i].phase], []).append(pos)
        capacity = self._capacity()
        took: list[tuple[Row, str, float]] = []  # each row that took a token: its phase, its prefill seconds
        for budget, positions in groups.items():
            rows = [self.rows[self.active[p]] for p in positions]
            logits, seconds, caught = self.states.advance(
                budget, positions, [r.ids for r in rows], capacity,
                [self.options[r.index].req.transplant for r in rows])
            tokens = self._sample(logits, rows)
            catch_ups = [None if c is None else CatchUp(r.index, budget, c.tokens, s, not r.prefilled, c.transplanted,
                                                        c.end - self.t0)
                         for r, s, c in zip(rows, seconds, caught)] if any(caught) else caught
            events += [c for c in catch_ups if c is not None]
            for row, tok, s, c in zip(rows, tokens, seconds, catch_ups):
                took.append((row, row.phase, self._account(row, budget, s, c)))  # the phase it was sampled in
                events += self._tokens(row, row.accept(tok), budget)
        self._drop_finished()
        spent = time.perf_counter() - start
        for row, phase, prefill_s in took:
            if phase == "think":
                row.stats.think_s += spent - prefill_s
            else:
                row.stats.answer_s += spent - prefill_s
        return events

    def _run_ahead(self, start: float) -> list[Event] | None:
        """The lone row's tokens in one call: as many as the budget's last ones on this model say fit in
        RUN_AHEAD_S, QUIET_RUN_AHEAD_S for collect (one the first time, to time it), up to the next decision
        only its Row can make (Row.run_ahead); None where a normal step runs instead (a budget catching up,
        no C step). Each token is its budget's argmax, or drawn with the generator's next uniform number,
        as a step's would be (model/sample.c draws for both on the CPU)."""
        row = self.rows[self.active[0]]
        opts = self.options[row.index]
        draw = None if opts.sampling.greedy else (opts.sampling.params(), opts.generator)
        left, ends = row.run_ahead()
        budget, phase = opts.budget_of[row.phase], row.phase
        token_s = self.model.token_s.get(budget)
        n = max(1, int((QUIET_RUN_AHEAD_S if self._quiet else RUN_AHEAD_S) / token_s)) if token_s else 1
        tokens = self.states.run_ahead(budget, row.ids, min(n, left), ends, self._halt, draw)
        if tokens is None:
            return None
        self._account(row, budget, 0.0, None)
        events: list[Event] = []
        if self._quiet:
            row.accept_run(tokens)
        else:
            for tok in tokens:
                assert not row.finished and row.phase == phase, "a run ahead went past its row's decision"
                events += self._tokens(row, row.accept(tok), budget)
        self._drop_finished()
        spent = time.perf_counter() - start
        if phase == "think":
            row.stats.think_s += spent
        else:
            row.stats.answer_s += spent
        self.model.token_s[budget] = spent / len(tokens)
        return events

    def _sample(self, logits: torch.Tensor, rows: list[Row]) -> list[int]:
        """One token per row: greedy rows in one argmax whatever their Requests (a batch file's rows each
        have one: an argmax a row cost a demo batch step of 16 rows 7% of its time), rows sharing a sampled
        Request drawing together from its generator."""
        groups: dict[int | None, list[int]] = {}
        for j, row in enumerate(rows):
            opts = self.options[row.index]
            groups.setdefault(None if opts.sampling.greedy else id(opts), []).append(j)
        if len(groups) == 1:
            opts = self.options[rows[0].index]
            return sample(logits, opts.sampling, opts.generator)
        tokens = [0] * len(rows)
        for js in groups.values():
            opts = self.options[rows[js[0]].index]
            for j, tok in zip(js, sample(logits[js], opts.sampling, opts.generator)):
                tokens[j] = tok
        return tokens

    def _capacity(self) -> int:
        """Tokens the longest active row can reach, so KV caches are allocated once (0: a limit is open, or
        so far off that the caches grow instead: see PREALLOC_TOKENS)."""
        caps = [self.rows[i].capacity for i in self.active]
        return 0 if not caps or 0 in caps else preallocated(max(caps))

    def _drop_finished(self) -> None:
        keep = [pos for pos, i in enumerate(self.active) if not self.rows[i].finished]
        if len(keep) == len(self.active):
            return
        if keep:
            self.states.keep(keep)
        else:
            self.states.retire(self.rows[self.active[0]].ids)
        self.active = [self.active[pos] for pos in keep]

    def _apply_switch(self) -> list[Event]:
        if not self._switch:  # read without the lock: a switch arriving now is taken at the next token
            return []
        with self._lock:
            pending, self._switch = self._switch, {}
        events: list[Event] = []
        for phase, name in pending.items():
            targets = {id(o): o for o in self.options.values()}.values()
            if any(o.budget_of[phase] != name for o in targets):
                for o in targets:
                    o.budget_of[phase] = name
                events.append(Switch(phase, name, self._now()))
        return events

    # ------------------------------------------------------------------------------------------ results

    def _tokens(self, row: Row, pieces: list[Piece], budget: str) -> list[Event]:
        """Token events of a row's pieces; a forced token is credited to the think phase's budget."""
        if self._quiet:
            return []
        think = self.options[row.index].budget_of["think"]
        return [Token(row.index, p.id, p.text, p.phase, think if p.forced else budget, p.forced, self._now())
                for p in pieces]

    def _account(self, row: Row, budget: str, forward_s: float, caught: CatchUp | None) -> float:
        """A row's forward before its token: the first is the prefill (its seconds are returned: the step's
        rest goes to the phase), later multi-token ones are catch-ups (counted in the phase too)."""
        st = row.stats
        prefill_s = 0.0
        if not row.prefilled:
            st.prefill_tokens += caught.tokens if caught is not None else 1
            prefill_s = forward_s
            st.prefill_s += forward_s
            row.prefilled = True
        elif caught is not None:
            st.catch_up_tokens += caught.tokens
            st.catch_up_s += caught.seconds
        if caught is not None and caught.transplanted:
            st.transplants += 1
        budgets = st.think_budgets if row.phase == "think" else st.answer_budgets
        if not budgets or budgets[-1] != budget:
            budgets.append(budget)
        return prefill_s

    def results(self) -> list[Result]:
        return [row.result() for row in self.rows.values()]

    def _now(self) -> float:
        return time.perf_counter() - self.t0
