"""The phase machine of one sequence: phases, token budgets, stop strings and the text its tokens make.

    prompt ... <think>| thinking ... </think>| answer ... eos
                      \\_ think budget _/     \\_ answer budget _/

A Row is pure bookkeeping: it is handed token ids one at a time and says what visible text they
complete, when thinking closes (the model wrote `</think>`, or the think token budget ran out and the
row appends the closing text and `</think>` itself: forced tokens) and when the sequence ends (eos, a
stop token or string, the answer limit). It runs no model and holds no cache (cacheset.py); the loop
in generate.py feeds it the tokens it samples and turns its Pieces into Token events.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import NamedTuple

from .events import Result, Stats
from .sampling import Sampling
from .tokenizer import Tokenizer

PHASES = ("think", "answer")
UNLIMITED = 2**62  # Row.run_ahead's count where no limit is set
# The text appended before `</think>` when the think token budget runs out (the recipe NVIDIA's and
# Qwen's budget-control examples use; "" appends `</think>` alone), where neither the request nor the
# checkpoint (generation_config.json's "think_close") names one.
THINK_CLOSE = ("\n\nConsidering the limited time by the user, I have to give the solution based on the thinking "
               "directly now.\n")


@dataclass(frozen=True)
class Specials:
    """The token ids the phase machine reacts to."""

    think_start: int | None = None
    think_end: int | None = None
    eos: frozenset[int] = frozenset()
    think_close: str | None = None  # the checkpoint's closing text (generation_config.json), if it names one


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
    think_close: str | None = None  # None: the checkpoint's (Specials.think_close), else THINK_CLOSE
    transplant: bool = False  # a budget taking over reuses another budget's states (approximate)

    def __post_init__(self) -> None:
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        self.stop_ids = tuple(self.stop_ids)
        for name in ("max_think_tokens", "max_answer_tokens"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise ValueError(f"{name}={n!r} must be a whole number >= 0 (or None: no limit)")

    @classmethod
    def of(cls, **options) -> Request:
        """A Request from generate's / stream's / a chat's keyword options. A name it does not know is a
        TypeError naming the ones it does, and the likely one: other runners' `max_new_tokens` is two
        limits here, one a phase."""
        known = [f.name for f in fields(cls)]
        for name in options:
            if name not in known:
                likely = ALIASES.get(name) or " or ".join(difflib.get_close_matches(name, known, n=2))
                raise TypeError(f"unknown generation option {name!r}" + (f"; did you mean {likely}?" if likely else "")
                                + f" The options are: {', '.join(known)}")
        return cls(**options)

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)


# Other runners' names for what a Request splits by phase.
_LIMITS = "max_think_tokens and max_answer_tokens (a limit per phase)"
ALIASES = {"max_new_tokens": _LIMITS, "max_tokens": _LIMITS, "budget": "think_budget and answer_budget",
           "stop_strings": "stop", "stop_token_ids": "stop_ids", "eos_token_id": "stop_ids"}


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


@dataclass(frozen=True)
class Rules:
    """A Request read against the model's special tokens and tokenizer: what a Row checks at each token."""

    specials: Specials
    max_think: int | None
    max_answer: int | None
    stop: tuple[str, ...]  # stop strings (answer text only)
    stops: frozenset[int]  # token ids that end the sequence
    eos: frozenset[int]  # those of them reported as "eos" (none with ignore_eos)
    close_ids: tuple[int, ...]  # appended when the think budget runs out: the closing text, then `</think>`
    context: int | None = None  # tokens a row may fill, prompt included (None: no limit)

    @cached_property
    def think_ends(self) -> frozenset[int]:
        """The ids that end the thinking phase or the row: the stops and `</think>` (built once per Rules: a
        Row asks at every run ahead)."""
        end = self.specials.think_end
        return self.stops if end is None else self.stops | {end}

    @classmethod
    def of(cls, req: Request, sp: Specials, tokenizer: Tokenizer | None, context: int | None = None) -> Rules:
        eos = frozenset() if req.ignore_eos else sp.eos
        close: list[int] = []
        if sp.think_end is not None:
            said = next(t for t in (req.think_close, sp.think_close, THINK_CLOSE) if t is not None)
            text = tokenizer.encode(said) if tokenizer is not None and said else []
            close = text + [sp.think_end]
        return cls(sp, req.max_think_tokens, req.max_answer_tokens, req.stop, eos | frozenset(req.stop_ids), eos,
                   tuple(close), context)


