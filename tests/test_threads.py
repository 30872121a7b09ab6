"""model/threads.py: the C decode step runs on the thread count whose tokens ran fastest, times the others
again as time passes, never pays more than EXPLORE_S for a timing, and gives the same tokens on any count."""

from __future__ import annotations

import pytest
import torch
from gen_util import elastic_model

from elastic_local.model import gemv, threads
from elastic_local.model.threads import EXPLORE_S, RETIME_S, ThreadCounts, counts


@pytest.fixture(autouse=True)
def choosing(monkeypatch):
    monkeypatch.delenv(threads.ENV, raising=False)


def test_counts_halve_down_to_one():
    assert counts(1) == [1] and counts(2) == [2, 1] and counts(16) == [16, 8, 4, 2, 1] and counts(6) == [6, 3, 1]


def drive(t: ThreadCounts, most: int, pace: dict[int, float], start: float, seconds: float) -> tuple[list, float]:
    """Calls of up to 100 tokens for `seconds` of a fake clock from `start`, a token on count c taking
    pace[c]: each call's (count, tokens), and the clock after them."""
    now, calls = start, []
    while now < start + seconds:
        c, k = t.pick(most, 100, now)
        now += k * pace[c]
        t.record(c, k * pace[c], k, now)
        calls.append((c, k))
    return calls, now


def test_a_faster_fewer_count_takes_over_and_the_other_is_timed_again_each_retime():
    t = ThreadCounts()
    calls, now = drive(t, 2, {2: 100e-6, 1: 60e-6}, 0.0, 3.5 * RETIME_S)
    assert calls[0] == (2, 100)  # nothing timed: torch's count
    assert calls[1] == (1, int(EXPLORE_S / 200e-6))  # one thread, predicted 200 us a token: 2 ms of them
    on_two = [k for c, k in calls[2:] if c == 2]
    # timed again at once (the count left), then after 1, 2 and 3 RETIME_S, each time for 2 ms at the pace
    # one thread's predicts for two (60 us / 2)
    assert calls[2] == (2, int(EXPLORE_S / 30e-6))
    assert len(on_two) == 4 and set(on_two) == {int(EXPLORE_S / 30e-6)}
    calls, _ = drive(t, 2, {2: 40e-6, 1: 60e-6}, now, 3.5 * RETIME_S)  # the placement changed: two faster
    switched = next(i for i, (c, k) in enumerate(calls) if c == 2)
    assert sum(k for c, k in calls[:switched]) * 60e-6 <= RETIME_S + 0.01
    later = calls[switched + 1:]
    assert [c for c, _ in later].count(1) <= 3 and sum(k for c, k in later if c == 1) * 60e-6 <= 3 * EXPLORE_S


def test_one_slow_call_on_the_count_in_use_hands_nothing_over():
    """A vCPU taken away mid-call makes one call on two threads ten times slower: two threads' pace stays
    their fastest this window, and one thread, timed after it, takes over only if it beats that by a tenth."""
    t = ThreadCounts()
    for i in range(5):
        t.record(2, 50e-6, 1, 0.01 * i)
    t.record(2, 500e-6, 1, 0.05)  # the slow call
    c, k = t.pick(2, 100, 0.06)
    assert c == 1
    t.record(1, k * 80e-6, k, 0.07)
    assert t.current == 2 and t.pick(2, 100, 0.08) == (2, 100)
    t.record(1, 40e-6, 1, 0.09 + RETIME_S)  # timed again: now it beats two threads' 50 us by a tenth
    assert t.current == 1


def test_a_count_that_lost_on_its_windows_first_call_is_timed_again_at_once():
    """Two threads' window opens with one slow call (cold caches, a team started after release_threads) and
    one thread's timing beats it: two threads are timed again on the next call, not RETIME_S later, and take
    back over at their real pace. One thread, left in turn, gets one timing more and no more."""
    t = ThreadCounts()
    t.record(2, 300e-6, 1, 0.0)  # three times two threads' real pace (50 us)
    c, k = t.pick(2, 100, 0.001)
    assert c == 1
    t.record(1, k * 90e-6, k, 0.003)
    assert t.current == 1
    c, k = t.pick(2, 100, 0.004)
    assert c == 2 and k < 100  # at once, for a timing
    t.record(2, k * 50e-6, k, 0.005)
    assert t.current == 2
    c, k = t.pick(2, 100, 0.006)
    assert c == 1 and k * 90e-6 <= EXPLORE_S
    t.record(1, k * 90e-6, k, 0.008)
    assert t.current == 2 and t.pick(2, 100, 0.009) == (2, 100) and t.pick(2, 100, 0.009 + RETIME_S / 2) == (2, 100)


