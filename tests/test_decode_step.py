"""model/step.c, the C decode step: one-token steps of one sequence against transformers (the oracle) and
against the torch path, for every block kind, budget and precision; and where it hands over to torch."""

import ctypes
import math
import os
from dataclasses import FrozenInstanceError, replace

import pytest
import torch
from test_cpu_gemv import X86
from test_model_vs_transformers import CONFIGS
from tiny import ALIGNED, hf_logits, make_checkpoint

import elastic_local
from elastic_local.model import NemotronH, gemv, step
from elastic_local.model.budget import Budget
from elastic_local.model.mamba2 import MambaState
from elastic_local.model.nemotron_h import HybridCache

# On x86 with AVX2 (CI, every development box here) the library must build: a compiler problem fails these
# tests instead of skipping them (test_cpu_gemv.py)
pytestmark = pytest.mark.skipif(not X86, reason="the C decode step is x86 AVX2 only; elsewhere torch's layers run")


@pytest.fixture(autouse=True)
def library_built():
    assert gemv.library() is not None, "the CPU decode kernels did not build (see the warning)"


def greedy(net, budget, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [steps, V] and tokens of `steps` one-token greedy steps after prefilling `prompt` (batch 1)."""
    with torch.inference_mode():
        cache = net.new_cache(budget=budget)
        tok = net.forward(prompt[None], cache=cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        logits, toks = [], []
        for _ in range(steps):
            out = net.forward(tok, cache=cache)[0, -1]
            logits.append(out)
            tok = out.argmax()[None, None]
            toks.append(int(tok))
    return torch.stack(logits), torch.tensor(toks)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_steps_give_transformers_full_forward_logits(tmp_path, name):
    hf = make_checkpoint(tmp_path, seed=2, **CONFIGS[name])
    ids = torch.randint(0, 96, (1, 13), generator=torch.Generator().manual_seed(1))
    m = elastic_local.load(tmp_path)
    cache = m.new_cache()
    with torch.inference_mode():
        out = [m.forward(ids[:, :6], cache)] + [m.forward(ids[:, t:t + 1], cache) for t in range(6, 13)]
    torch.testing.assert_close(torch.cat(out, dim=1), hf_logits(hf, ids), atol=1e-4, rtol=0)
    assert cache.lengths == [13]
    built = m.net.c_steps[m.budget()]
    # group-limited routing is the torch path's (step.py); every other config decodes in C
    assert (built is None) == (m.config.n_group > 1)


@pytest.mark.parametrize("precision", [None, "fp8", "nvfp4", "nvfp4-a4"])
def test_every_budget_decodes_like_the_torch_path_across_cache_growth(nested_tails, precision, threads, monkeypatch):
    """70 steps: the KV cache regrows past its first capacity (64) inside the C step. nvfp4-a4: NVFP4 with
    its inputs rounded too (W4A4), the C step's integer products against torch's path on gemv.c's."""
    from dataclasses import replace

    from elastic_local.model.budget import Budget

    m = elastic_local.load(nested_tails, precision="nvfp4" if precision == "nvfp4-a4" else precision,
                           activations="nvfp4" if precision == "nvfp4-a4" else "float")
    prompt = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(5))
    half = m.budget("half")  # and half with half the Mamba heads: in_proj's four parts apart
    heads = Budget("heads", half.hidden, tuple(replace(s, mamba_heads=s.mamba_heads // 2) for s in half.layers))
    for b in [m.budget(name) for name in m.budgets] + [heads]:
        name = b.name
        with monkeypatch.context() as p:
            p.setattr(step, "build", lambda net, b: None)
            want_logits, want = greedy(m.net, b, prompt, 70)
        m.net.c_steps.clear()
        calls = []
        with monkeypatch.context() as p:
            p.setattr(NemotronH, "_layers", lambda net, ids, *a, _run=NemotronH._layers, _calls=calls, **k:
                      _calls.append(ids.shape[1]) or _run(net, ids, *a, **k))
            got_logits, got = greedy(m.net, b, prompt, 70)
        assert isinstance(m.net.c_steps[b], step.DecodeStep), name
        assert calls == [], "a step ran the torch path"  # the prompt too: its 9 tokens as the rows of one C step
        # a Mamba block whose budget keeps every head runs in_proj as one product, a pruned one as four
        assert {args.in_proj.out > 0 for _, kind, args in m.net.c_steps[b].blocks if kind == "M"} == {b != heads}
        assert torch.equal(got, want), (precision, name)
        torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)


def test_a_budget_with_a_layer_off_skips_it(nested_tails):
    from dataclasses import replace

    from elastic_local.model.budget import Budget

    m = elastic_local.load(nested_tails)
    full = m.budget()
    off = Budget("no-moe", full.hidden, tuple(replace(s, enabled=s.kind != "E") for s in full.layers))
    prompt = torch.randint(0, 96, (5,), generator=torch.Generator().manual_seed(1))
    got, _ = greedy(m.net, off, prompt, 4)
    assert isinstance(m.net.c_steps[off], step.DecodeStep)
    m.net.c_steps[off] = None  # the torch path from here on
    want, _ = greedy(m.net, off, prompt, 4)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_step_without_grad_mode_runs_in_c_and_one_with_it_on_torch(nested_tails):
    net = elastic_local.load(nested_tails).net
    cache = net.new_cache()
    with torch.no_grad():
        net.forward(torch.tensor([[1, 2, 3]]), cache=cache)
        net.forward(torch.tensor([[4]]), cache=cache)
    assert isinstance(net.c_steps[net.resident], step.DecodeStep)
    net.c_steps.clear()
    net.forward(torch.tensor([[5]]), cache=cache)  # grad mode on (training): the torch layers
    assert not net.c_steps and cache.lengths == [5]


def test_decode_token_is_the_torch_paths_one_token_forward(nested_tails):
    """The engine's batch-1 decode (`decode_token`, no tensor of one id) against the torch layers' forward of
    that token: in C without grad mode, on the torch layers with it."""
    import copy

    net = elastic_local.load(nested_tails).net
    for grad in (False, True):
        cache = net.new_cache()
        with torch.no_grad():
            net.forward(torch.tensor([[1, 2, 3]]), cache=cache)
        twin = copy.deepcopy(cache)
        net.c_steps.clear()
        with torch.set_grad_enabled(grad):
            got = net.decode_token(7, cache)
        assert isinstance(net.c_steps.get(net.resident), step.DecodeStep) != grad
        with torch.enable_grad():  # grad mode: the torch layers
            want = net.forward(torch.tensor([[7]]), cache=twin)[:, -1]
        assert got.shape == (1, 96) and cache.lengths == twin.lengths == [4]
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
    with torch.no_grad(), pytest.raises(IndexError, match="outside the vocabulary"):
        net.decode_token(96, cache)
    assert cache.lengths == [4]


def test_a_step_without_scratch_memory_says_so_and_leaves_the_cache_length(nested_tails):
    """step.c's only failure (its scratch buffer's malloc refused): a MemoryError that says what to do."""
    from types import SimpleNamespace

    net = elastic_local.load(nested_tails).net
    cache = net.new_cache()
    with torch.no_grad():
        net.forward(torch.tensor([[1, 2, 3]]), cache=cache)
        c_step = net._c_step(cache)
        c_step.lib = SimpleNamespace(decode_token=lambda *args: -1, decode_ahead=lambda *args: -1)
        with pytest.raises(MemoryError, match="decode step's scratch buffer at position 3.*free memory"):
            net.decode_token(4, cache)
        with pytest.raises(MemoryError, match="decode step's scratch buffer at position 3.*free memory"):
            net.decode_ahead(4, cache, 8, ())
        assert cache.lengths == [3]


def test_what_step_c_does_not_cover_runs_the_torch_path(nested_tails):
    m = elastic_local.load(nested_tails, dtype=torch.float16)
    assert step.build(m.net, m.budget()) is None  # float16: step.c reads float32 and bf16 networks
    m = elastic_local.load(nested_tails)
    def with_conv(cache: HybridCache, layout) -> HybridCache:  # a hand-built cache
        return HybridCache(cache.budget, [replace(s, conv=layout(s.conv)) if isinstance(s, MambaState) else s
                                          for s in cache.layers], list(cache.lengths))

    one = with_conv(m.new_cache(), lambda c: c.transpose(1, 2).contiguous().transpose(1, 2))
    assert not step.serves(one, m.net.dtype) and not one.dense  # a state that is not contiguous: the torch path
    one = with_conv(one, torch.Tensor.contiguous)
    assert step.serves(one, m.net.dtype) and one.dense  # checked once: the cache's own operations keep it contiguous
    with pytest.raises(AttributeError, match="fixed for its life"):
        one.layers = one.layers  # what the step has bound cannot change under it
    mamba = next(s for s in one.layers if isinstance(s, MambaState))
    with pytest.raises(FrozenInstanceError):
        mamba.conv = mamba.conv


def test_a_token_outside_the_vocabulary_is_refused_before_any_state_changes(nested_tails):
    m = elastic_local.load(nested_tails)
    cache = m.new_cache()
    with torch.inference_mode():
        m.forward(torch.tensor([[1, 2, 3]]), cache)
        before = [s.ssm.clone() for s in cache.layers if hasattr(s, "ssm")]
        with pytest.raises(IndexError, match="outside the vocabulary"):
            m.net.forward(torch.tensor([[96]]), cache=cache)
    assert cache.lengths == [3]
    assert all(torch.equal(a, s.ssm) for a, s in zip(before, [s for s in cache.layers if hasattr(s, "ssm")]))


def test_replacing_the_weights_forgets_the_steps_built_on_them(nested_tails):
    m = elastic_local.load(nested_tails)
    greedy(m.net, m.budget(), torch.tensor([1, 2]), 1)
    assert m.net.c_steps
    m.net.transpose_weights()
    assert not m.net.c_steps


def test_a_vocabulary_of_8300_decodes_like_transformers(tmp_path, threads):
    """A head of 346 panels, its last one partial, shared among the threads at whole panels."""
    hf = make_checkpoint(tmp_path, seed=6, vocab_size=8300)
    ids = torch.randint(0, 8300, (1, 7), generator=torch.Generator().manual_seed(2))
    m = elastic_local.load(tmp_path)
    cache = m.new_cache()
    out = [m.forward(ids[:, :4], cache)] + [m.forward(ids[:, t:t + 1], cache) for t in range(4, 7)]
    assert isinstance(m.net.c_steps[m.budget()], step.DecodeStep)
    torch.testing.assert_close(torch.cat(out, dim=1), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_two_caches_decoded_in_turn_each_follow_their_own_tokens(nested_tails):
    """One budget's step serves whichever cache it is handed: its Mamba states are bound per cache, its
    K / V caches each token (here they grow past their first capacity, 64 positions, mid-way)."""
    net = elastic_local.load(nested_tails).net
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([9, 8, 7, 6, 5])]
    alone = [greedy(net, net.resident, p, 70)[0] for p in prompts]
    with torch.inference_mode():
        caches = [net.new_cache() for _ in prompts]
        toks = [int(net.forward(p[None], cache=c, last_only=True)[0, -1].argmax()) for p, c in zip(prompts, caches)]
        turns = [[], []]
        for _ in range(70):
            for r, c in enumerate(caches):
                out = net.decode_token(toks[r], c)[0]
                turns[r].append(out)
                toks[r] = int(out.argmax())
    assert isinstance(net.c_steps[net.resident], step.DecodeStep)
    for r in range(2):
        torch.testing.assert_close(torch.stack(turns[r]), alone[r], atol=0, rtol=0)
        assert caches[r].lengths == [len(prompts[r]) + 70]


@pytest.mark.parametrize("threads", [2, 3], indirect=True)
def test_mamba_groups_shared_among_threads_decode_like_the_torch_path(tmp_path, threads, monkeypatch):
    """With at least as many groups as threads each thread runs whole groups, convolution to gated norm
    (4 groups on 2 threads: two each; on 3: two, one, one). The `threads` fixture's 1 and 3 threads with
    the other tests' 2 groups take the one-group-per-thread-count paths only."""
    make_checkpoint(tmp_path, seed=8, **dict(ALIGNED, n_groups=4, ssm_state_size=12))
    m = elastic_local.load(tmp_path)
    prompt = torch.randint(0, 96, (5,), generator=torch.Generator().manual_seed(9))
    with monkeypatch.context() as p:
        p.setattr(step, "build", lambda net, b: None)
        want_logits, want = greedy(m.net, m.net.resident, prompt, 20)
    m.net.c_steps.clear()
    got_logits, got = greedy(m.net, m.net.resident, prompt, 20)
    assert isinstance(m.net.c_steps[m.net.resident], step.DecodeStep)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 1, 16), (6, 3, 16), (6, 2, 12), (4, 2, 40)])
