"""What a batch run tells the person waiting: a progress line on stderr while it runs (done/total,
errors, tokens/s, ETA) and a summary at the end (also as one JSON object)."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TextIO


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


@dataclass
class Summary:
    requests: int  # lines in the input
    skipped: int  # already in the output: done by an earlier run
    done: int = 0  # written by this run with a response
    errors: int = 0  # written by this run with an error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    interrupted: bool = False
    t0: float = field(default_factory=time.monotonic, repr=False)

    @property
    def finished(self) -> int:
        return self.skipped + self.done + self.errors

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, ok: bool, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        self.done += ok
        self.errors += not ok
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.seconds = time.monotonic() - self.t0

    def line(self) -> str:
        left = self.requests - self.finished
        state = f"interrupted with {left} left: run the same command to finish" if self.interrupted else "complete"
        return (f"batch {state}: {self.requests} requests, {self.done} done and {self.errors} errors in this run, "
                f"{self.skipped} from before; {self.prompt_tokens} prompt + {self.completion_tokens} completion "
                f"tokens in {_duration(self.seconds)} ({self.tokens_per_s:.1f} tok/s, "
                f"{self.done / self.seconds if self.seconds else 0:.2f} requests/s)")

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["t0"]
        return {**d, "tokens_per_s": self.tokens_per_s}


class ProgressBar:
    """One line on stderr, redrawn at most every `every` seconds (a new line each time when stderr is not
    a terminal, less often)."""

    def __init__(self, summary: Summary, out: TextIO | None = None, every: float | None = None):
        self.s, self.out = summary, out or sys.stderr  # sys.stderr as it is now, not at import
        self.tty = self.out.isatty()
        self.every = every if every is not None else (0.2 if self.tty else 10.0)
        self.last = 0.0
        self.tokens = 0  # generated so far, finished requests or not

    def step(self, tokens: int) -> None:
        self.tokens += tokens
        self.show()

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every:
            return
        self.last = now
        s = self.s
        frac = s.finished / max(s.requests, 1)
        left = s.requests - s.finished
        elapsed = now - s.t0
        eta = _duration(elapsed / s.done * left) if s.done else "?"  # errors are written at once: not in the rate
        bar = "#" * int(24 * frac)
        text = (f"batch [{bar:<24}] {s.finished}/{s.requests} done, {s.errors} errors | "
                f"{self.tokens / elapsed if elapsed > 0 else 0:.1f} tok/s | eta {eta}")
        self.out.write(f"\r{text}\x1b[K" if self.tty else text + "\n")
        self.out.flush()

    def close(self) -> None:
        self.show(force=True)
        if self.tty:
            self.out.write("\n")
