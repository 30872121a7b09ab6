"""A batch's decode step in C (step.c's decode_rows, `DecodeStep.rows`): rows at their own positions, one
product per weight for all of them, against transformers from scratch, against each row alone, on any thread
count; a short prompt as the rows of one step (`DecodeStep.prefill`), and rows catching up beside rows that
decode (`DecodeStep.sequences`), against their tokens one at a time."""

import time
from dataclasses import replace

import pytest
import torch
from test_cpu_gemv import X86
from test_model_vs_transformers import CONFIGS
from tiny import hf_logits, make_checkpoint

import elastic_local
from elastic_local.model import NemotronH, step
from elastic_local.model.budget import Budget
from elastic_local.model.nemotron_h import HybridCache

pytestmark = pytest.mark.skipif(not X86, reason="the C decode step is x86 AVX2 only; elsewhere torch's layers run")


def prefilled(net, budget, prompts: list[torch.Tensor]) -> HybridCache:
    """One batched cache of `prompts`, each prefilled alone (rows at different positions)."""
    caches = []
    for p in prompts:
        c = net.new_cache(budget=budget)
        net.forward(p[None], cache=c)
        caches.append(c)
    return HybridCache.stack(caches)


def batched_steps(net, budget, prompts: list[torch.Tensor], feed: list[torch.Tensor]) -> torch.Tensor:
    """Logits [R, steps, V] of batched one-token steps after `prompts`, row r taking feed[r][t] at step t."""
    with torch.inference_mode():
        cache = prefilled(net, budget, prompts)
        out = [net.forward(torch.stack([f[t] for f in feed])[:, None], cache=cache)[:, 0]
               for t in range(len(feed[0]))]
    assert cache.lengths == [len(p) + len(f) for p, f in zip(prompts, feed)]
    return torch.stack(out, dim=1)


def alone_steps(net, budget, prompt: torch.Tensor, feed: torch.Tensor) -> torch.Tensor:
    """Logits [steps, V] of the same steps for one row on its own (batch 1: the one-row C step)."""
    with torch.inference_mode():
        cache = prefilled(net, budget, [prompt])
        return torch.stack([net.decode_token(int(t), cache)[0] for t in feed])


def torch_layers_never_run_a_step(monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(NemotronH, "_layers", lambda net, ids, *a, _run=NemotronH._layers, **k:
                        calls.append(ids.shape[1]) or _run(net, ids, *a, **k))
    return calls


@pytest.mark.parametrize("name", sorted(n for n in CONFIGS if n != "grouped_router"))  # that one: torch's (step.py)
def test_a_batchs_rows_at_their_own_positions_decode_like_transformers_from_scratch(tmp_path, name, monkeypatch):
    hf = make_checkpoint(tmp_path, seed=4, **CONFIGS[name])
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 96, (n,), generator=g) for n in (9, 4, 13)]
    m = elastic_local.load(tmp_path)
    calls = torch_layers_never_run_a_step(monkeypatch)
    got = batched_steps(m.net, m.budget(), [s[:-3] for s in seqs], [s[-3:] for s in seqs])
    assert all(n > 1 for n in calls), "a batched step ran the torch layers"
    assert isinstance(m.net.c_steps[m.budget()], step.DecodeStep)
    for r, s in enumerate(seqs):
        torch.testing.assert_close(got[r], hf_logits(hf, s[None])[0, -3:], atol=1e-4, rtol=0)