def test_attention_read_in_runs_of_positions_decodes_like_the_torch_path_on_any_thread_count(
        tmp_path, heads, kv_heads, head_dim, monkeypatch):
    """A token's attention reads each KV head's cache in runs of positions (one per 256, step.c's
    ATT_RUN), 64 positions a block, and merges the runs. 600 positions: one run, two, three; (KV head, run)
    units fewer than, as many as and more than the threads; partial blocks and lanes; a head size with a
    scalar tail (12), and one whose values are summed 32 columns at a time, then 8 (40). On 1, 2 and 3
    threads the logits are the same to the bit (the runs do not depend on the thread count), and the torch
    path's to 1e-4."""
    make_checkpoint(tmp_path, seed=10, **dict(ALIGNED, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                              head_dim=head_dim, hybrid_override_pattern="*M*-"))
    m = elastic_local.load(tmp_path)
    prompt = torch.randint(0, 96, (1,), generator=torch.Generator().manual_seed(11))
    with monkeypatch.context() as p:
        p.setattr(step, "build", lambda net, b: None)
        want_logits, want = greedy(m.net, m.net.resident, prompt, 600)
    got = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            m.net.c_steps.clear()
            got[threads] = greedy(m.net, m.net.resident, prompt, 600)
            assert isinstance(m.net.c_steps[m.net.resident], step.DecodeStep)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[1][1], want)
    torch.testing.assert_close(got[1][0], want_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[1][0], got[2][0]) and torch.equal(got[1][0], got[3][0])


