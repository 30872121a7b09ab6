"""model/sample.c, the CPU's draw of a sampled token: against torch's ops (engine/sampling.py) as the
oracle, and sampled tokens run ahead in the C decode step against the same tokens taken step by step."""

from __future__ import annotations

import ctypes

import pytest
import torch
from gen_util import elastic_model

from elastic_local.engine.cacheset import CacheSet
from elastic_local.engine.generate import Generation, Request
from elastic_local.engine.sampling import Sampling, logits_to_probs, sample
from elastic_local.model import gemv

pytestmark = pytest.mark.skipif(gemv.library() is None, reason="no C compiler: the torch draw runs instead")

SETTINGS = [
    Sampling(temperature=1.0),
    Sampling(temperature=0.7, top_k=5),  # the heap from 80 tokens (16 k), the selection below
    Sampling(temperature=1.0, top_p=0.9),
    Sampling(temperature=1.3, top_p=0.5, min_p=0.05),
    Sampling(temperature=0.5, top_k=50, top_p=0.95, min_p=0.01),
    Sampling(temperature=2.0, top_k=1500, top_p=0.99),  # the selection below 24,000 tokens, the heap above
]


def c_draw(logits: torch.Tensor, s: Sampling, u: float) -> tuple[int, torch.Tensor]:
    """sample.c's token for one row of logits at uniform number u, and the probabilities it drew from."""
    V = logits.shape[-1]
    logits, at = logits.contiguous(), torch.tensor([u])
    probs, keys, out = torch.empty(V), torch.empty(V, dtype=torch.int64), (ctypes.c_int64 * 1)()
    if gemv.library().sample_rows(logits.data_ptr(), 1, V, ctypes.byref(s.params()), at.data_ptr(), out,
                                  probs.data_ptr(), keys.data_ptr()):
        raise ValueError("not finite")
    return out[0], probs


@pytest.mark.parametrize("vocab", [7, 512, 5000, 70000])
def test_the_c_draw_keeps_torchs_probabilities_and_picks_its_tokens(vocab):
    """The same tokens kept (top-k, nucleus, min-p; but a token or two at the nucleus's edge where the mass
    before it is top_p to float32 rounding), the same probabilities to that rounding, and at every uniform
    number the token torch's cumulative sum picks, but where u lands within rounding of a boundary between
    two tokens."""
    g = torch.Generator().manual_seed(vocab)
    for s in SETTINGS:
        for spread in (1.0, 4.0):
            logits = torch.randn(vocab, generator=g) * spread
            want = logits_to_probs(logits[None], s)[0]
            _, probs = c_draw(logits, s, 0.5)
            differ = (probs > 0) != (want > 0)
            if differ.any():  # only at the nucleus's edge, where float32 sums of the mass before it differ
                before = logits_to_probs(logits[None], Sampling(temperature=s.temperature, top_k=s.top_k))[0]
                p, order = before.double().sort(descending=True)
                mass = torch.empty_like(p).scatter_(0, order, p.cumsum(0) - p)
                assert differ.sum() <= 3 and ((mass[differ] - s.top_p).abs() < 1e-5).all(), (s, spread)
                torch.testing.assert_close(probs[~differ], want[~differ], rtol=1e-3, atol=1e-7)
                continue
            torch.testing.assert_close(probs, want, rtol=1e-5, atol=1e-7)
            c = want.double().cumsum(0)
            compared = 0
            for u in torch.rand(50, generator=g).tolist():
                at = u * float(c[-1])
                if (c - at).abs().min() < 2e-6:
                    continue
                assert c_draw(logits, s, u)[0] == int((c <= at).sum()), (s, spread, u)
                compared += 1
            assert compared >= 25


def test_equal_probabilities_rank_by_index_and_ties_at_the_kth_stay():
    """Where torch's sort leaves ties in no set order, sample.c ranks the lower index first; top-k keeps
    every token tied with the k-th largest, as torch's mask does."""
    _, probs = c_draw(torch.zeros(8), Sampling(temperature=1.0, top_p=0.5), 0.5)
    assert (probs > 0).tolist() == [True] * 4 + [False] * 4
    _, probs = c_draw(torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, -1.0]), Sampling(temperature=1.0, top_k=3), 0.5)
    assert (probs > 0).tolist() == [True, False, True, True, True, False]
    _, probs = c_draw(torch.tensor([0.0, 0.0, 3.0]), Sampling(temperature=1.0, top_p=0.9999999), 0.5)
    assert (probs > 0).all()  # a top_p the float32 mass may never reach keeps them all


