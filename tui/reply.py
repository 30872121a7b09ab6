"""A reply as it streams: the engine's events folded into text, switch marks and live rates.

`Reply.apply(event)` is pure bookkeeping (no UI, no IO), so the widget, the history file and the tests
all read one account of what happened. `pump` runs on the generation worker's thread: it reads the
engine's Stream, folds each event in, and every `Pace.every` seconds (and at once for a switch or the
end) saves the reply to the history and hands the events to the UI as one batch, so a fast model is not
slowed to the speed of the screen.

Why a pace, measured rather than fixed: every batch costs the UI thread a Textual layout and render (20-40
ms of Python on the demo's 80x24 screen on the 2-core CI machine, cProfile), and while the UI thread runs Python
the generation thread waits for the interpreter. The screen measures its own thread's CPU time per batch
and the pump spaces batches so that it stays near `Pace.share` of the wall time: 10 batches a second where
rendering is cheap, fewer on a slow machine, never fewer than two a second.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from elastic_local.engine.events import CatchUp, Done, Event, Switch, Token


@dataclass
class Mark:
    """A live budget switch: from character `at` of the phase's text on, `phase` ran on `budget`; the
    catch-up the new budget needed (the tokens it had not seen) once it ran."""

    phase: str
    budget: str
    at: int
    tokens: int | None = None
    seconds: float | None = None

    def label(self) -> str:
        cost = "" if self.tokens is None else f", caught up {self.tokens} tokens in {self.seconds:.2f} s"
        return f"{self.phase} -> {self.budget}{cost}"


@dataclass
class Rate:
    """Tokens of one phase and the time they took, from the events' clock: the tokens that came after the
    phase's first ones over the time since. Tokens come in runs of one clock reading (a greedy row's run
    ahead: 2 ms of tokens, their events made together), so counting from the first token's time took the
    rest of its run as made in no time: a reply's 11 answer tokens showed 139,000 tok/s."""

    tokens: int = 0
    start: float | None = None  # the clock of the phase's first tokens
    end: float = 0.0
    later: int = 0  # tokens with a later clock than `start`

    def add(self, t: float) -> None:
        self.start = t if self.start is None else self.start
        self.tokens, self.end = self.tokens + 1, t
        self.later += t > self.start

    @property
    def per_second(self) -> float | None:
        if self.start is None or not self.later or self.end <= self.start:
            return None
        return self.later / (self.end - self.start)


@dataclass
class Reply:
    think_budget: str
    answer_budget: str
    thinking: bool = True  # thinking on for this message
    think: str = ""
    answer: str = ""
    phase: str = "think"
    status: str = "streaming"
    marks: list[Mark] = field(default_factory=list)
    rates: dict[str, Rate] = field(default_factory=lambda: {"think": Rate(), "answer": Rate()})
    prompt_tokens: int = 0
    stats: dict | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        self.phase = "think" if self.thinking else "answer"

    @property
    def tokens(self) -> int:
        """Tokens in the context: the prompt and everything generated so far."""
        if self.stats is not None:
            return self.prompt_tokens + self.stats["think_tokens"] + self.stats["answer_tokens"]
        return self.prompt_tokens + self.rates["think"].tokens + self.rates["answer"].tokens

    def apply(self, ev: Event) -> None:
        if isinstance(ev, Token):
            self.phase = ev.phase
            setattr(self, ev.phase, getattr(self, ev.phase) + ev.text)
            self.rates[ev.phase].add(ev.t)
        elif isinstance(ev, Switch):
            setattr(self, f"{ev.phase}_budget", ev.budget)
            self.marks.append(Mark(ev.phase, ev.budget, len(getattr(self, ev.phase))))
        elif isinstance(ev, CatchUp) and not ev.prefill:
            # the prompt's own prefill is no switch's cost: a switch that reached the engine before it ran the
            # prompt on the budget switched to, and nothing caught up
            for mark in reversed(self.marks):  # the budget a switch brought in, catching up
                if mark.budget == ev.budget and mark.tokens is None:
                    mark.tokens, mark.seconds = ev.tokens, ev.seconds
                    break
        elif isinstance(ev, Done):
            r = ev.results[0]
            self.think, self.answer = r.think_text, r.answer_text
            self.prompt_tokens = r.prompt_len
            self.stats = asdict(r.stats)
            self.status = "stopped" if r.finish_reason == "cancelled" else "done"

    def meta(self) -> dict:
        """What the history keeps besides the text."""
        return {"think_budget": self.think_budget, "answer_budget": self.answer_budget, "thinking": self.thinking,
                "marks": [asdict(m) for m in self.marks], "stats": self.stats, "prompt_tokens": self.prompt_tokens,
                **({"error": self.error} if self.error else {})}

    @classmethod
    def from_history(cls, content: str, reasoning: str, status: str, meta: dict) -> Reply:
        r = cls(meta.get("think_budget", "?"), meta.get("answer_budget", "?"), meta.get("thinking", True),
                think=reasoning, answer=content, status=status, prompt_tokens=meta.get("prompt_tokens", 0),
                stats=meta.get("stats"), error=meta.get("error"))
        r.marks = [Mark(**m) for m in meta.get("marks", [])]
        r.phase = "answer" if content or not r.thinking else "think"
        return r


@dataclass
class Pace:
    """How often the pump hands the UI a batch. The UI thread calls `measured` with the CPU time it spent
    since the previous batch; the pump reads `every` (a float: safe to share between the two threads)."""

    share: float = 0.05  # of the wall time the UI thread may take from generation
    fastest: float = 0.1
    slowest: float = 0.5  # text still arrives twice a second on a slow machine
    every: float = 0.1

    def measured(self, ui_cpu_s: float) -> None:
        want = min(self.slowest, max(self.fastest, ui_cpu_s / self.share))
        # slower at once (a short reply has few batches to learn from), faster gradually (one cheap
        # frame does not bring the cost back)
        self.every = want if want > self.every else 0.5 * (self.every + want)


def urgent(ev: Event) -> bool:
    """Shown at once, not at the pace: what a person did (a switch, with what its catch-up cost) and the end.
    The prompt's prefill and the answer's first tokens wait for the next batch like any token."""
    return isinstance(ev, (Switch, Done)) or (isinstance(ev, CatchUp) and not ev.prefill)


def pump(events: Iterable[Event], reply: Reply, save: Callable[[Reply], None],
         post: Callable[[list[Event]], None], pace: Pace | None = None) -> None:
    """Fold `events` into `reply`, saving and posting in batches (module docstring). An exception from the
    engine marks the reply "error" (saved) and is re-raised."""
    pace = pace or Pace()
    batch: list[Event] = []
    last = time.monotonic()
    try:
        for ev in events:
            reply.apply(ev)
            batch.append(ev)
            now = time.monotonic()
            if now - last >= pace.every or urgent(ev):
                save(reply)
                post(batch)
                batch, last = [], now
    except Exception as e:
        reply.status, reply.error = "error", f"{type(e).__name__}: {e}"
        raise
    finally:
        if reply.status == "streaming":  # the events ended without Done: nothing more will come
            reply.status = "stopped"
        save(reply)
        if batch:
            post(batch)
