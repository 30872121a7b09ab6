"""How many of torch's threads a budget's C decode step runs on: the count whose recent tokens ran fastest.

Why: where a token takes tens of microseconds, what threads cost each other (two dozen meetings a token,
lines one thread writes and another reads) can outweigh the work they share, and more threads than the
process has cores (torch counting a host's cores under a container's CPU quota, or a user's setting)
multiply it: each meeting then waits for a descheduled thread. So the step times its counts as it runs:
torch's count and its halvings down to one, each count other than the one in use timed again every
RETIME_S (what is fastest changes with where the host puts the threads). A timing runs at most EXPLORE_S
at the pace the count in use predicts for it were nothing shared, so a model whose token takes
milliseconds never runs a much slower count. The tokens are the same on every count: each output of the
step is one thread's sum (tests/test_decode_step.py).

Measured on this project's 2-vCPU VM (scratch: 128-token greedy `generate`, chosen against fixed
alternated in one process, grouped by the meeting time): with torch at 4 threads, the demo 2.46x / 3.07x
(full / small budget) where the vCPUs sat close and 2.39x / 2.78x apart; at torch's 2 threads, where two
threads stay the fastest, 0.998-0.999x on the demo and 0.981-1.000x on bench_quant's 17M model, what the
timings of one thread cost (docs/decode-speed.md, "The decode step's thread count").
"""

from __future__ import annotations

import os

ENV = "ELASTIC_LOCAL_STEP_THREADS"  # "fixed": always torch's count (benchmarks that compare thread counts)
RETIME_S = 2.0  # each count other than the one in use is timed again after this long
EXPLORE_S = 0.002  # the most a timing of another count may take, at the pace predicted for it


def counts(most: int) -> list[int]:
    """torch's thread count and its halvings down to one, largest first."""
    out = [most]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


class ThreadCounts:
    """One budget's timings on each thread count (`record`), and the count its next call runs on (`pick`).

    A count's pace is the fastest token it ran in its current window of RETIME_S: the machine's noise (a
    vCPU taken away mid-call, which leaves the other threads spinning at a meeting) only ever adds time, and
    a single slow call on the count in use must not hand the next second to a slower one. The count in use
    changes only where a timing of another one beats its pace by a tenth (MARGIN). The count it leaves is
    timed again at once (at most EXPLORE_S): its pace may be one slow first call's (cold caches, a team
    started after `gemv.release_threads`), which would otherwise keep the slower count for RETIME_S.
    """

    MARGIN = 0.9

    def __init__(self) -> None:
        self.token_s: dict[int, float] = {}  # count -> its fastest seconds a token in its current window
        self.since: dict[int, float] = {}  # count -> when that window began
        self.timed: dict[int, float] = {}  # count -> when it last ran
        self.tokens: dict[int, int] = {}  # count -> tokens run on it (the benchmarks print them)
        self.current: int | None = None  # the count calls run on between timings

    def pick(self, most: int, n: int, now: float) -> tuple[int, int]:
        """(count, tokens) for a call of up to `n` tokens with torch's `most` threads: the count in use, or
        a count due for timing, for as many tokens as fit in EXPLORE_S at its predicted pace."""
        if most <= 1 or os.environ.get(ENV) == "fixed" or most not in self.token_s:
            return most, n
        current = self.current if self.current is not None and self.current <= most else most
        for c in counts(most):
            if c == current or (c in self.timed and now - self.timed[c] < RETIME_S):
                continue
            # its pace were the threads to share nothing (at worst: fewer threads lose no time meeting);
            # not its own last timing, which may be one slow call's, seconds ago
            if (fit := int(EXPLORE_S / (self.token_s[current] * current / c))) >= 1:
                return c, min(n, fit)
        return current, n

    def record(self, count: int, seconds: float, tokens: int, now: float) -> None:
        """A call's timing: `tokens` in `seconds` on `count` threads."""
        if tokens < 1:
            return
        pace = seconds / tokens
        if count not in self.since or now - self.since[count] > RETIME_S:  # a new window (the last may be
            self.token_s[count], self.since[count] = pace, now             # another placement's)
        else:
            self.token_s[count] = min(self.token_s[count], pace)
        self.timed[count] = now
        self.tokens[count] = self.tokens.get(count, 0) + tokens
        if self.current is None:
            self.current = count
        elif count != self.current and pace < self.MARGIN * self.token_s[self.current]:
            self.timed.pop(self.current, None)  # timed again at once
            self.current = count