@pytest.mark.parametrize("groups", [2, 4])
def test_a_run_ahead_on_several_threads_leaves_one_threads_states_in_the_cache(tmp_path, groups):
    """A call long enough for step.c's own pages (own_states_tokens, and 8 more) on 2 and 3 threads, each
    thread with whole Mamba groups (2 groups on 2; 4 on 2 and on 3: two, one, one) and their states on
    pages of its own for the call (own_states_in): the same tokens as one thread, and the cache's
    convolution and SSM states after it the same to the bit. Without the copy back, either of them, it
    fails."""
    make_checkpoint(tmp_path, seed=8, **dict(ALIGNED, n_groups=groups, ssm_state_size=12))
    m = elastic_local.load(tmp_path)
    prompt = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(9))
    n = gemv.library().own_states_tokens() + 8
    runs = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            cache = m.net.new_cache()
            with torch.inference_mode():
                m.net.forward(prompt, cache=cache)
                tokens = m.net.decode_ahead(5, cache, n, [])
            states = [t.clone() for s in cache.layers if isinstance(s, MambaState) for t in (s.conv, s.ssm)]
            runs[threads] = tokens, states
    finally:
        torch.set_num_threads(before)
    assert len(runs[1][0]) == n and runs[1][1]
    for threads in (2, 3):
        assert runs[threads][0] == runs[1][0]
        assert all(torch.equal(a, b) for a, b in zip(runs[threads][1], runs[1][1], strict=True)), threads


