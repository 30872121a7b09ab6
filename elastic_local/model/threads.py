"""How many of torch's threads a budget's C decode step runs on: the count whose recent tokens ran fastest.

Why: where a token takes tens of microseconds, what threads cost each other (two dozen meetings a token,
lines one thread writes and another reads) can outweigh the work they share, and more threads than the
process has cores (torch counting a host's cores under a container's CPU quota, or a user's setting)
multiply it: each meeting then waits for a descheduled thread. So the step times its counts as it runs:
torch's count and its halvings down to one, each other count than the best timed again every RETIME_S
(what is fastest changes with where the host puts the threads). A timing costs at most EXPLORE_S at the
pace predicted for it, so a model whose token takes milliseconds never runs a much slower count. The
tokens are the same on every count: each output of the step is one thread's sum (tests/test_decode_step.py).

Measured on this project's 2-vCPU VM (scratch: the demo, 128-token greedy `generate`, chosen against
fixed alternated in one process, grouped by the meeting time): with torch at 4 threads, 2.42x / 2.95x
(full / small budget) where the vCPUs sat close and 2.31x / 2.38x apart; at torch's 2 threads
0.998-1.003x, two threads staying the fastest (docs/decode-speed.md, "The decode step's thread count").
"""

from __future__ import annotations

import os

ENV = "ELASTIC_LOCAL_STEP_THREADS"  # "fixed": always torch's count (benchmarks that compare thread counts)
RETIME_S = 1.0  # each count other than the best is timed again after this long
EXPLORE_S = 0.002  # the most a timing of another count may take, at the pace predicted for it


def counts(most: int) -> list[int]:
    """torch's thread count and its halvings down to one, largest first."""
    out = [most]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


class ThreadCounts:
    """One budget's seconds a token on each thread count (`record`), and the count its next call runs on
    (`pick`)."""

    def __init__(self) -> None:
        self.token_s: dict[int, float] = {}  # count -> seconds a token: its latest timing, averaged while it runs
        self.timed: dict[int, float] = {}  # count -> when it last ran
        self.tokens: dict[int, int] = {}  # count -> tokens run on it (the benchmarks print them)

    def pick(self, most: int, n: int, now: float) -> tuple[int, int]:
        """(count, tokens) for a call of up to `n` tokens with torch's `most` threads: the fastest count so
        far, or a count due for timing, for as many tokens as fit in EXPLORE_S at its predicted pace."""
        if most <= 1 or os.environ.get(ENV) == "fixed" or most not in self.token_s:
            return most, n
        known = {c: s for c, s in self.token_s.items() if c <= most}
        best = min(known, key=known.__getitem__)
        for c in counts(most):
            if c == best or now - self.timed.get(c, -RETIME_S) < RETIME_S:
                continue
            pace = known.get(c, self.token_s[most] * most / c)  # untimed: as if nothing were shared
            if (fit := int(EXPLORE_S / pace)) >= 1:
                return c, min(n, fit)
        return best, n

    def record(self, count: int, seconds: float, tokens: int, now: float) -> None:
        """A call's timing: `tokens` in `seconds` on `count` threads."""
        if tokens < 1:
            return
        pace, last = seconds / tokens, self.timed.get(count)
        fresh = last is None or now - last > RETIME_S  # a timing from before may be another placement's
        self.token_s[count] = pace if fresh else (self.token_s[count] + pace) / 2
        self.timed[count] = now
        self.tokens[count] = self.tokens.get(count, 0) + tokens
