"""Generation with elastic budget control, checked against the model run from scratch.

The oracle: with greedy decoding every token the model produced in a phase is the argmax of that
phase's budget run from scratch (`m.logits`, no cache) on the sequence before it. That holds only if
every catch-up — prefill, think -> answer hand-over, live switch — fed each budget exactly the tokens
of the sequence."""

import gc
import json
import threading
import time

import pytest
import torch
from gen_util import assert_argmax, at_a_real_models_pace, elastic_model, runs_ahead, sampled_tokens

import elastic_local
from elastic_local.batch.requests import CHAT, Checker
from elastic_local.engine import sampling
from elastic_local.engine.caches import take_rows, transplant
from elastic_local.engine.events import CatchUp, Done, Switch, Token
from elastic_local.engine.generate import Generation, Request, Specials
from elastic_local.engine.phases import THINK_CLOSE
from elastic_local.engine.sampling import Sampling, draw, logits_to_probs, nucleus, sample
from elastic_local.engine.tokenizer import IncrementalDecoder

CLOSE = "ok."  # a short closing text keeps the tests fast (the default is a sentence)


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    return elastic_model(tmp_path_factory.mktemp("gen"), seed=3)


def run(m, prompts, **options):
    """Run a generation synchronously; (events, results)."""
    options.setdefault("think_close", CLOSE)
    events = list(Generation(m, prompts, Request(**options)).run())
    assert isinstance(events[-1], Done)
    return events, events[-1].results


@pytest.mark.parametrize("think, answer", [("small", "full"), ("full", "small"), ("full", "full")])
def test_greedy_tokens_are_the_argmax_of_their_phase_budget(m, think, answer):
    prompt = m.chat_prompt("the answer is")
    events, [r] = run(m, [prompt], think_budget=think, answer_budget=answer, max_think_tokens=12,
                      max_answer_tokens=10, ignore_eos=True)
    assert r.ids == prompt + r.think_ids + r.answer_ids
    assert r.think_end == "budget" and r.finish_reason == "answer_limit" and r.finish_phase == "answer"
    tokens = sampled_tokens(events, len(prompt))
    assert {b for t, b in tokens if t < len(prompt) + len(r.think_ids)} == {think}
    assert {b for t, b in tokens if t >= len(prompt) + len(r.think_ids)} == {answer}
    assert assert_argmax(m, r.ids, tokens) >= len(tokens) - 2
    # the answer budget took over with one chunked catch-up of everything it had not seen
    catch = [e for e in events if isinstance(e, CatchUp)]
    assert catch[0].prefill and catch[0].tokens == len(prompt) and catch[0].budget == think
    if think != answer:
        assert catch[1].budget == answer and catch[1].tokens == len(prompt) + len(r.think_ids)
        assert r.stats.catch_up_tokens == catch[1].tokens
    assert r.stats.think_budgets == [think] and r.stats.answer_budgets == [answer]


def test_think_budget_closes_thinking_exactly(m):
    prompt = m.chat_prompt("count")
    close = m.tokenizer.encode(CLOSE) + [m.specials.think_end]
    for n in (0, 1, 7):
        _, [r] = run(m, [prompt], max_think_tokens=n, max_answer_tokens=3, ignore_eos=True, think_budget="small")
        assert len(r.think_ids) == n + len(close) and r.think_ids[n:] == close
        assert r.think_end == "budget" and len(r.answer_ids) == 3 and r.stats.think_inserted == len(close)
        assert r.think_text.endswith(CLOSE)
    _, [r] = run(m, [prompt], max_think_tokens=5, max_answer_tokens=3, ignore_eos=True, think_close="")
    assert r.think_ids[5:] == [m.specials.think_end]


