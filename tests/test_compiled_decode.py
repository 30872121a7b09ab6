"""The compiled decode step (`load(..., compile=True)`): the same logits and tokens as the eager network, for
every budget, rows at different positions, and a cache that grows while decoding."""

import pytest
import torch
from tiny import hf_logits

import elastic_local
from elastic_local.model.nemotron_h import HybridCache

pytestmark = pytest.mark.usefixtures("no_c_step")


def decode(net, budget, prompts: list[torch.Tensor], steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Greedy steps for rows whose prompts differ in length (one batch of caches at different positions)."""
    caches, last = [], []
    for p in prompts:
        c = net.new_cache(1, budget=budget)
        last.append(net.forward(p[None], cache=c, last_only=True)[:, -1])
        caches.append(c)
    cache = HybridCache.stack(caches)
    tok = torch.cat(last).argmax(-1, keepdim=True)
    logits, toks = [], [tok]
    for _ in range(steps):
        out = net.forward(tok, cache=cache)[:, -1]
        logits.append(out)
        tok = out.argmax(-1, keepdim=True)
        toks.append(tok)
    return logits, torch.cat(toks, 1)


def decodes_like(model, eager, seed: int, device: str = "cpu", tol: float = 1e-4) -> None:
    """`model` decodes as `eager` does, token for token and logits within `tol`, on every budget, for two rows
    of 60 and 45 prompt tokens: 8 steps cross the KV cache's first capacity (64), so it regrows mid-decode.
    Every step's logits are kept until the end (a step's output must not be overwritten by the next)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 96, (n,), generator=g).to(device) for n in (60, 45)]
    with torch.inference_mode():
        for name in eager.budgets:
            want_logits, want = decode(eager.net, eager.budget(name), prompts, 8)
            got_logits, got = decode(model.net, model.budget(name), prompts, 8)
            assert torch.equal(got, want), name
            for a, b in zip(got_logits, want_logits):
                torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_compiled_decode_equals_eager_for_every_budget_and_across_cache_growth(nested):
    eager = elastic_local.load(nested, dtype=torch.float32)
    compiled = elastic_local.load(nested, dtype=torch.float32, compile=True)
    decodes_like(compiled, eager, seed=3)
    assert set(compiled.net.compiled) == {compiled.budget(n) for n in compiled.budgets}  # one graph per budget
    assert None not in compiled.net.compiled.values()  # each compiled, as one graph (none fell back to eager)


def test_compiled_decode_matches_transformers_on_the_full_budget(nested):
    m = elastic_local.load(nested, dtype=torch.float32, compile=True)
    from transformers import NemotronHForCausalLM

    hf = NemotronHForCausalLM.from_pretrained(nested, dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        cache = m.net.new_cache(1)
        m.net.forward(ids[:, :-1], cache=cache)
        step = m.net.forward(ids[:, -1:], cache=cache)[:, -1]
    torch.testing.assert_close(step, hf_logits(hf, ids)[:, -1], atol=1e-4, rtol=0)


def test_a_budget_whose_step_fails_to_compile_runs_eagerly_with_a_warning(nested, monkeypatch, caplog):
    import torch._dynamo.exc

    eager = elastic_local.load(nested, dtype=torch.float32)
    m = elastic_local.load(nested, dtype=torch.float32, compile=True)

    def no_compiler(fn, **options):
        def step(*args, **kwargs):
            raise torch._dynamo.exc.TorchDynamoException("InvalidCxxCompiler: No working C++ compiler found")
        return step

    monkeypatch.setattr(torch, "compile", no_compiler)
    prompts = [torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(5))]
    with torch.inference_mode(), caplog.at_level("WARNING"):
        _, got = decode(m.net, m.budget("full"), prompts, 4)
        _, want = decode(eager.net, eager.budget("full"), prompts, 4)
    assert torch.equal(got, want) and m.net.compiled[m.budget("full")] is None
    assert "runs eagerly" in caplog.text and "C++ compiler" in caplog.text


def test_a_step_that_fails_to_compile_part_way_does_not_advance_the_cache_twice(nested, monkeypatch, caplog):
    """A step is traced in pieces, each run once traced: when a later piece fails to trace, the earlier ones
    have advanced the Mamba states, and the eager rerun must start from the states as they were. Here the
    routed experts of a two-row step cut the rows by counts the tracer cannot know (the compiled path's
    MoE; eagerly, two rows take the C experts). Without the states put back, logits differ by ~4."""
    from elastic_local.model import moe

    def data_dependent(flat, w, experts, channels, ids, weights, keep):
        counts = torch.bincount(ids.reshape(-1), minlength=experts).tolist()
        routed = torch.cat([flat[:n] for n in counts if n]) * weights.reshape(-1)[:, None]
        return routed[:flat.shape[0]]

    eager = elastic_local.load(nested, dtype=torch.float32)
    m = elastic_local.load(nested, dtype=torch.float32, compile=True)
    monkeypatch.setattr(moe, "_experts_grouped", data_dependent)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (20,), generator=g), torch.randint(0, 96, (15,), generator=g)]
    with torch.inference_mode(), caplog.at_level("WARNING"):
        got_logits, got = decode(m.net, m.budget("full"), prompts, 4)
        want_logits, want = decode(eager.net, eager.budget("full"), prompts, 4)
    assert "runs eagerly" in caplog.text and m.net.compiled[m.budget("full")] is None
    assert torch.equal(got, want)
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_engine_stays_exact_on_the_compiled_step_across_a_live_switch(tmp_path):
    """The generation oracle (tests/test_generate.py) with compiled steps: every sampled token is the argmax
    of its budget run from scratch, eagerly, on the sequence before it, through a switch and a hand-over."""
    from gen_util import assert_argmax, elastic_model, generate_with_a_live_switch

    m = elastic_model(tmp_path, seed=3)
    m.net.compile_decode()
    ids, tokens = generate_with_a_live_switch(m)
    assert assert_argmax(m, ids, tokens) >= len(tokens) - 2
    assert set(m.net.compiled) == {m.budget("full"), m.budget("small")}  # both budgets ran compiled
