"""Streaming: a generation run on the engine's thread, its events handed over in batches (`Handover`).

The thread only runs `Generation.run()`, one stream's after another; switching and cancelling go
straight to the generation, which checks them before every step, so they work from any thread at any
time. It holds no interpreter lock inside the C decode step but needs it between calls: a consumer that
runs long stretches of Python (a UI rendering) makes it wait up to the interpreter's switch interval, 5 ms
by default, each time; elastic-chat sets 0.2 ms while it runs (tui/app.py).
"""

from __future__ import annotations

import atexit
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch

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
    batches (docs/decode-speed.md, "A stream on its own thread")."""

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


class _Engine:
    """The one thread that runs every stream's generation, one after another.

    Why one thread for all, not one per stream: libgomp (the OpenMP runtime of torch and of the decode
    step) keeps a team of worker threads for each thread that runs parallel regions, and a team taken
    down on one thread (a finished stream's thread exiting) followed by a new team on another costs about
    7 ms here: libgomp spins out its 300,000-turn wait (GOMP_SPINCOUNT=1000 removes it). A thread per
    stream paid that before every reply's first token: 9-16 ms for the demo model in a chat, against
    3-4 on one thread (docs/decode-speed.md, "A reply's first token on the engine's thread"). The thread gives its own
    team back after each generation, which costs it 0.5 ms at the next, so that an idle team does not
    slow a generation on another thread (gemv.release_threads)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._cancels: list = []  # of the jobs not finished yet

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def run(self, job, cancel) -> None:
        """Run `job()` on the engine's thread after the jobs before it (started on first use); `cancel()`
        makes it end soon (at exit: `stop`)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="elastic-generate", daemon=True)
                self._thread.start()
            self._cancels.append(cancel)
        self._jobs.put((job, cancel))

    def _serve(self) -> None:
        while True:
            job, cancel = self._jobs.get()
            try:
                job()
            finally:
                gemv.release_threads()
                with self._lock:
                    self._cancels.remove(cancel)

    def stop(self, timeout: float = 30.0) -> None:
        """At interpreter exit: cancel what is left and wait (at most `timeout`) until the thread is between
        jobs. A process that ended while the thread ran a decode step, its OpenMP workers alive, was aborted
        ("terminate called without an active exception", exit 134): a script that left a stream running,
        or broke out of one, and ended, in 4 runs of 10 on 2 threads and 10 of 10 on 4."""
        with self._lock:
            cancels, alive = list(self._cancels), self._thread is not None and self._thread.is_alive()
        if not alive or not cancels:
            return
        for cancel in cancels:
            cancel()
        idle = threading.Event()
        with self._lock:
            self._cancels.append(idle.set)
        self._jobs.put((idle.set, idle.set))  # runs once every job before it has ended
        idle.wait(timeout)


ENGINE = _Engine()
atexit.register(ENGINE.stop)


def _produce(generation: Generation, out: Handover, on_done, finished: threading.Event, threads: int,
             float_mode: int | None) -> None:
    """A stream's job on the engine's thread: run the generation with the thread count and floating-point
    mode of the thread that started it (torch keeps both per thread, and this thread outlives a
    `torch.set_num_threads` or `torch.set_flush_denormal` elsewhere), hand every event over. It holds no
    reference to the Stream, so a Stream dropped by its consumer is collected, and cancels its generation."""
    try:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        gemv.set_float_mode(float_mode)
        for ev in generation.run(ahead=True):
            if isinstance(ev, Done) and on_done is not None:
                on_done(ev.results)
            out.put(ev)
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer's thread
        out.put(_Failure(e))
    finally:
        out.put(_END)
        finished.set()


class Stream:
    """Events of a generation that runs on the engine's thread (after the streams started before it).
    Iterate to receive them (one consumer); `switch` and `cancel` work from any thread at any time;
    `results()` waits for the end. Leaving a `with` block, or dropping the stream, cancels what is left.

        with m.stream(ids, think_budget="small") as s:
            for ev in s:
                if isinstance(ev, Token): print(ev.text, end="")
    """

    def __init__(self, generation: Generation, on_done=None):
        self.generation = generation
        self._handover, self._taken = Handover(), deque()
        self._results: list[Result] | None = None
        self._drained = False
        self._finished = threading.Event()
        gemv.release_threads()  # the engine's thread is to lead the one OpenMP team (gemv.release_threads)
        ENGINE.run(partial(_produce, generation, self._handover, on_done, self._finished, torch.get_num_threads(),
                           gemv.float_mode()), generation.cancel)

    def __iter__(self) -> Iterator[Event]:
        self._not_from_the_engine()
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
        return self._finished.is_set()

    def results(self) -> list[Result]:
        for _ in self:
            pass
        self._finished.wait()
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
        self._not_from_the_engine()
        self._finished.wait()

    def _not_from_the_engine(self) -> None:
        """Waiting for a stream on the engine's own thread (a generation's callback) would wait forever: the
        stream runs after the generation that waits."""
        if threading.current_thread() is ENGINE.thread and not self._finished.is_set():
            raise RuntimeError("a stream was read or waited for on the engine's own thread (from a generation's "
                               "callback), where it cannot run until that generation ends; read it elsewhere")

    def __del__(self) -> None:
        self.generation.cancel()
