"""What a generation reports: typed events while it runs, a Result per sequence when it is done.

Times are seconds since the generation started (`t`) or durations (`seconds`), wall clock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Token:
    """One token appended to a sequence: sampled by the model, or `forced` (inserted by the engine when
    the think token budget closes thinking). `text` is the new visible text it completes ("" for
    `</think>`, eos and stop tokens, and for a byte of an unfinished character)."""

    row: int
    id: int
    text: str
    phase: str  # "think" | "answer"
    budget: str  # the budget that produced it (for a forced token: the phase's budget)
    forced: bool
    t: float


@dataclass(frozen=True)
class CatchUp:
    """A budget consumed several tokens in one chunked prefill: the prompt (`prefill`), or the tokens it
    had not seen when it took over (a phase change or a switch). `transplanted`: it started from another
    budget's states and ran only the rest."""

    row: int
    budget: str
    tokens: int
    seconds: float
    prefill: bool
    transplanted: bool
    t: float


@dataclass(frozen=True)
class Switch:
    """A live switch took effect: from the next token on, `phase` runs on `budget`."""

    phase: str
    budget: str
    t: float


@dataclass
class Stats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually run: fewer when a session's cache was reused
    prefill_s: float = 0.0
    think_tokens: int = 0  # generated + inserted (the closing text and </think> of a think budget)
    think_inserted: int = 0
    think_s: float = 0.0  # wall time of the steps that produced them (catch-ups included)
    answer_tokens: int = 0
    answer_s: float = 0.0
    catch_up_tokens: int = 0  # tokens consumed by budgets taking over, after the prefill
    catch_up_s: float = 0.0
    transplants: int = 0
    think_budgets: list[str] = field(default_factory=list)  # every budget that ran the phase, in order
    answer_budgets: list[str] = field(default_factory=list)

    @staticmethod
    def _rate(n: int, s: float) -> str:
        return f"{n / s:.1f} tok/s" if s > 0 and n else "-"

    def line(self) -> str:
        """One human line: prompt, each phase (tokens, tokens/s, budgets), catch-up cost."""
        parts = [f"prompt {self.prompt_tokens} tok ({self.prefill_tokens} run, {self.prefill_s:.3f} s)"]
        for phase in ("think", "answer"):
            n, s = getattr(self, f"{phase}_tokens"), getattr(self, f"{phase}_s")
            budgets = "->".join(getattr(self, f"{phase}_budgets")) or "-"
            extra = self.think_inserted if phase == "think" else 0
            more = f" (+{extra} inserted)" if extra else ""
            parts.append(f"{phase} [{budgets}] {n - extra} tok{more}, {self._rate(n - extra, s)}")
        per_tok = f", {1000 * self.catch_up_s / self.catch_up_tokens:.2f} ms/tok" if self.catch_up_tokens else ""
        parts.append(f"catch-up {self.catch_up_tokens} tok in {self.catch_up_s:.3f} s{per_tok}"
                     + (f", {self.transplants} transplant(s)" if self.transplants else ""))
        return " | ".join(parts)


@dataclass
class Result:
    """One finished sequence. `ids == prompt + think_ids + answer_ids`: everything generated or inserted,
    in order (the closing text and `</think>` belong to think_ids; an eos token ends answer_ids).

    finish_reason: "eos" (an end-of-sequence token), "stop" (a stop string or stop token id),
    "answer_limit" (max_answer_tokens), "context_limit" (the sequence filled the model's context,
    max_position_embeddings), "cancelled". finish_phase says in which phase it happened.
    think_end: how thinking ended: "model" (it wrote `</think>`), "budget" (max_think_tokens reached:
    the engine appended the closing text and `</think>`), "prompt" (the prompt had already closed it),
    None (the generation ended inside thinking)."""

    ids: list[int]
    prompt_len: int
    think_ids: list[int]
    answer_ids: list[int]
    think_text: str
    answer_text: str
    finish_reason: str
    finish_phase: str
    think_end: str | None
    stats: Stats

    @property
    def prompt_ids(self) -> list[int]:
        return self.ids[: self.prompt_len]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Done:
    """The last event: every sequence's Result, in prompt order."""

    results: list[Result]
    t: float


Event = Token | CatchUp | Switch | Done