def test_each_row_gets_the_bits_it_gets_alone_on_every_budget(nested_tails, threads, monkeypatch):
    """float32 panels: every product's tiles sum as the one-row kernel does, so a row's logits are its own to
    the bit, whatever the other rows, the thread count or the budget (and a pruned one whose in_proj runs as
    four products). One row past 256 positions reads its cache in runs (attention_runs) and merges them; the
    K / V caches grow past their first capacity (64) between steps."""
    m = elastic_local.load(nested_tails)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (300, 5, 60, 1)]
    feed = [torch.randint(0, 96, (8,), generator=g) for _ in prompts]
    half = m.budget("half")
    heads = Budget("heads", half.hidden, tuple(replace(s, mamba_heads=s.mamba_heads // 2) for s in half.layers))
    calls = torch_layers_never_run_a_step(monkeypatch)
    for b in [m.budget(name) for name in m.budgets] + [heads]:
        got = batched_steps(m.net, b, prompts, feed)
        for r, (p, f) in enumerate(zip(prompts, feed)):
            assert torch.equal(got[r], alone_steps(m.net, b, p, f)), (b.name, r)
    assert all(n > 1 for n in calls)


@pytest.mark.parametrize("precision", ["fp8", "nvfp4", "nvfp4-a4"])
def test_quantized_rows_agree_with_each_row_alone(nested_tails, precision):
    """Packed weights: from four rows a weight is decoded once into panels for all of them (the one-row
    kernel scales its inputs instead), so the rows agree with their own steps to rounding. W4A4 (NVFP4 with
    its inputs rounded): up to 7 rows each take the one-row integer products, so each gets its own bits."""
    m = elastic_local.load(nested_tails, precision=precision.removesuffix("-a4"),
                           activations="nvfp4" if precision.endswith("-a4") else "float")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (7, 3, 11, 2, 5)]
    feed = [torch.randint(0, 96, (4,), generator=g) for _ in prompts]
    got = batched_steps(m.net, m.budget(), prompts, feed)
    for r, (p, f) in enumerate(zip(prompts, feed)):
        alone = alone_steps(m.net, m.budget(), p, f)
        if precision == "nvfp4-a4":
            assert torch.equal(got[r], alone), r
        torch.testing.assert_close(got[r], alone, atol=1e-4, rtol=1e-4)


def test_bfloat16_rows_get_the_bits_they_get_alone(nested_tails, threads):
    """A bfloat16 network: bf16 panels, embedding, convolution states and K / V caches, rounded where the
    one-row step rounds them."""
    m = elastic_local.load(nested_tails, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (6, 2, 9)]
    feed = [torch.randint(0, 96, (5,), generator=g) for _ in prompts]
    got = batched_steps(m.net, m.budget(), prompts, feed)
    for r, (p, f) in enumerate(zip(prompts, feed)):
        assert torch.equal(got[r], alone_steps(m.net, m.budget(), p, f)), r


def test_a_token_outside_the_vocabulary_refuses_the_whole_step_before_any_row_changes(nested_tails):
    m = elastic_local.load(nested_tails)
    with torch.inference_mode():
        cache = prefilled(m.net, m.budget(), [torch.tensor([1, 2, 3]), torch.tensor([4])])
        before = [s.ssm.clone() for s in cache.layers if hasattr(s, "ssm")]
        with pytest.raises(IndexError, match="outside the vocabulary"):
            m.net.forward(torch.tensor([[5], [96]]), cache=cache)
    assert cache.lengths == [3, 1]
    assert all(torch.equal(a, s.ssm) for a, s in zip(before, [s for s in cache.layers if hasattr(s, "ssm")]))


def test_a_generation_of_several_prompts_decodes_its_batch_in_c_rows(tmp_path, monkeypatch):
    """The engine's batched steps (every row one token behind) reach DecodeStep.rows, rows on both budgets
    and in both phases, and each row's tokens are the ones it gets generated alone."""
    from gen_util import elastic_model

    from elastic_local.engine.generate import Generation, Request

    m = elastic_model(tmp_path, seed=3)
    prompts = [m.chat_prompt("a"), m.chat_prompt("a longer question than that"), m.chat_prompt("no", think=False)]
    request = Request(think_budget="small", answer_budget="full", max_think_tokens=6, max_answer_tokens=12,
                      ignore_eos=True, think_close="ok.")
    steps: list[list[int]] = []
    monkeypatch.setattr(step.DecodeStep, "sequences", lambda self, seqs, *a, _run=step.DecodeStep.sequences:
                        steps.append([len(s) for s in seqs]) or _run(self, seqs, *a))
    together = Generation(m, prompts, request).collect()
    assert max(map(len, steps)) >= 2  # rows on one budget at a time: the sub-batches of a step
    assert any(max(s) > 1 and s.count(1) for s in steps)  # rows caught up beside a row that decoded
    for p, r in zip(prompts, together):
        assert r.ids == Generation(m, [p], request).collect()[0].ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_catching_up_beside_decoding_rows_get_the_bits_of_their_tokens_one_at_a_time(nested_tails, dtype,
                                                                                           threads):
    """A step of rows that decode (one token) and rows that catch up (a whole prompt into a row that just
    joined, the tokens that close thinking, the most one row may take): every row's last logits and the
    states it leaves are those of its tokens decoded one at a time alone, on every budget; the rows the
    step does not name keep theirs."""
    m = elastic_local.load(nested_tails, dtype=dtype)
    g = torch.Generator().manual_seed(10)
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (5, 9, 2, 7, 4)] + [torch.tensor([], dtype=torch.long)]
    feeds = [[11], [3, 4, 5], torch.randint(0, 96, (step.PREFILL_ROWS,), generator=g).tolist(), [12], None,
             torch.randint(0, 96, (17,), generator=g).tolist()]  # row 4 is not in the step; row 5 joins empty
    rows = [r for r, f in enumerate(feeds) if f is not None]
    for b in (m.budget(name) for name in m.budgets):
        with torch.inference_mode():
            cache = HybridCache.stack([prefilled(m.net, b, prompts[:-1]), m.net.new_cache(budget=b)])
            untouched = [{n: getattr(s, n)[4].clone() for n in vars(s)} for s in cache.layers if s is not None]
            got = m.net.advance_rows([feeds[r] for r in rows], cache, rows)
            assert cache.lengths == [len(p) + len(f or []) for p, f in zip(prompts, feeds)]
            for j, r in enumerate(rows):
                alone = m.net.new_cache(budget=b)
                if len(prompts[r]):
                    m.net.forward(prompts[r][None], cache=alone)
                want = [m.net.decode_token(t, alone)[0] for t in feeds[r]][-1]
                assert torch.equal(got[j], want), (b.name, r)
                for x, y in ((x, y) for x, y in zip(cache.layers, alone.layers) if x is not None):
                    for name in vars(x):
                        a, c = getattr(x, name)[r], getattr(y, name)[0]
                        if name in ("k", "v"):
                            a, c = a[:, :alone.lengths[0]], c[:, :alone.lengths[0]]
                        assert torch.equal(a, c), (b.name, r, name)
            for before, s in zip(untouched, (s for s in cache.layers if s is not None)):
                for name, t in before.items():
                    have = getattr(s, name)[4]
                    assert torch.equal(have[:, :t.shape[1]] if name in ("k", "v") else have, t), name
    with torch.inference_mode(), pytest.raises(ValueError, match="1 to 64 a row"):
        m.net.advance_rows([[1] * (step.PREFILL_ROWS + 1)], cache, [0])


def test_a_long_catch_up_runs_alone_and_the_short_ones_still_join_the_step(tmp_path, monkeypatch):
    """A step whose rows catch up past PREFILL_ROWS tokens and within it: the long one runs alone (the
    torch layers' prefill), the short ones in one C step together; every row's tokens are its own alone."""
    from gen_util import elastic_model

    from elastic_local.engine.generate import Generation, Request

    m = elastic_model(tmp_path, seed=3)
    prompts = [m.chat_prompt("a"), m.chat_prompt("a longer question than that " * 4), m.chat_prompt("no")]
    assert len(prompts[1]) > step.PREFILL_ROWS >= max(len(prompts[0]), len(prompts[2]))
    request = Request(max_think_tokens=4, max_answer_tokens=4, ignore_eos=True)
    steps: list[list[int]] = []
    monkeypatch.setattr(step.DecodeStep, "sequences", lambda self, seqs, *a, _run=step.DecodeStep.sequences:
                        steps.append([len(s) for s in seqs]) or _run(self, seqs, *a))
    together = Generation(m, prompts, request).collect()
    assert steps[0] == [len(prompts[0]), len(prompts[2])]  # the first step: the two short prompts, joined
    for p, r in zip(prompts, together):
        assert r.ids == Generation(m, [p], request).collect()[0].ids


def test_rows_that_prefill_in_one_step_are_each_charged_their_tokens_share_of_it(tmp_path):
    """Prompts that join together prefill in one C step; each row's prefill seconds (its CatchUp, what the
    batch's Admission leaves out of decoding) are its tokens' share of that step, so they add up to the
    step, not to once the step per row."""
    from gen_util import elastic_model

    from elastic_local.engine.events import CatchUp
    from elastic_local.engine.generate import Generation, Request

    m = elastic_model(tmp_path, seed=3)
    prompts = [m.chat_prompt(q, think=False) for q in ("a", "a longer question than that", "no")]
    gen = Generation(m, prompts, Request(max_answer_tokens=3, ignore_eos=True))
    start = time.perf_counter()
    caught = [e for e in gen.step() if isinstance(e, CatchUp)]
    took = time.perf_counter() - start
    assert [c.tokens for c in caught] == [len(p) for p in prompts] and all(c.prefill for c in caught)
    assert sum(c.seconds for c in caught) <= took
    for c in caught:
        assert c.seconds / caught[0].seconds == pytest.approx(c.tokens / caught[0].tokens)


def test_a_batch_step_without_scratch_memory_says_so_and_leaves_every_row_where_it_was(nested_tails):
    from types import SimpleNamespace

    m = elastic_local.load(nested_tails)
    with torch.inference_mode():
        cache = prefilled(m.net, m.budget(), [torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
        c_step = m.net._c_step(cache)
        c_step.lib = SimpleNamespace(decode_rows=lambda *args: -1)
        with pytest.raises(MemoryError, match="decode step's scratch buffer at position 3.*free memory"):
            m.net.forward(torch.tensor([[6], [7]]), cache=cache)
    assert cache.lengths == [3, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_short_prompt_prefills_as_one_steps_rows_with_the_bits_of_its_tokens_one_at_a_time(nested_tails, dtype,
                                                                                              threads, monkeypatch):
    """One sequence's prompt of up to PREFILL_ROWS tokens runs as the rows of one C step (each Mamba group's
    state carried from row to row, each row's attention reading the rows before it from the cache): its
    logits and the states it leaves are those of its tokens decoded one at a time, on every budget; a
    longer prompt takes the torch layers, whose products read each weight once for all its rows."""
    m = elastic_local.load(nested_tails, dtype=dtype)
    g = torch.Generator().manual_seed(8)
    calls = torch_layers_never_run_a_step(monkeypatch)
    for b in (m.budget(name) for name in m.budgets):
        for start, n in ((0, 1 + step.PREFILL_ROWS // 2), (7, step.PREFILL_ROWS)):  # a fresh cache; one that holds 7
            ids = torch.randint(0, 96, (1, start + n), generator=g)
            with torch.inference_mode():
                rows, alone = m.net.new_cache(budget=b), m.net.new_cache(budget=b)
                if start:
                    for c in (rows, alone):
                        m.net.forward(ids[:, :start], cache=c)
                got = m.net.forward(ids[:, start:], cache=rows)
                last = got[:, -1:]
                want = torch.stack([m.net.decode_token(int(t), alone)[0] for t in ids[0, start:]])[None]
            assert torch.equal(got, want), (b.name, start)
            assert rows.lengths == alone.lengths == [start + n]
            for x, y in ((x, y) for x, y in zip(rows.layers, alone.layers) if x is not None):
                for name in vars(x):
                    a, c = getattr(x, name), getattr(y, name)
                    t = min(a.shape[2], c.shape[2]) if name in ("k", "v") else None
                    assert torch.equal(a[:, :, :t], c[:, :, :t]), (b.name, name)
            with torch.inference_mode():
                again = m.net.new_cache(budget=b)
                if start:
                    m.net.forward(ids[:, :start], cache=again)
                assert torch.equal(m.net.forward(ids[:, start:], cache=again, last_only=True), last)
    assert calls == []
    with torch.inference_mode():
        m.net.forward(torch.randint(0, 96, (1, step.PREFILL_ROWS + 1), generator=g), cache=m.net.new_cache())
    assert calls == [step.PREFILL_ROWS + 1]


def test_some_rows_of_a_batch_decode_in_place_and_leave_the_others_to_the_bit(nested_tails):
    """`NemotronH.advance_rows` (the engine's sub-batches: rows of one budget while others think on another)
    steps only the rows it names, where they lie in the batched cache: those rows get the logits they get
    alone, the other rows' states and lengths do not change."""
    m = elastic_local.load(nested_tails)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (5, 9, 2, 7)]
    with torch.inference_mode():
        cache = prefilled(m.net, m.budget(), prompts)
        before = [{n: getattr(s, n).clone() for n in vars(s)} for s in cache.layers if s is not None]
        got = m.net.advance_rows([[11], [12]], cache, [2, 0])
        for tokens, rows in (([1, 2], [1, 1]), ([1], [4]), ([1, 2], [1])):  # a row twice, none such, a token short
            with pytest.raises(ValueError, match="tokens for rows"):
                m.net.advance_rows([[t] for t in tokens], cache, rows)
    assert cache.lengths == [6, 9, 3, 7]
    for r, t, row in ((2, 11, got[0]), (0, 12, got[1])):
        assert torch.equal(row, alone_steps(m.net, m.budget(), prompts[r], torch.tensor([t]))[0])
    after = [s for s in cache.layers if s is not None]
    for b, s in zip(before, after):
        for name, t in b.items():
            for r in (1, 3):  # untouched rows, every position
                assert torch.equal(getattr(s, name)[r, ..., :t.shape[-2], :] if name in ("k", "v") else
                                   getattr(s, name)[r], t[r]), name