def test_a_step_gives_the_same_bits_on_any_thread_count(nested_tails):
    """Every budget's C step on 1, 2, 3, 5 and 8 threads (more than some products have panels), and on one
    more than the cores (step.c's barrier then yields the core instead of spinning): the same logits to the
    bit. The products cut at whole panels, the attention in runs of positions, and the Mamba convolution's
    silu vectorized to the last channel, so no value's arithmetic depends on which thread computes it (a
    state size of 12 leaves 4-channel tails, which threads split differently)."""
    m = elastic_local.load(nested_tails)
    prompt = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(12))
    before = torch.get_num_threads()
    try:
        for name in m.budgets:
            runs = []
            for threads in (1, 2, 3, 5, 8, (os.cpu_count() or 1) + 1):
                torch.set_num_threads(threads)
                runs.append(greedy(m.net, m.budget(name), prompt, 30)[0])
            assert all(torch.equal(runs[0], r) for r in runs[1:]), name
    finally:
        torch.set_num_threads(before)


def test_the_threads_shares_of_the_products_change_no_bit(nested_tails):
    """A step shares its products among the threads by the shares it learned (step.c's rebalance): started
    from the most lopsided shares it allows, and moving back toward equal ones call by call, every step's
    logits are those of equal shares to the bit; each call leaves shares that sum to 1."""
    m = elastic_local.load(nested_tails)
    prompt = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(14))
    before = torch.get_num_threads()
    try:
        for threads, lopsided in ((2, [0.25, 0.75]), (3, [2 / 3, 1 / 6, 1 / 6])):
            torch.set_num_threads(threads)
            for name in m.budgets:
                m.net.c_steps.clear()
                want = greedy(m.net, m.budget(name), prompt, 24)[0]
                m.net.c_steps.clear()
                m.net.c_steps[m.budget(name)] = c = step.build(m.net, m.budget(name))
                balance = c.balance(threads)
                balance[0], balance[1:1 + threads] = threads, lopsided
                got = greedy(m.net, m.budget(name), prompt, 24)[0]
                assert torch.equal(got, want), (threads, name)
                assert len(c.shares) == threads and sum(c.shares) == pytest.approx(1.0)
    finally:
        torch.set_num_threads(before)