def test_the_checkpoint_names_its_closing_text_and_a_request_overrides_it(tmp_path):
    """generation_config.json's "think_close" closes thinking that the think budget cuts short where the
    request names no text; the request's own text wins, "" too; with neither, NVIDIA's sentence. One that
    is not a string is refused, naming the file."""
    m = elastic_model(tmp_path, seed=3)
    file, prompt, end = tmp_path / "generation_config.json", m.chat_prompt("count"), m.specials.think_end

    def closing(**options) -> list[int]:
        request = Request(max_think_tokens=2, max_answer_tokens=1, ignore_eos=True, **options)
        return list(Generation(m, [prompt], request).run())[-1].results[0].think_ids[2:]

    gen = json.loads(file.read_text())
    assert "think_close" not in gen and closing() == m.tokenizer.encode(THINK_CLOSE) + [end]
    file.write_text(json.dumps({**gen, "think_close": "ok."}))
    assert closing() == m.tokenizer.encode("ok.") + [end]
    assert closing(think_close="") == [end] and closing(think_close="go") == m.tokenizer.encode("go") + [end]
    file.write_text(json.dumps({**gen, "think_close": 3}))
    with pytest.raises(ValueError, match=r"generation_config.json: think_close must be a string"):
        closing()


def test_the_demo_model_closes_cut_thinking_with_a_bare_end_of_thinking():
    """The embedded demo model's generation_config.json names "" (its corpus never holds NVIDIA's sentence),
    and the batch runner sizes a request by the same closing text: one token, not the sentence's."""
    demo = elastic_local.load()
    assert demo.specials.think_close == ""
    r = demo.generate(demo.chat_prompt("What is 347 + 589?"), max_think_tokens=3, max_answer_tokens=2)
    assert r.think_end == "budget" and r.think_ids[3:] == [demo.specials.think_end]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_think_tokens": 3, "max_tokens": 2}
    for checker in (Checker.for_model(demo), Checker.for_checkpoint(demo.path)):
        job = checker.job(1, "a", CHAT, body)
        assert job.capacity == len(job.prompt) + 3 + 1 + 2


def test_a_stop_inside_thinking_says_so(m):
    prompt = m.chat_prompt("count")
    _, [free] = run(m, [prompt], max_think_tokens=10, max_answer_tokens=2, ignore_eos=True)
    stop_id = free.think_ids[3]
    _, [r] = run(m, [prompt], max_think_tokens=None, max_answer_tokens=4, ignore_eos=True, stop_ids=(stop_id,))
    assert r.finish_reason == "stop" and r.finish_phase == "think" and r.think_end is None
    assert r.think_ids == free.think_ids[: free.think_ids.index(stop_id) + 1] and r.answer_ids == []


def test_the_model_closing_thinking_hands_over_to_the_answer_budget(m):
    """Pretend the first thinking token the model writes is `</think>`: thinking ends there (think_end
    "model") and the answer budget catches up on prompt + thinking."""
    prompt = m.chat_prompt("why")
    _, [free] = run(m, [prompt], max_think_tokens=6, max_answer_tokens=2, ignore_eos=True, think_budget="small")
    end = free.think_ids[2]
    sp = m.specials

    class Renamed(type(m)):
        specials = Specials(sp.think_start, end, sp.eos)

    m2 = Renamed(m.net, m._budgets, m.path, m.tokenizer)
    prompt2 = [t for t in prompt]
    events, [r] = run(m2, [prompt2], think_budget="small", answer_budget="full", max_think_tokens=20,
                      max_answer_tokens=5, ignore_eos=True)
    first = free.think_ids.index(end)
    assert r.think_ids == free.think_ids[: first + 1] and r.think_end == "model"
    assert len(r.answer_ids) == 5
    assert assert_argmax(m, r.ids, sampled_tokens(events, len(prompt))) >= 6


