"""Streaming: a generation run on a background thread, its events handed over in batches (`Handover`).

The thread only runs `Generation.run()`; switching and cancelling go straight to the generation, which
checks them before every step, so they work from any thread at any time.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from ..model import gemv
from .events import Done, Event, Result, Token
from .generate import Generation

_END = object()


@dataclass
class _Failure:
    error: BaseException


class Handover:
    """Events on their way from the generation's thread to the consumer's. The consumer is woken for a
    token only when `every` seconds have passed since it was last woken (so the first token after a
    pause, a prefill say, at once), and at once for every other event; tokens in between wait for the
    next wake-up, or for the consumer's own look every `every` seconds. Why: woken for every token, the
    consumer's thread takes a core from the decode step's threads for a moment each time: on 2 cores the
    demo model streamed 7200-7300 tok/s that way against 8100-8200 through `generate`, and 8000-8200 in
    batches (README, "A stream on its own thread")."""

    every = 0.02

    def __init__(self) -> None:
        self._events: list = []
        self._ready = threading.Condition()
        self._woken = -math.inf

    def put(self, ev) -> None:
        with self._ready:
            self._events.append(ev)
            now = time.monotonic()
            if not isinstance(ev, Token) or now - self._woken >= self.every:
                self._woken = now
                self._ready.notify()

    def take(self) -> list:
        """Every event that has come, in order; waits for at least one."""
        with self._ready:
            while not self._events:
                self._ready.wait(self.every)
            events, self._events = self._events, []
        return events


def _produce(generation: Generation, out: Handover, on_done) -> None:
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
        self._handover, self._taken = Handover(), deque()
        self._results: list[Result] | None = None
        self._drained = False
        self._thread = threading.Thread(target=_produce, args=(generation, self._handover, on_done),
                                        name="elastic-generate", daemon=True)
        gemv.release_threads()  # the generation's thread is to be the one OpenMP team (gemv.release_threads)
        self._thread.start()

    def __iter__(self) -> Iterator[Event]:
        while not self._drained:
            if not self._taken:  # kept on the stream: a consumer that stops mid-batch loses none of it
                self._taken.extend(self._handover.take())
            ev = self._taken.popleft()
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