def test_each_thread_owns_the_outputs_its_share_says_at_whole_panels():
    """own(): thread t of a team computes the outputs between its cumulative shares of the product's weights,
    cut at panel edges; the threads' parts tile the product; shares kept for another team count are equal
    ones. (The bit test above holds whatever own() does with the shares; this pins that it follows them.)"""
    from elastic_local.model.linear import Panels

    lib = gemv.library()
    w = step.weight(Panels.of(torch.randn(256, 64)))  # 11 panels of 24 outputs, the last one 16 short

    def parts(shares, team=None):
        team = team or len(shares)
        balance = (ctypes.c_double * 65)(*([float(len(shares))] + list(shares)) if shares else [])
        out = []
        for t in range(team):
            n = (ctypes.c_int64 * 2)()
            lib.owned(balance, team, t, ctypes.byref(w), n)
            out.append((n[0], n[1]))
        return out

    for shares, team in (([], 2), ([0.25, 0.75], 2), ([0.7, 0.3], 2), ([2 / 3, 1 / 6, 1 / 6], 3), ([0.5, 0.5], 3)):
        got = parts(shares, team)
        assert got[0][0] == 0 and got[-1][1] == 256 and all(a[1] == b[0] for a, b in zip(got, got[1:]))
        assert all(n % 24 == 0 for _, n in got[:-1])  # whole panels
        kept = shares if len(shares) == team else [1 / team] * team  # another team's shares: equal ones
        want = [sum(kept[:t + 1]) * 256 for t in range(team - 1)]
        assert all(abs(n1 - x) <= 12 for (_, n1), x in zip(got, want)), (shares, got)
    assert parts([0.25, 0.75])[0] != parts([0.7, 0.3])[0]


def test_no_thread_passes_a_meeting_before_every_thread_has_reached_it():
    """step.c's own barrier (`meet`) on one thread, two, and more than the cores (the path that yields the
    core): after each round every thread finds every other one's mark of that round (meet_check; a `meet`
    that returned at once broke 6000 of 6000 checks on 3 threads). meet_time, bench_budgets' probe of what a
    meeting costs, runs the same rounds and returns."""
    lib = gemv.library()
    for threads in (1, 2, os.cpu_count() + 1):
        assert lib.meet_check(3000 if threads <= os.cpu_count() else 300, threads) == 0
        ns = ctypes.c_double(-1.0)
        assert lib.meet_time(2000, threads, ctypes.byref(ns)) == 0
        assert math.isfinite(ns.value) and ns.value >= 0.0


def test_shares_move_toward_the_threads_speeds_within_bounds():
    """rebalance: a quarter of the way from the shares toward each thread's speed (weights a cycle) a call,
    no share below 1 / 2T; equal speeds keep equal shares; shares learned for another thread count start
    from equal ones; no timing (a thread with no products timed) changes nothing."""
    lib = gemv.library()
    lib.rebalance.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.rebalance.restype = None

    def call(balance, cycles, weights):
        arrays = [(ctypes.c_double * len(v))(*v) for v in (cycles, weights)]
        lib.rebalance(balance, len(cycles), *arrays)
        return list(balance[1:1 + int(balance[0])])

    balance = (ctypes.c_double * 65)()
    assert call(balance, [100.0, 100.0], [50.0, 50.0]) == pytest.approx([0.5, 0.5])
    shares = [call(balance, [100.0, 200.0], [50.0, 50.0]) for _ in range(40)]  # thread 1 half as fast
    assert shares[0] == pytest.approx([0.5 + 0.25 / 6, 0.5 - 0.25 / 6])
    assert shares[-1] == pytest.approx([2 / 3, 1 / 3], abs=1e-3)
    for _ in range(40):
        last = call(balance, [100.0, 1e6], [50.0, 50.0])  # thread 1 all but stopped: the bound holds
    assert last == pytest.approx([0.75, 0.25], abs=1e-5)
    assert call(balance, [100.0, 0.0], [50.0, 0.0]) == last  # nothing timed on thread 1
    assert call(balance, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]) == pytest.approx([1 / 3] * 3)  # three threads now
    for _ in range(60):
        last = call(balance, [1.0, 1e6, 1e6], [1.0, 1.0, 1.0])  # two stalled: the floor for both
    assert last == pytest.approx([2 / 3, 1 / 6, 1 / 6], abs=1e-6) and sum(last) == pytest.approx(1.0)