class Piece(NamedTuple):
    """A token a Row appended and the visible text it completes (see events.Token). A tuple: a Row makes
    one a token, and a frozen dataclass cost 0.8 us of a demo token's 70."""

    id: int
    text: str
    phase: str
    forced: bool


class Row:
    """One sequence being generated: its tokens, phase, counts and text. `start()` once, then `accept()`
    every sampled token until `finished`."""

    def __init__(self, index: int, prompt: list[int], rules: Rules, tokenizer: Tokenizer | None):
        self.index, self.rules, self.tokenizer = index, rules, tokenizer
        self.ids = list(prompt)
        self.prompt_len = len(self.ids)
        self.phase = start_phase(self.ids, rules.specials)
        self.capacity = self._capacity()
        self.think_len = 0  # tokens appended while thinking (forced ones included)
        self.generated = {"think": 0, "answer": 0}  # sampled only
        self.text = {"think": "", "answer": ""}
        self.shown = 0  # answer characters emitted (the rest is held back: it may begin a stop string)
        self.decoder = None
        self.think_end: str | None = None
        self.finish_reason: str | None = None
        self.finish_phase: str | None = None
        # filled by the generation loop, not read here: timing, and whether the prompt has been run
        self.stats = Stats(prompt_tokens=len(self.ids))
        self.prefilled = False

    def _capacity(self) -> int:
        """Tokens the row can reach, so caches are sized once (0 when a limit is open: they grow)."""
        r = self.rules
        thinking = self.phase == "think"
        if r.max_answer is None or (thinking and r.max_think is None):
            return r.context or 0
        need = len(self.ids) + (r.max_think + len(r.close_ids) if thinking else 0) + r.max_answer
        return min(need, r.context) if r.context else need

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def start(self) -> list[Piece]:
        """Enter the phase the prompt leaves open (a zero think budget closes thinking at once)."""
        return self._enter(self.phase, at_start=True)

    def accept(self, tok: int) -> list[Piece]:
        """Append a sampled token and move the phase machine."""
        return self._accept((tok,))

    def accept_run(self, tokens: Sequence[int]) -> None:
        """`accept` every token of a run ahead, for a caller that reads no pieces (collect): all but the last
        decide nothing (Row.run_ahead's contract), so the run is appended and its text decoded at once (with
        the last token decoded apart, the run's window was decoded again: a 48-token demo answer's Python
        after its C call took 100-121 us, now 66-84; docs/decode-speed.md, "A generation's run ahead in one call")."""
        self._accept(tokens)

    def _accept(self, tokens: Sequence[int]) -> list[Piece]:
        """Append tokens of which only the last may decide (end the phase or the row), then move the phase
        machine on it; the pieces are the last token's, its text the whole run's."""
        r, phase, tok = self.rules, self.phase, tokens[-1]
        self._append(tokens)
        ends_text = tok in r.stops or (phase == "think" and tok == r.specials.think_end)
        if ends_text and len(tokens) > 1:  # the last token's own text is not shown: the others' is
            self._push_text(tokens[:-1])
        if tok in r.stops:
            reason = "eos" if tok in r.eos else "stop"
            return [Piece(tok, self._finish(reason, flush=True), phase, False)]
        if phase == "think" and tok == r.specials.think_end:
            pieces = [Piece(tok, self._flush(), phase, False)]
            self.think_end = "model"
            return pieces + self._enter("answer")
        text = self._push_text(tokens)
        if phase == "think":
            pieces = [Piece(tok, text, phase, False)]
            if r.context is not None and len(self.ids) >= r.context:
                pieces[-1] = Piece(tok, text + self._finish("context_limit", flush=True), phase, False)
            elif r.max_think is not None and self.generated["think"] >= r.max_think:
                pieces += self._close_thinking()
            return pieces
        if not self.finished and r.max_answer is not None and self.generated["answer"] >= r.max_answer:
            text += self._finish("answer_limit", flush=True)
        if not self.finished and r.context is not None and len(self.ids) >= r.context:
            text += self._finish("context_limit", flush=True)
        return [Piece(tok, text, phase, False)]

    def _append(self, tokens: Sequence[int]) -> None:
        """Sampled tokens onto the sequence and its phase's counts."""
        self.ids += tokens
        self.generated[self.phase] += len(tokens)
        if self.phase == "think":
            self.think_len += len(tokens)

    def run_ahead(self) -> tuple[int, frozenset[int]]:
        """How many tokens the row can take before one of them may end its phase or the row by a count (a
        token budget, the context), and the ids that end them otherwise: the only decisions a loop that runs
        tokens ahead without the row must stop at. An answer with stop strings takes one: its text decides."""
        r, phase = self.rules, self.phase
        left = [] if r.context is None else [r.context - len(self.ids)]
        if phase == "think":
            if r.max_think is not None:
                left.append(r.max_think - self.generated["think"])
            ends = r.think_ends
        else:
            if r.stop:
                return 1, r.stops
            if r.max_answer is not None:
                left.append(r.max_answer - self.generated["answer"])
            ends = r.stops
        return min(left, default=UNLIMITED), ends

    def cancel(self) -> None:
        self._finish("cancelled", flush=True)

    def result(self) -> Result:
        p, t = self.prompt_len, self.prompt_len + self.think_len
        st = self.stats
        st.think_tokens, st.answer_tokens = self.think_len, len(self.ids) - t
        st.think_inserted = self.think_len - self.generated["think"]
        return Result(list(self.ids), p, self.ids[p:t], self.ids[t:], self.text["think"], self.text["answer"],
                      self.finish_reason or "cancelled", self.finish_phase or self.phase, self.think_end, st)

    # ------------------------------------------------------------------------------------------ phases

    def _enter(self, phase: str, at_start: bool = False) -> list[Piece]:
        self.phase = phase
        self.decoder = self.tokenizer.decoder() if self.tokenizer is not None else None
        if phase == "think" and self.rules.max_think == 0:
            return self._close_thinking()
        if phase == "answer":
            if at_start:
                self.think_end = "prompt" if self.rules.specials.think_end in self.ids else None
            if self.rules.max_answer == 0:
                self._finish("answer_limit", flush=True)
        return []

    def _close_thinking(self) -> list[Piece]:
        """The think token budget ran out: append the closing text and `</think>`, then answer."""
        close = self.rules.close_ids
        pieces = []
        for tok in close[:-1]:
            self.ids.append(tok)
            self.think_len += 1
            pieces.append(Piece(tok, self._push_text((tok,)), "think", True))
        self.ids.append(close[-1])
        self.think_len += 1
        pieces.append(Piece(close[-1], self._flush(), "think", True))
        self.think_end = "budget"
        return pieces + self._enter("answer")

    # ------------------------------------------------------------------------------------------ text

    def _push_text(self, tokens: Sequence[int]) -> str:
        """New visible text of the phase; in the answer, stop strings are matched (and held back)."""
        piece = self.decoder.extend(tokens) if self.decoder is not None else ""
        self.text[self.phase] += piece
        if self.phase == "think":
            return piece
        return self._show(len(piece))

    def _show(self, new: int) -> str:
        text, stops = self.text["answer"], self.rules.stop
        if stops:
            start = max(0, len(text) - new - max(map(len, stops)) + 1)
            hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
            if hits:
                self.text["answer"] = text = text[: min(hits)]
                self._finish("stop")
                return self._emit(len(text))
            hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            return self._emit(len(text) - hold)
        return self._emit(len(text))

    def _emit(self, upto: int) -> str:
        out = self.text["answer"][self.shown:upto]
        self.shown = max(self.shown, upto)
        return out

    def _flush(self) -> str:
        """End of a phase's text: what the decoder (and, in the answer, the stop-string check) held back."""
        piece = self.decoder.flush() if self.decoder is not None else ""
        self.text[self.phase] += piece
        if self.phase == "think":
            return piece
        return self._emit(len(self.text["answer"]))

    def _finish(self, reason: str, flush: bool = False) -> str:
        """Mark the row finished; with `flush`, return the text still held back (a stop string found in
        the text finishes without it: what was held back belongs to the stop string)."""
        if self.finished:
            return ""
        rest = self._flush() if flush else ""
        self.finish_reason, self.finish_phase = reason, self.phase
        return rest