def test_a_timing_never_runs_past_explore_s():
    """1 ms a token on 16 threads: 8 threads are timed for one token (2 ms predicted), 4 (4 ms) never."""
    t = ThreadCounts()
    t.record(16, 1e-3, 1, 0.0)
    assert t.pick(16, 40, 0.1) == (8, int(EXPLORE_S / 2e-3))
    t.record(8, 2e-3, 1, 0.1)
    for now in (0.2, 5.0, 50.0):
        c, k = t.pick(16, 40, now)
        assert c != 4 and c != 2 and c != 1 and (c == 16 or k * t.token_s[c] <= EXPLORE_S)
        t.record(c, k * (1e-3 if c == 16 else 2e-3), k, now)


def test_a_small_models_timing_walks_down_the_halvings():
    t = ThreadCounts()
    t.record(8, 50e-6, 10, 0.0)
    seen = []
    for now in (0.01, 0.02, 0.03):
        count, n = t.pick(8, 1000, now)
        seen.append(count)
        t.record(count, n * 60e-6, n, now)  # each slower than eight threads
    assert seen == [4, 2, 1] and t.pick(8, 1000, 0.04) == (8, 1000)


def test_a_fixed_count_is_torchs(monkeypatch):
    monkeypatch.setenv(threads.ENV, "fixed")
    t = ThreadCounts()
    t.record(2, 100e-6, 1, 0.0)
    t.record(1, 10e-6, 1, 0.0)
    assert t.pick(2, 7, 1.0) == (2, 7)


@pytest.mark.skipif(gemv.library() is None, reason="no C compiler: no C decode step")
def test_the_step_runs_on_the_faster_count_with_the_same_tokens(tmp_path, monkeypatch):
    """A step made to find one thread faster runs its next calls on one thread, and its tokens are those
    of torch's two threads."""
    m = elastic_model(tmp_path, seed=3)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            tokens = []
            for choose in (False, True):
                if not choose:
                    monkeypatch.setenv(threads.ENV, "fixed")
                else:
                    monkeypatch.delenv(threads.ENV)
                cache = m.net.new_cache()
                m.net.forward(prompt[:, :-1], cache=cache)
                c_step = m.net._c_step(cache)
                c_step.threads = ThreadCounts()
                if choose:
                    c_step.threads.record(2, 1.0, 1, 0.0)  # two threads timed hopelessly slow
                    c_step.threads.record(1, 1e-6, 1, 0.0)
                    c_step.threads.timed[2] = float("inf")  # and not due for timing again
                    c_step.calls = 1
                got, tok = [], int(prompt[0, -1])
                while len(got) < 30:
                    got += m.net.decode_ahead(tok, cache, 30 - len(got), ())
                    tok = got[-1]
                tokens.append(got)
                if choose:  # the two calls recorded above, then every token on one thread
                    assert c_step.threads.tokens[2] == 1 and c_step.threads.tokens[1] >= 1 + 29
        assert tokens[0] == tokens[1]
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(gemv.library() is None, reason="no C compiler: no C decode step")
def test_a_generation_whose_runs_ahead_come_back_short_gets_the_same_tokens(tmp_path, monkeypatch):
    """A run ahead that times a count returns fewer tokens than it was asked for; the engine goes on from
    there: a seeded sampled request and a greedy one, thinking then answering, get the tokens of runs that
    were never cut short."""
    m = elastic_model(tmp_path, seed=3)
    prompt = m.chat_prompt("a question")
    opts = dict(think_budget="small", max_think_tokens=9, max_answer_tokens=20, ignore_eos=True,
                think_close="ok.")
    want = [m.generate(prompt, **opts).ids, m.generate(prompt, temperature=1.0, seed=4, **opts).ids]
    monkeypatch.setattr(ThreadCounts, "pick", lambda self, most, n, now: (1, min(n, 3)))
    got = [m.generate(prompt, **opts).ids, m.generate(prompt, temperature=1.0, seed=4, **opts).ids]
    assert got == want