@pytest.mark.parametrize("conv_kernel", [3, 4])
def test_the_convolution_s_vector_and_scalar_channels_decode_like_transformers_and_the_torch_path(
        tmp_path, conv_kernel, threads, monkeypatch):
    """step.c convolves a 4-tap kernel 8 channels at a time and any other channel, or kernel size, one by
    one. Heads of 12 channels, one group of 12 state channels: on 1 thread (a group a thread) each head's x
    is 8 + 4, B and C likewise. A budget of 3 of the 4 heads reads x's kernels and B, C's from two places
    (its x channels end at 36, B's kernels start at 48); on 3 threads (fewer groups than threads: the 60
    channels are cut at 16s) the second thread's first 8 channels, 32 to 40, cross from one to the other,
    which takes the one-by-one path. A kernel of 3 runs one by one throughout."""
    hf = make_checkpoint(tmp_path, seed=13, **dict(ALIGNED, conv_kernel=conv_kernel, n_groups=1, mamba_num_heads=4,
                                                    mamba_head_dim=12, ssm_state_size=12))
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(14))
    m = elastic_local.load(tmp_path)
    cache = m.new_cache()
    with torch.inference_mode():
        out = [m.forward(ids[:, :2], cache)] + [m.forward(ids[:, t:t + 1], cache) for t in range(2, 12)]
    assert isinstance(m.net.c_steps[m.budget()], step.DecodeStep)
    torch.testing.assert_close(torch.cat(out, dim=1), hf_logits(hf, ids), atol=1e-4, rtol=0)

    full = m.net.resident
    three = Budget("three", full.hidden, tuple(replace(s, mamba_heads=3) if s.kind == "M" else s for s in full.layers))
    with monkeypatch.context() as p:
        p.setattr(step, "build", lambda net, b: None)
        want_logits, want = greedy(m.net, three, ids[0, :2], 10)
    m.net.c_steps.clear()
    got_logits, got = greedy(m.net, three, ids[0, :2], 10)
    assert isinstance(m.net.c_steps[three], step.DecodeStep)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["all_kinds", "one_chunk_mha"])
def test_greedy_tokens_in_one_call_are_transformers_argmax_and_each_steps(tmp_path, name, threads):
    """`decode_ahead` (many tokens in one C call, the engine's run ahead) against transformers' logits of
    the whole sequence it wrote, and token for token against a decode_token step each."""
    hf = make_checkpoint(tmp_path, seed=4, **CONFIGS[name])
    net = elastic_local.load(tmp_path).net
    prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        caches = [net.new_cache(capacity=8), net.new_cache(capacity=8)]  # the K / V caches grow on the way
        first = [int(net.forward(prompt, cache=c, last_only=True)[0, -1].argmax()) for c in caches][0]
        got = net.decode_ahead(first, caches[0], 70, ())
        want, tok = [], first
        for _ in range(70):
            tok = int(net.decode_token(tok, caches[1]).argmax())
            want.append(tok)
    assert got == want and caches[0].lengths == caches[1].lengths == [6 + 70]
    ids = torch.cat([prompt, torch.tensor([[first] + got])], dim=1)
    top = hf_logits(hf, ids)[0, 5:-1].topk(2)
    clear = (top.values[:, 0] - top.values[:, 1]) > 1e-4  # near-ties may round either way
    assert clear.sum() >= 60
    assert torch.equal(top.indices[clear, 0], ids[0, 6:][clear])


