"""The status bar: the phases' budgets, precision, live tokens/s per phase, tokens in context, memory."""

from __future__ import annotations

import time

import psutil
from textual.widgets import Static

from ..reply import Reply

GIB = 2**30


_last: tuple[float, tuple[int, int]] | None = None


def memory(max_age: float = 1.0) -> tuple[int, int]:
    """(bytes in use, bytes available to use): this process's RSS against the machine's RAM on CPU; the
    allocator's reserve against the GPU's memory when torch runs on CUDA. Read at most once a `max_age`
    seconds: the status line is redrawn with every batch of a reply, and each read costs the UI thread ~2 ms
    of /proc parsing that the generation thread waits out."""
    global _last
    now = time.monotonic()
    if _last is not None and now - _last[0] < max_age:
        return _last[1]
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        value = torch.cuda.memory_reserved(), total
    else:
        value = psutil.Process().memory_info().rss, psutil.virtual_memory().total
    _last = now, value
    return value


def rate(r: Reply | None, phase: str) -> str:
    """A phase's tokens/s: the engine's own account once the reply is done (its Result's stats, what the
    reply's last line says), the events' clock while it streams."""
    per_s = None
    if r is not None and r.stats:  # sampled tokens, as the reply's line counts them (not the inserted closing)
        n = r.stats[f"{phase}_tokens"] - (r.stats.get("think_inserted", 0) if phase == "think" else 0)
        s = r.stats[f"{phase}_s"]
        per_s = n / s if s > 0 and n else None
    elif r is not None:
        per_s = r.rates[phase].per_second
    return "-" if per_s is None else f"{per_s:.0f}" if per_s >= 100 else f"{per_s:.3g}"


class StatusBar(Static):
    """One line; rates are tokens per second of each phase (live while a reply streams). Updating it
    repaints the line only: a layout pass over the screen costs the UI thread ~40 ms here."""

    def show(self, budgets: dict[str, str], thinking: bool, think_tokens: int | None, precision: str,
             reply: Reply | None, context: int) -> None:
        used, total = memory()
        limit = f"≤{think_tokens}" if think_tokens is not None else ""
        think = f"think {budgets['think']}{limit} {rate(reply, 'think')}/s" if thinking else "think off"
        ctx = reply.tokens if reply is not None else 0
        parts = [think, f"answer {budgets['answer']} {rate(reply, 'answer')}/s", precision or "?",
                 f"ctx {ctx}/{context}" if context else f"ctx {ctx}", f"mem {used / GIB:.1f}/{total / GIB:.0f} GiB"]
        self.update(" · ".join(parts), layout=False)  # one line, height fixed by the CSS: no reflow
