"""A Stream's hand-over of events between threads, and the OpenMP workers a thread gives back before
generation moves off it (engine/stream.py, model/gemv.py's release_threads)."""

import os
import threading
import time

import pytest
import torch
from test_cpu_gemv import X86

import elastic_local
from elastic_local.engine import stream
from elastic_local.engine.events import Done, Token
from elastic_local.engine.generate import Generation, Request
from elastic_local.engine.stream import Handover
from elastic_local.model import gemv


def token(i: int) -> Token:
    return Token(0, i, str(i), "answer", "full", False, 0.0)


def test_the_consumer_is_woken_for_the_first_token_after_a_pause_and_for_every_other_event(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(stream.time, "monotonic", lambda: clock[0])
    h = Handover()
    woken = []
    h._ready.notify = lambda n=1, _notify=h._ready.notify: woken.append(clock[0]) or _notify(n)
    for i in range(5):  # 5 tokens in 4 ms: one wake-up
        h.put(token(i))
        clock[0] += 0.001
    clock[0] += 0.02
    h.put(token(5))  # the first after `every`: woken
    h.put(token(6))
    h.put(Done([], clock[0]))  # not a token: woken at once
    assert woken == pytest.approx([100.0, 100.025, 100.025])
    assert [getattr(ev, "id", None) for ev in h.take()] == [0, 1, 2, 3, 4, 5, 6, None]


def test_a_token_that_woke_no_one_still_arrives():
    """The consumer looks every `every` seconds: a token put right after one that woke it is not left
    waiting for a later event."""
    h = Handover()
    got = []

    def consume():
        while len(got) < 2:
            got.extend(h.take())

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(0.05)  # the consumer waits
    h.put(token(0))
    h.put(token(1))  # within `every` of the first: no wake-up
    consumer.join(timeout=5)
    assert not consumer.is_alive() and [ev.id for ev in got] == [0, 1]


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settles(expected, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while threads() != expected and time.monotonic() < end:
        time.sleep(0.01)
    return threads() == expected


@pytest.mark.skipif(not (X86 and os.path.isdir("/proc/self/task")), reason="Linux, the C kernels")
def test_a_thread_gives_its_openmp_workers_back_before_a_stream_and_after_a_load():
    """libgomp keeps a team of workers for every thread that has run a parallel region and, once they
    outnumber the cores, stops spinning at barriers (a decode step's 23 barriers then cost 5x). The
    workers are OS threads: they leave when the thread that led them gives them back."""
    assert gemv.library() is not None, "the CPU decode kernels did not build: nothing here would run"
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        m = elastic_local.load()
        alone = threads()  # after the load: its workers are gone
        m.generate(m.chat_prompt("What is 2 + 2?"), max_think_tokens=4, max_answer_tokens=4)
        assert settles(alone + 2)  # the decode steps' team: this thread and 2 workers
        engine = stream.ENGINE.thread is not None and stream.ENGINE.thread.is_alive()
        s = m.stream(m.chat_prompt("What is 2 + 2?"), max_think_tokens=4, max_answer_tokens=4)
        s.results()
        # given back when the stream started; the engine's thread stays (one more the first time), its own
        # given back after the generation
        assert settles(alone + (0 if engine else 1))
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux")
def test_without_the_kernels_threads_give_torch_s_openmp_workers_back(monkeypatch):
    """Without the kernels' library (another CPU, no C compiler) torch's parallel work still leaves teams,
    and the engine's thread outlives its generations: both are given back through the libgomp torch
    loaded."""
    monkeypatch.setattr(gemv, "_library", None)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        m = elastic_local.load()
        alone = threads()
        torch.ones(1 << 20).add_(1)  # a parallel region on this thread: its team
        assert settles(alone + 2)
        engine = stream.ENGINE.thread is not None and stream.ENGINE.thread.is_alive()
        m.stream(m.chat_prompt("What is 2 + 2?"), max_think_tokens=4, max_answer_tokens=4).results()
        assert settles(alone + (0 if engine else 1))
    finally:
        torch.set_num_threads(before)


def test_a_consumer_that_stops_early_still_gets_the_rest_and_the_results():
    """Events come in batches; the ones a consumer has not iterated yet stay on the stream."""
    m = elastic_local.load()
    prompt = m.chat_prompt("What is 2 + 2?")
    s = m.stream(prompt, max_think_tokens=20, max_answer_tokens=20, ignore_eos=True)
    time.sleep(0.5)  # the generation ends: its events wait in one batch
    first = next(iter(s))
    rest = []
    reader = threading.Thread(target=lambda: rest.extend(s), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "the stream lost the events after the first"
    tokens = [ev.id for ev in [first, *rest] if isinstance(ev, Token)]
    assert isinstance(rest[-1], Done) and tokens == s.result.ids[len(prompt):]


def test_a_stream_waited_for_on_the_engine_s_own_thread_is_refused_not_left_waiting():
    """Streams run one after another on the engine's thread: a generation's callback there that waits
    for another stream would wait forever (it runs after the generation that waits). Starting one there
    is fine: it runs next."""
    m = elastic_local.load()
    prompt = m.chat_prompt("What is 2 + 2?")
    started = []
    s = stream.Stream(Generation(m, [prompt], Request(max_answer_tokens=2)),
                      on_done=lambda results: m.stream(prompt, max_answer_tokens=2).results())
    with pytest.raises(RuntimeError, match="engine's own thread"):
        s.results()
    s = stream.Stream(Generation(m, [prompt], Request(max_answer_tokens=2)),
                      on_done=lambda results: started.append(m.stream(prompt, max_answer_tokens=2)))
    s.results()
    assert started[0].result.finish_reason == "answer_limit"


def test_a_stream_runs_with_the_thread_count_and_float_mode_of_the_thread_that_started_it():
    """torch keeps a thread count and a floating-point mode per thread, and the engine's thread outlives a
    `torch.set_num_threads` or `torch.set_flush_denormal` on another: each stream takes its starter's."""
    m = elastic_local.load()
    prompt = m.chat_prompt("What is 2 + 2?")
    seen = []

    def look(results) -> None:  # on the engine's thread
        seen.append((torch.get_num_threads(), (torch.tensor([1e-39]) * 1.0).item() == 0.0))

    before = torch.get_num_threads()
    flushing = X86 and gemv.library() is not None and torch.set_flush_denormal(False)
    try:
        for n, flush in ((1, False), (3, flushing), (2, False)):
            torch.set_num_threads(n)
            torch.set_flush_denormal(flush)
            stream.Stream(Generation(m, [prompt], Request(max_answer_tokens=2)), on_done=look).results()
    finally:
        torch.set_num_threads(before)
        torch.set_flush_denormal(False)
    assert seen == [(1, False), (3, flushing), (2, False)]


LEFT_RUNNING = """
import torch
torch.set_num_threads(4)  # more workers than cores: an exit mid-step aborted every time (10 of 10)
import elastic_local
from elastic_local.engine.events import Token
m = elastic_local.load()
s = m.stream(m.chat_prompt("What is 347 + 589?"), max_think_tokens=5000, ignore_eos=True)
for ev in s:
    if isinstance(ev, Token):
        break
print("leaving", flush=True)
"""


def test_a_process_that_ends_with_a_stream_running_exits_cleanly():
    """A script that leaves a stream running (here held, not cancelled) and ends: the engine's thread is
    inside a decode step, OpenMP workers alive, and the process was aborted ("terminate called without an
    active exception", exit 134): in 4 runs of 10 on 2 threads, 10 of 10 on 4. At exit the engine cancels
    what is left and waits for the step to end. Two runs on 4 threads, a real subprocess each."""
    import subprocess
    import sys

    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", LEFT_RUNNING], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "leaving" in done.stdout, done.stderr[-2000:]
        assert "terminate called" not in done.stderr


BOTH_AT_ONCE = """
import torch
torch.set_num_threads(2)
import elastic_local
m = elastic_local.load()
opts = dict(max_think_tokens=300, max_answer_tokens=100, ignore_eos=True)
p1, p2 = m.chat_prompt("What is 347 + 589?"), m.chat_prompt("What is 12 + 30?")
alone = m.generate(p1, **opts).ids, m.generate(p2, **opts).ids
for _ in range(3):
    s = m.stream(p1, **opts)
    second = m.generate(p2, **opts).ids  # on this thread, while the stream runs on the engine's
    assert (s.result.ids, second) == alone, "a generation took the other's states"
print("same", flush=True)
"""


def test_a_stream_and_a_generate_at_once_each_decode_their_own_sequence():
    """The same budget's C step used from two threads at once (a Stream on the engine's thread, `generate`
    on the caller's): its residual and state table are the step's, so each call must have it alone.
    Without that, every run gave wrong tokens (20 of 20), and with the run ahead the process crashed
    (a K / V cache shorter than the other sequence's position). A real subprocess: a crash must fail the
    test, not the test run."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", BOTH_AT_ONCE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "same" in done.stdout, (done.returncode, done.stderr[-2000:])