def test_live_switch_in_the_middle_of_thinking(m):
    prompt = m.chat_prompt("switch")
    gen = Generation(m, [prompt], Request(think_budget="full", answer_budget="full", max_think_tokens=16,
                                          max_answer_tokens=6, ignore_eos=True, think_close=CLOSE))
    events = []
    for ev in gen.run():
        events.append(ev)
        thinking = [e for e in events if isinstance(e, Token) and e.phase == "think"]
        if len(thinking) == 5 and not any(isinstance(e, Switch) for e in events):
            gen.switch(think="small")  # effective at the very next token
        if len(thinking) == 10 and sum(isinstance(e, Switch) for e in events) == 1:
            gen.switch(think="full", answer="small")
    r = events[-1].results[0]
    tokens = sampled_tokens(events, len(prompt))
    budgets = [b for _, b in tokens]
    assert budgets[:5] == ["full"] * 5 and budgets[5:10] == ["small"] * 5 and budgets[10:16] == ["full"] * 6
    assert budgets[16:] == ["small"] * 6 and r.stats.think_budgets == ["full", "small", "full"]
    assert assert_argmax(m, r.ids, tokens) >= len(tokens) - 2
    # switching back, "full" caught up on exactly the 5 tokens "small" produced (plus its own last one)
    catch = [e for e in events if isinstance(e, CatchUp)]
    assert [(c.budget, c.tokens) for c in catch[1:3]] == [("small", len(prompt) + 5), ("full", 6)]


def test_switch_from_another_thread_while_streaming(m, monkeypatch):
    at_a_real_models_pace(m, monkeypatch)
    prompt = m.chat_prompt("stream")
    s = m.stream(prompt, think_budget="full", answer_budget="full", max_think_tokens=30, max_answer_tokens=4,
                 ignore_eos=True, think_close=CLOSE)
    events = []
    for ev in s:
        events.append(ev)
        if isinstance(ev, Token) and len(events) == 3:
            threading.Thread(target=s.switch, kwargs={"think": "small"}).start()
    r = s.result
    assert any(isinstance(e, Switch) for e in events)
    tokens = sampled_tokens(events, len(prompt))
    thinking = [e.budget for e in events if isinstance(e, Token) and e.phase == "think" and not e.forced]
    first = thinking.index("small")  # the switch lands while the stream thinks, and holds from there on
    assert 3 <= first < 25 and set(thinking[:first]) == {"full"} and set(thinking[first:]) == {"small"}
    assert assert_argmax(m, r.ids, tokens) >= len(tokens) - 2
    assert [e.id for e in events if isinstance(e, Token)] == r.ids[len(prompt):]


def test_stop_strings_cut_the_answer_and_its_stream(m):
    prompt = m.chat_prompt("say it", think=False)
    _, [free] = run(m, [prompt], max_answer_tokens=30, ignore_eos=True)
    text = free.answer_text
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3]
                and "<" not in text[i:i + 3])
    events, [r] = run(m, [prompt], max_answer_tokens=30, ignore_eos=True, stop=[stop, "no such text"])
    assert r.finish_reason == "stop" and r.answer_text == text[: text.find(stop)]
    assert "".join(e.text for e in events if isinstance(e, Token) and e.phase == "answer") == r.answer_text
    assert r.answer_ids == free.answer_ids[: len(r.answer_ids)]


def test_eos_and_stop_ids(m):
    prompt = m.chat_prompt("stop", think=False)
    _, [free] = run(m, [prompt], max_answer_tokens=12, ignore_eos=True)
    stop_id = free.answer_ids[4]
    _, [r] = run(m, [prompt], max_answer_tokens=12, ignore_eos=True, stop_ids=(stop_id,))
    assert r.answer_ids == free.answer_ids[: free.answer_ids.index(stop_id) + 1] and r.finish_reason == "stop"
    _, [r] = run(m, [prompt], max_answer_tokens=0)
    assert r.answer_ids == [] and r.finish_reason == "answer_limit" and r.think_end == "prompt"


def test_cancel_stops_at_a_token_and_leaves_a_consistent_state(m, monkeypatch):
    prompt = m.chat_prompt("cancel me")
    options = dict(max_think_tokens=40, max_answer_tokens=40, ignore_eos=True, think_close=CLOSE)
    _, [free] = run(m, [prompt], **options)
    at_a_real_models_pace(m, monkeypatch)
    s = m.stream(prompt, **options)
    seen = 0
    for ev in s:
        if isinstance(ev, Token):
            seen += 1
            if seen == 4:
                s.cancel()
    r = s.result
    assert r.finish_reason == "cancelled" and 4 <= len(r.ids) - len(prompt) < len(free.ids) - len(prompt)
    assert r.ids == free.ids[: len(r.ids)]  # a prefix of the uncancelled run
    stop = threading.Event()
    stop.set()
    r = m.generate(prompt, cancel=stop, **options)
    assert r.finish_reason == "cancelled" and r.ids == prompt
    # a generation cancelled half-way keeps every cache a prefix of its row
    gen = Generation(m, [prompt], Request(**options))
    for ev in gen.run():
        if isinstance(ev, Token) and ev.phase == "think":
            gen.cancel()
    row = gen.rows[0]
    assert all(c.lengths[0] <= len(row.ids) for c in gen.caches.values())