def test_either_end_of_the_uniform_range_takes_a_likely_token():
    """u = 0 takes the first token with any probability, the largest float32 under 1 the last: never a
    masked (-inf) one beside them, nor an index past the vocabulary."""
    logits = torch.tensor([-torch.inf, 0.0, 1.0, -torch.inf, -torch.inf])
    assert c_draw(logits, Sampling(temperature=1.0), 0.0)[0] == 1
    assert c_draw(logits, Sampling(temperature=1.0), 1 - 2**-24)[0] == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_logits_that_are_not_numbers_stop_the_draw(bad):
    with pytest.raises(ValueError, match="not finite"):
        sample(torch.tensor([[0.5, 0.5], [bad, 0.5]]), Sampling(temperature=1.0))
    with pytest.raises(ValueError, match="not finite"):
        sample(torch.full((1, 3), -torch.inf), Sampling(temperature=1.0))


def test_the_draws_follow_the_probabilities():
    """20000 draws of the steps' path (torch's generator, then sample.c): each token's share within four
    standard deviations of its probability, and none of a token top-k left out."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -5.0]]).repeat(20000, 1)
    s = Sampling(temperature=1.0, top_k=4)
    ids = torch.tensor(sample(logits, s, torch.Generator().manual_seed(0)))
    share = torch.bincount(ids, minlength=5) / 20000
    want = logits_to_probs(logits[:1], s)[0]
    assert share[4] == 0
    assert ((share - want).abs() <= 4 * (want * (1 - want) / 20000).sqrt() + 1e-9).all(), (share, want)


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    return elastic_model(tmp_path_factory.mktemp("samplec"), seed=3)


def test_a_run_ahead_draws_the_tokens_steps_draw_and_gives_back_what_it_did_not_use(m, threads):
    """`decode_ahead` with a draw against decode_token and `sample` a token at a time, the same seed: the
    same tokens, and where a stop token ends the run early the generator as far as the tokens drawn."""
    s = Sampling(temperature=1.0, top_p=0.95)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.inference_mode():
        caches = [m.net.new_cache(), m.net.new_cache()]
        for c in caches:
            m.net.forward(prompt[:, :-1], cache=c)
        g = torch.Generator().manual_seed(7)
        want, tok = [], int(prompt[0, -1])
        for _ in range(24):
            tok = sample(m.net.decode_token(tok, caches[0]), s, g)[0]
            want.append(tok)
        assert len(set(want)) > 4  # drawn, not one greedy token again and again
        g = torch.Generator().manual_seed(7)
        assert m.net.decode_ahead(int(prompt[0, -1]), caches[1], 24, (), draw=(s.params(), g)) == want
        cache = m.net.new_cache()
        m.net.forward(prompt[:, :-1], cache=cache)
        stop = want[9]
        g = torch.Generator().manual_seed(7)
        got = m.net.decode_ahead(int(prompt[0, -1]), cache, 24, (stop,), draw=(s.params(), g))
        assert got == want[:want.index(stop) + 1] and cache.lengths == [prompt.shape[1] + len(got) - 1]
        fresh = torch.Generator().manual_seed(7)
        torch.rand(len(got), generator=fresh)
        assert torch.equal(g.get_state(), fresh.get_state())


@pytest.mark.parametrize("longest", [1, 3, None])
def test_sampled_rows_get_the_same_tokens_run_ahead_or_step_by_step(m, monkeypatch, longest):
    """A seeded sampled request thinking on one budget and answering on another (a catch-up step at the
    switch, run ahead before and after it): run ahead in runs of at most `longest` tokens (None: as far as
    the engine goes), and stepped one token at a time, the same tokens."""
    req = dict(think_budget="small", answer_budget="full", max_think_tokens=9, max_answer_tokens=20,
               ignore_eos=True, think_close="ok.", temperature=1.0, top_p=0.9, min_p=0.02, seed=11)
    prompt = m.chat_prompt("a sampled question")
    stepped = list(Generation(m, [prompt], Request(**req)).run(ahead=False))[-1].results[0]
    if longest is not None:
        run = CacheSet.run_ahead
        monkeypatch.setattr(CacheSet, "run_ahead",
                            lambda self, budget, seq, n, *a: run(self, budget, seq, min(n, longest), *a))
    ran = Generation(m, [prompt], Request(**req)).collect()[0]
    assert ran.ids == stepped.ids and len(stepped.answer_ids) == 20 and len(set(stepped.answer_ids)) > 3


def test_a_run_ahead_stops_at_logits_it_cannot_draw_from(tmp_path):
    """A NaN in the residual stream: the run ahead raises the steps' error at that token, which the cache
    has consumed, as a step's would have."""
    m = elastic_model(tmp_path, seed=3)
    with torch.no_grad():
        m.net.embed[92] = float("nan")
    with torch.inference_mode():
        cache = m.net.new_cache()
        m.net.forward(torch.tensor([[3, 14, 15]]), cache=cache)
        draw = (Sampling(temperature=1.0).params(), torch.Generator().manual_seed(0))
        with pytest.raises(ValueError, match="not finite"):
            m.net.decode_ahead(92, cache, 10, (), draw=draw)
        assert cache.lengths == [4]