def test_greedy_stops_at_a_stop_token_and_at_a_halt(nested_tails):
    net = elastic_local.load(nested_tails).net
    with torch.inference_mode():
        cache = net.new_cache()
        net.forward(torch.tensor([[1, 2, 3]]), cache=cache)
        free = net.decode_ahead(4, cache, 30, ())
        stop = free[12]
        cache = net.new_cache()
        net.forward(torch.tensor([[1, 2, 3]]), cache=cache)
        got = net.decode_ahead(4, cache, 30, (95, stop))
        assert got == free[: free.index(stop) + 1] and cache.lengths == [3 + len(got)]
        halt = torch.ones(1, dtype=torch.int32)  # set by a switch or cancel from another thread
        assert net.decode_ahead(got[-1], cache, 30, (), halt) == [free[len(got)]]
        assert cache.lengths == [4 + len(got)]


def test_greedy_takes_the_first_largest_logit_and_a_nan_as_numpy_does(tmp_path):
    """The engine samples greedily with numpy's argmax (the first maximum, a NaN counted largest); a run
    ahead in C must pick the same token."""
    from elastic_local.engine.sampling import Sampling, sample

    hf = make_checkpoint(tmp_path, seed=5)
    ids = torch.tensor([[1, 2, 3, 5]])
    head = hf.lm_head.weight.data
    best = head[int(hf_logits(hf, ids)[0, -1].argmax())].clone()
    head[17] = head[20] = head[30] = 2 * best  # tied for the largest logit after `ids`: token 17 first
    for nan, expect in ((None, [17]), (41, [41] * 4)):
        if nan is not None:
            head[nan] = float("nan")  # every logit of token 41 NaN
        hf.save_pretrained(tmp_path)
        net = elastic_local.load(tmp_path).net
        with torch.inference_mode():
            caches = [net.new_cache(), net.new_cache()]
            for c in caches:
                net.forward(ids[:, :3], cache=c)
            assert sample(net.decode_token(5, caches[0]), Sampling()) == expect[:1]
            assert net.decode_ahead(5, caches[1], len(expect), ()) == expect


def test_w4a4_decodes_what_torch_gives_on_inputs_rounded_to_nvfp4(nested_tails, monkeypatch):
    """activations='nvfp4': the C step's integer products against torch's own path with the kernels off
    (each input row rounded by quant/nvfp4.py round_to_nvfp4, the weights dequantized), and unlike the
    exact NVFP4 model's logits."""
    from elastic_local.engine.load import LAYOUT_ENV

    m = elastic_local.load(nested_tails, precision="nvfp4", activations="nvfp4")
    exact = elastic_local.load(nested_tails, precision="nvfp4")
    monkeypatch.setenv(LAYOUT_ENV, "rows")
    reference = elastic_local.load(nested_tails, precision="nvfp4", activations="nvfp4")
    prompt = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(3))
    kernels = gemv.library()
    for name in m.budgets:
        got_logits, got = greedy(m.net, m.budget(name), prompt, 8)
        assert isinstance(m.net.c_steps[m.budget(name)], step.DecodeStep)
        exact_logits, _ = greedy(exact.net, exact.budget(name), prompt, 8)
        monkeypatch.setattr(gemv, "_library", None)  # torch's path throughout
        want_logits, want = greedy(reference.net, reference.budget(name), prompt, 8)
        monkeypatch.setattr(gemv, "_library", kernels)
        assert torch.equal(got, want), name
        torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
        assert (got_logits - exact_logits).abs().max() > 1e-3, "the inputs were not rounded"


def test_w4a4_reaches_every_nvfp4_weight_and_its_cached_budget_views(nested_tails):
    """load's round_nvfp4_inputs walks the network (NemotronH.objects) into the weights' cached views too: a
    view cut before it would otherwise keep multiplying unrounded inputs."""
    from elastic_local.engine.load import round_nvfp4_inputs
    from elastic_local.quant.nvfp4 import NVFP4Weight

    m = elastic_local.load(nested_tails, precision="nvfp4")
    weights = [w for w in m.net.objects() if isinstance(w, NVFP4Weight)]
    views = [w.block(0, w.shape[0] // 2, 16) for w in weights]  # cached in each weight's _views
    assert weights and not any(w.quantize_inputs for w in weights + views)
    round_nvfp4_inputs(m.net, nested_tails)
    assert all(w.quantize_inputs for w in weights + views)


def test_w4a4_needs_nvfp4_weights_and_names_the_option(nested_tails):
    with pytest.raises(ValueError, match="--precision nvfp4"):
        elastic_local.load(nested_tails, activations="nvfp4")
    with pytest.raises(ValueError, match="'float' or 'nvfp4'"):
        elastic_local.load(nested_tails, precision="nvfp4", activations="fp8")