def test_batch_rows_of_different_lengths_and_phases(m):
    prompts = [m.chat_prompt("a"), m.chat_prompt("a much longer question than that"),
               m.chat_prompt("no thinking here", think=False), m.chat_prompt("mid size q")]
    options = dict(think_budget="small", answer_budget="full", max_think_tokens=6, max_answer_tokens=5,
                   ignore_eos=True)
    events, results = run(m, prompts, **options)
    for row, (p, r) in enumerate(zip(prompts, results)):
        assert r.ids[: len(p)] == p and len(r.answer_ids) == 5
        tokens = sampled_tokens(events, len(p), row)
        assert assert_argmax(m, r.ids, tokens) >= len(tokens) - 1
    assert results[2].think_ids == [] and results[2].think_end == "prompt"
    # rows finish independently: the row without thinking is done first
    last = {e.row: i for i, e in enumerate(events) if isinstance(e, Token)}
    assert last[2] < min(last[0], last[1], last[3])
    single = m.generate(prompts[1], think_close=CLOSE, **options)
    assert single.ids == results[1].ids


def test_sampling_is_seeded_and_filters(m):
    prompt = m.chat_prompt("sample", think=False)
    kw = dict(max_answer_tokens=12, ignore_eos=True, temperature=1.0, top_p=0.9, min_p=0.02)
    a, b, c = (m.generate(prompt, seed=s, **kw) for s in (1, 1, 2))
    assert a.ids == b.ids and a.ids != c.ids
    greedy = m.generate(prompt, max_answer_tokens=12, ignore_eos=True)
    assert m.generate(prompt, max_answer_tokens=12, ignore_eos=True, temperature=0.7, top_k=1, seed=0).ids == greedy.ids

    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0], [0.0, 0.0, 0.0, 5.0]])
    p = logits_to_probs(logits, Sampling(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.allclose(p.sum(-1), torch.ones(2))
    p = logits_to_probs(logits, Sampling(temperature=1.0, top_p=0.5))
    assert (p[0] > 0).tolist() == [True, False, False, False]
    p = logits_to_probs(logits, Sampling(temperature=1.0, min_p=0.2))
    assert (p[0] > 0).tolist() == [True, True, False, False]
    assert sample(logits, Sampling()) == [0, 3]
    with pytest.raises(ValueError):
        Sampling(temperature=-1)


@pytest.mark.parametrize("top_p", [0.9, 0.99])
def test_the_nucleus_equals_the_one_a_full_sort_gives(top_p):
    """Against the definition on the whole sorted vocabulary: rows whose nucleus fits in the first 256
    tokens, in 4096, and only in all 70000, together in one batch (each stage of `nucleus`)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 70000, generator=g) * torch.tensor([[12.0], [6.0], [4.5], [3.5], [3.0], [0.5]])
    probs = logits.softmax(-1)
    p, order = probs.sort(dim=-1, descending=True)
    keep = p.cumsum(-1) - p < top_p
    want = torch.zeros_like(probs).scatter(-1, order, p * keep)
    assert torch.equal(nucleus(probs, top_p), want)  # the batch: its widest row takes every stage
    for row in range(6):  # alone: each row ends at its own stage
        assert torch.equal(nucleus(probs[row:row + 1], top_p), want[row:row + 1])
    sizes = keep.sum(-1)
    assert sizes.min() <= 256 and ((sizes > 256) & (sizes <= 4096)).any() and sizes.max() > 4096


def test_draws_follow_the_probabilities_and_never_pick_a_zero():
    rows = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]]).repeat(10000, 1)
    ids = draw(rows, torch.Generator().manual_seed(0))
    first = torch.bincount(ids[0::2], minlength=5) / 10000  # sd of each share about 0.005
    assert first[1] == 0 and first[4] == 0
    torch.testing.assert_close(first[[0, 2, 3]], torch.tensor([0.5, 0.3, 0.2]), atol=0.015, rtol=0)
    assert (ids[1::2] == 4).all()


def test_a_draw_from_non_numbers_says_so():
    """torch.multinomial refused NaN probabilities; the draw must too, not hand back an arbitrary id."""
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="not finite"):
            draw(torch.tensor([[0.5, 0.5], [bad, 0.5]]))


@pytest.mark.parametrize("r", [0.0, 1.0])
def test_a_draw_at_either_end_takes_a_likely_token(monkeypatch, r):
    """r = 0, and u = r * total rounded up to the total itself (r = 1 stands for it): the first and the last
    token with any probability take them, never a zero-probability token beside them nor an index past
    the vocabulary."""
    monkeypatch.setattr(sampling.torch, "rand", lambda shape, **kw: torch.full(shape, r, dtype=kw.get("dtype")))
    assert draw(torch.tensor([[0.0, 0.25, 0.75, 0.0, 0.0]])).tolist() == [1 if r == 0 else 2]


def test_transplant_reuses_states_and_counts_it(m):
    prompt = m.chat_prompt("transplant")
    options = dict(think_budget="small", answer_budget="full", max_think_tokens=8, max_answer_tokens=6,
                   ignore_eos=True, think_close=CLOSE)
    _, [exact] = run(m, [prompt], **options)
    events, [r] = run(m, [prompt], transplant=True, **options)
    catch = [e for e in events if isinstance(e, CatchUp)]
    assert catch[1].transplanted and r.stats.transplants == 1
    # the answer budget ran only what the think budget had not consumed: the last thinking token + close
    assert catch[1].tokens == 1 + len(m.tokenizer.encode(CLOSE)) + 1 < exact.stats.catch_up_tokens
    assert r.think_ids == exact.think_ids  # thinking is unaffected


def test_transplant_shapes_are_prefixes(m):
    full, small = m.budget("full"), m.budget("small")
    ids = torch.tensor([m.chat_prompt("shapes")])
    src = m.new_cache(budget="full")
    m.forward(ids, src)
    same = transplant(src, full, m.net.new_cache)
    nxt = torch.tensor([[9]])
    torch.testing.assert_close(m.forward(nxt, same), m.forward(nxt, take_rows(src, [0])))  # same budget: exact
    down = transplant(src, small, m.net.new_cache)
    up = transplant(down, full, m.net.new_cache)
    for a, b, c in zip(src.layers, down.layers, up.layers):
        if hasattr(a, "ssm"):
            r = b.ssm.shape[2]
            assert torch.equal(b.ssm, a.ssm[:, :, :r]) and (c.ssm[:, :, r:] == 0).all()
            assert torch.equal(c.conv[:, -16:], a.conv[:, -16:])  # B|C channels (2 groups x 8 state)
        elif hasattr(a, "k"):
            assert torch.equal(b.k, a.k) and torch.equal(c.v, a.v)
    assert down.lengths == src.lengths == up.lengths


def test_incremental_detokenization_across_multibyte_characters(m):
    tok = m.tokenizer
    text = "the café costs 5€, then 12€!"
    ids = tok.encode(text)
    assert len(ids) > len(text) - 6  # é and € are split into byte tokens
    d = tok.decoder()
    pieces = [d.push(i) for i in ids] + [d.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # a byte of an unfinished character emits nothing
    d = tok.decoder()
    assert d.push(tok.encode("€")[0]) == "" and d.flush() == "\ufffd"


def test_a_phase_rate_counts_the_whole_step_not_only_the_forward(m, monkeypatch):
    """Stats' think_s / answer_s are the whole steps' wall time, not the forward's: what a step spends
    after it (detokenizing, events) is 10-20 us of a demo token's 70-120, and leaving it out overstated
    every rate the CLI prints and every benchmark that reads them. A 3 ms detokenizer must show (each call of
    it, one a token, or one for several tokens a run ahead took at once)."""
    extend, calls = IncrementalDecoder.extend, []

    def slow_extend(self, tokens):
        calls.append(len(tokens))
        time.sleep(0.003)
        return extend(self, tokens)

    monkeypatch.setattr(IncrementalDecoder, "extend", slow_extend)
    prompt = m.chat_prompt("x", think=False)
    r = m.generate(prompt, max_answer_tokens=6, ignore_eos=True)
    assert len(r.answer_ids) == sum(calls) == 6 and r.stats.answer_s >= len(calls) * 0.003


def test_a_new_cache_s_allocation_is_charged_to_the_prefill_not_the_phase(m, monkeypatch):
    """A budget's cache is allocated for the forward that fills it. On a stream's thread that took 3-8 ms
    for the demo model (the thread's first parallel region, fresh pages), which the think phase's rate
    carried: `generate` printed think 3600 tok/s against answer 8100. A 0.2 s allocation must count as
    prefill, after a prompt of several tokens (a catch-up) and after one token (a plain decode step)."""
    new_cache = type(m).new_cache

    def slow(self, *args, **kwargs):
        time.sleep(0.2)
        return new_cache(self, *args, **kwargs)

    monkeypatch.setattr(type(m), "new_cache", slow)
    prompt = m.chat_prompt("x", think=False)
    for p in (prompt, prompt[:1]):
        st = m.generate(p, max_answer_tokens=3, ignore_eos=True).stats
        assert st.answer_tokens == 3 and st.prefill_s >= 0.2 and st.answer_s < 0.2


def test_prompts_as_tensors_and_errors(m):
    prompt = m.chat_prompt("x", think=False)
    r = m.generate(torch.tensor(prompt), max_answer_tokens=2, ignore_eos=True)
    rs = m.generate(torch.tensor([prompt, prompt]), max_answer_tokens=2, ignore_eos=True)
    assert rs[0].ids == rs[1].ids == r.ids
    with pytest.raises(KeyError):
        m.generate(prompt, think_budget="nope")
    with pytest.raises(ValueError):
        m.generate([], max_answer_tokens=2)
    assert "answer [full] 2 tok" in r.stats.line()


def test_stream_errors_reach_the_consumer_and_dropped_streams_cancel(m, monkeypatch):
    with pytest.raises(ValueError, match="not an id of the vocabulary"):
        m.stream([5, 10**6, 7], max_answer_tokens=3)  # checked before the worker starts

    def boom(*args, **kwargs):
        raise RuntimeError("failed in the worker")

    monkeypatch.setattr(m.net, "forward", boom)
    s = m.stream([5, 6, 7], max_answer_tokens=3)
    with pytest.raises(RuntimeError, match="failed in the worker"):
        list(s)
    monkeypatch.undo()
    at_a_real_models_pace(m, monkeypatch)  # 500 tokens must outlast the collection
    s = m.stream(m.chat_prompt("long"), max_think_tokens=500, ignore_eos=True)
    gen, finished = s.generation, s._finished
    del s
    gc.collect()
    assert gen._cancel.is_set()
    assert finished.wait(timeout=10)  # it stops at the next token
    assert gen.rows[0].finish_reason == "cancelled"


def test_rows_join_a_running_generation_and_match_their_runs_alone(m):
    """Continuous batching: rows added between steps, each with its own budgets, limits and seeded
    sampling, get exactly the tokens they get alone; a finished row is handed out once and leaves
    every cache."""
    opts = dict(max_think_tokens=4, max_answer_tokens=3, ignore_eos=True, think_close=CLOSE)
    prompts = [m.chat_prompt("first"), m.chat_prompt("a second, longer one"), m.chat_prompt("third", think=False)]
    reqs = [Request(**opts), Request(think_budget="small", **{**opts, "max_answer_tokens": 7}),
            Request(answer_budget="small", temperature=1.0, seed=5, **opts)]
    gen = Generation(m, prompts[:1], reqs[0])
    gen.step()
    assert gen.add(prompts[1], reqs[1]) == 1
    gen.step()
    assert gen.add(prompts[2], reqs[2]) == 2
    finished: dict[int, object] = {}
    while gen.active:
        gen.step()
        for i, r in gen.take_finished():
            assert i not in finished
            finished[i] = r
        assert all(c.batch_size == len(gen.active) for c in gen.caches.values())
    assert sorted(finished) == [0, 1, 2] and gen.take_finished() == [] and not gen.rows
    for i, (p, req) in enumerate(zip(prompts, reqs)):
        assert finished[i].ids == Generation(m, [p], req).collect()[0].ids
    assert finished[1].stats.think_budgets == ["small"] and finished[2].stats.answer_budgets == ["small"]


def test_greedy_rows_take_one_argmax_a_step_whatever_their_requests(m, monkeypatch):
    """A batch file gives every row its own Request: the greedy ones are sampled in one argmax a step, the
    sampled ones each from its own generator, and every row's tokens are those it gets alone."""
    from elastic_local.engine import generate

    opts = dict(max_think_tokens=3, max_answer_tokens=4, ignore_eos=True, think_close=CLOSE)
    prompts = [m.chat_prompt(q) for q in ("one", "two", "three", "four")]
    reqs = [Request(**opts), Request(**opts), Request(temperature=1.0, seed=7, **opts), Request(**opts)]
    calls: list[int] = []
    monkeypatch.setattr(generate, "sample", lambda logits, *a, _sample=generate.sample:
                        calls.append(len(logits)) or _sample(logits, *a))
    gen = Generation(m, prompts[:1], reqs[0])
    for p, req in zip(prompts[1:], reqs[1:]):
        gen.add(p, req)
    got = {i: r.ids for i, r in enumerate(gen.collect())}
    assert 3 in calls and max(calls) <= 3  # the three greedy rows together, the sampled one alone
    for i, (p, req) in enumerate(zip(prompts, reqs)):
        assert got[i] == Generation(m, [p], req).collect()[0].ids


def renamed_think_end(m, prompt):
    """`m` with one of the tokens it thinks in taken for `</think>`, so that it closes thinking itself."""
    _, [free] = run(m, [prompt], max_think_tokens=12, max_answer_tokens=1, ignore_eos=True)
    sp = m.specials

    class Renamed(type(m)):
        specials = Specials(sp.think_start, free.think_ids[9], sp.eos)

    return Renamed(m.net, m._budgets, m.path, m.tokenizer)


@pytest.mark.parametrize("case", ["think budget", "model closes thinking", "stop id in thinking",
                                  "stop id in the answer", "stop string", "answer limit"])
def test_a_run_ahead_gives_each_token_text_and_end_of_a_step_a_token(m, monkeypatch, case):
    """A lone greedy row runs ahead in C (`run(ahead=True)`: collect, streams) up to the next decision only
    its Row can make; the events and results must be those of one step a token, and collect's, which takes
    a run's tokens at once (Row.accept_run), the same results."""
    prompt = m.chat_prompt("ahead")
    opts = dict(max_think_tokens=30, max_answer_tokens=30, ignore_eos=True, think_close=CLOSE,
                think_budget="small", answer_budget="full")
    model, [free] = m, run(m, [prompt], **opts)[1]
    if case == "model closes thinking":
        model, opts["max_think_tokens"] = renamed_think_end(m, prompt), None
    elif case == "stop id in thinking":
        opts["stop_ids"], opts["max_think_tokens"] = (free.think_ids[17],), None
    elif case == "stop id in the answer":
        opts["stop_ids"] = (free.answer_ids[11],)
    elif case == "stop string":
        opts["stop"] = [free.answer_text[12:15]]
    elif case == "answer limit":
        prompt, opts["max_answer_tokens"] = m.chat_prompt("ahead", think=False), 57

    def tokens(events):
        return [(e.id, e.text, e.phase, e.budget, e.forced) for e in events if isinstance(e, Token)]

    def ends(r):
        st = r.stats
        return (r.ids, r.think_text, r.answer_text, r.finish_reason, r.finish_phase, r.think_end,
                st.think_tokens, st.answer_tokens, st.think_inserted, st.think_budgets, st.answer_budgets)

    step_by_step = list(Generation(model, [prompt], Request(**opts)).run())
    lengths = runs_ahead(monkeypatch)
    ahead = list(Generation(model, [prompt], Request(**opts)).run(ahead=True))
    assert tokens(ahead) == tokens(step_by_step)
    assert ends(ahead[-1].results[0]) == ends(step_by_step[-1].results[0])
    assert ends(Generation(model, [prompt], Request(**opts)).collect()[0]) == ends(step_by_step[-1].results[0])
    assert (ahead[-1].results[0].finish_reason == "stop") == case.startswith("stop")
    assert lengths and max(lengths) >= 8, lengths  # it did run ahead
    if case != "stop string":  # an answer with stop strings is matched token by token
        assert sum(lengths) >= len(tokens(ahead)) - 8
    sampled = sampled_tokens(ahead, len(prompt))
    assert assert_argmax(m, ahead[-1].results[0].ids, sampled) >= len(sampled) - 2


def test_a_budget_times_its_tokens_once_per_model_not_once_per_generation(m, monkeypatch):
    """The first run ahead of a budget on a model is one token, to time one (a model's token may take
    anything from microseconds to seconds); every later generation on it sizes its first from that."""
    lengths = runs_ahead(monkeypatch)
    monkeypatch.setattr(m, "token_s", {})
    prompt = m.chat_prompt("time it", think=False)
    first = m.generate(prompt, answer_budget="small", max_answer_tokens=20, ignore_eos=True)
    assert lengths[0] == 1 and set(m.token_s) == {"small"}
    lengths.clear()
    again = m.generate(prompt, answer_budget="small", max_answer_tokens=20, ignore_eos=True)
    assert lengths == [19] and again.ids == first.ids  # the first token comes from the prefill


@pytest.mark.parametrize("how", ["switch", "cancel"])
def test_a_switch_or_cancel_from_another_thread_stops_a_run_ahead_at_its_token(m, monkeypatch, how):
    """A stream's generation runs ahead by thousands of tokens here (no time limit); a switch or cancel
    arriving in the middle of one must take effect at the next token, as it does a step a token."""
    from elastic_local.engine.cacheset import CacheSet

    runs_ahead(monkeypatch)
    inside = threading.Event()
    ran, calls = CacheSet.run_ahead, []  # (tokens asked for, tokens run) of each long run ahead

    def signal(self, budget, seq, n, *args):
        cache = self.caches.get(budget)
        if n <= 100 or cache is None or cache.lengths[0] != len(seq) - 1:
            return ran(self, budget, seq, n, *args)  # a token to time one, or none: the budget catches up first
        inside.set()
        out = ran(self, budget, seq, n, *args)
        calls.append((n, len(out)))
        return out

    monkeypatch.setattr(CacheSet, "run_ahead", signal)
    prompt = m.chat_prompt("long")
    opts = dict(think_budget="full", answer_budget="full", max_think_tokens=3000, max_answer_tokens=3,
                ignore_eos=True, think_close=CLOSE)
    s = m.stream(prompt, **opts)
    assert inside.wait(timeout=30)
    s.switch(think="small") if how == "switch" else s.cancel()
    events = list(s)
    r = events[-1].results[0]
    asked, got = calls[0]
    assert got < asked  # stopped early
    if how == "cancel":
        assert r.finish_reason == "cancelled" and len(r.think_ids) < 3000
        assert r.ids == Generation(m, [prompt], Request(**opts)).collect()[0].ids[: len(r.ids)]
    else:
        thinking = [e.budget for e in events if isinstance(e, Token) and e.phase == "think" and not e.forced]
        first = thinking.index("small")
        assert first < 3000 - 2 and set(thinking[first:]) == {"small"} and len(thinking) == 3000
        assert assert_argmax(m, r.ids, sampled_tokens(events, len(prompt))) >= 2900
