"""Streaming: a generation run on a background thread, its events handed over through a queue.

The thread only runs `Generation.run()`; switching and cancelling go straight to the generation, which
checks them before every step, so they work from any thread at any time.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from .events import Done, Event, Result
from .generate import Generation

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
