"""Decode steps replayed from CUDA graphs (`NemotronH.capture_decode`, model/graphs.py).

The CPU cannot record a CUDA graph, so two properties are pinned here separately:
- the recorded step reads nothing back to the host (run on the meta device, where any such read raises);
- the replay machinery (input and output buffers, one graph per budget and cache, states left as they
  were by the recording) gives eager decoding's tokens and logits, with a recorder that replays the
  closure in torch. The GPU test runs the real recorder where there is a GPU."""

import contextlib
import dataclasses

import pytest
import torch
from test_compiled_decode import decode, decodes_like

import elastic_local
from elastic_local.engine.load import LAYOUT_ENV
from elastic_local.model import graphs
from elastic_local.model.linear import ExpertStack, Panels, RowConcat, Transposed
from elastic_local.model.moe import moe
from elastic_local.quant import QuantizedWeight

pytestmark = pytest.mark.usefixtures("no_c_step")


class Recorder:
    """A stand-in for graphs.cuda_record: runs the closure to get its output buffer (as the warm-up does),
    then each replay runs it again into that buffer, reading whatever the input buffers hold by then."""

    def __init__(self):
        self.recorded = 0
        self.replays = 0

    def __call__(self, run):
        self.recorded += 1
        out = run()

        def replay():
            self.replays += 1
            out.copy_(run())

        return replay, out


def to_meta(net) -> None:
    """Every weight of `net` on the meta device: shapes and dtypes only, and any read of a value raises."""
    def meta(w):
        if isinstance(w, Transposed):
            return Transposed(w.t.to("meta"))
        if isinstance(w, Panels):
            return Panels(w.p.to("meta"), w.skip, w.n)
        if isinstance(w, ExpertStack):
            return ExpertStack([meta(e) for e in w])
        if isinstance(w, RowConcat):
            return RowConcat([meta(p) for p in w.parts])
        if isinstance(w, QuantizedWeight):
            return dataclasses.replace(w, **{f.name: getattr(w, f.name).to("meta") for f in dataclasses.fields(w)
                                             if f.init and isinstance(getattr(w, f.name), torch.Tensor)})
        return w.to("meta") if isinstance(w, torch.Tensor) else w

    for layer in net.layers:
        layer.norm = meta(layer.norm)
        if layer.mixer is not None:
            for name, w in vars(layer.mixer).items():
                setattr(layer.mixer, name, meta(w))
    net.embed, net.norm_f, net.lm_head = meta(net.embed), meta(net.norm_f), meta(net.lm_head)


@pytest.mark.parametrize("precision", [None, "fp8", "nvfp4"])
def test_the_recorded_step_reads_nothing_back_to_the_host_on_any_budget(nested, precision):
    m = elastic_local.load(nested, dtype=torch.float32, precision=precision)
    m.net.capture_decode(record=Recorder())  # stacks packed experts
    to_meta(m.net)
    for name in m.budgets:
        b = m.budget(name)
        cache = m.net.new_cache(2, budget=b, capacity=16)
        ids, lengths = torch.zeros(2, 1, dtype=torch.long, device="meta"), torch.zeros(2, dtype=torch.long,
                                                                                       device="meta")
        logits = m.net._layers(ids, cache.layers, b, lengths=lengths, static=True, sync_free=True)
        assert logits.shape == (2, 1, m.net.cfg.vocab_size)
        with pytest.raises((RuntimeError, NotImplementedError)):  # the probe catches what it should: the
            m.net._layers(ids, cache.layers, b, lengths=lengths, static=True)  # MoE's ids read as Python ints


@pytest.mark.parametrize("layout", ["transposed", "rows"])
@pytest.mark.parametrize("rows", [1, 3])
def test_gathered_experts_equal_the_per_expert_ones_on_every_budget(nested, rows, layout, monkeypatch):
    monkeypatch.setenv(LAYOUT_ENV, layout)
    m = elastic_local.load(nested, dtype=torch.float32)
    for name in m.budgets:
        b = m.budget(name)
        for i, (layer, s) in enumerate(zip(m.net.layers, b.layers)):
            if s.kind != "E" or not s.enabled:
                continue
            assert isinstance(layer.mixer.up, Panels) == (layout == "transposed")
            x = torch.randn(rows, 1, b.hidden, generator=torch.Generator().manual_seed(i))
            args = (x, layer.mixer, s.experts, s.expert_channels, s.shared_channels, m.net.cfg)
            torch.testing.assert_close(moe(*args, sync_free=True), moe(*args), atol=1e-5, rtol=1e-5)


def test_replayed_decode_equals_eager_for_every_budget_rows_and_cache_growth(nested):
    eager = elastic_local.load(nested, dtype=torch.float32)
    replayed = elastic_local.load(nested, dtype=torch.float32)
    rec = Recorder()
    replayed.net.capture_decode(record=rec)
    decodes_like(replayed, eager, seed=5)  # the cache regrows mid-decode: a new graph
    budgets = len(eager.budgets)
    # per budget, of 8 steps: the stacked cache's first runs eagerly, its second records; the KV cache
    # regrows at the fifth (64 tokens), which runs eagerly, and the sixth records again
    assert rec.recorded == 2 * budgets
    assert rec.replays == 6 * budgets
    assert None not in replayed.net.graphs.values()


def test_a_new_cache_records_a_new_graph_and_one_sequence_continues_across_turns(nested):
    eager = elastic_local.load(nested, dtype=torch.float32)
    replayed = elastic_local.load(nested, dtype=torch.float32)
    rec = Recorder()
    replayed.net.capture_decode(record=rec)
    prompt = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        for _ in range(2):  # two conversations: the second cache has other tensors
            outs = []
            for m in (eager, replayed):
                cache = m.net.new_cache(1, capacity=32)
                tok = m.net.forward(prompt, cache=cache)[:, -1:].argmax(-1)
                toks = [tok]
                for _ in range(6):
                    tok = m.net.forward(tok, cache=cache)[:, -1:].argmax(-1)
                    toks.append(tok)
                outs.append(torch.cat(toks, 1))
            assert torch.equal(*outs)
    assert rec.recorded == 2


def test_a_sub_batch_taken_for_one_step_is_never_recorded(nested):
    """The engine decodes a subset of its rows through a copy of theirs (engine/caches.take_rows), a new
    cache every step: recording each would cost two steps a step."""
    from elastic_local.engine.caches import put_rows, take_rows

    eager = elastic_local.load(nested, dtype=torch.float32)
    m = elastic_local.load(nested, dtype=torch.float32)
    rec = Recorder()
    m.net.capture_decode(record=rec)
    prompt = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(9))
    outs = []
    with torch.inference_mode():
        for model in (eager, m):
            cache = model.net.new_cache(2, capacity=32)
            tok = model.net.forward(prompt, cache=cache)[:, -1:].argmax(-1)
            toks = []
            for _ in range(4):  # row 1 alone decodes
                sub = take_rows(cache, [1])
                tok = model.net.forward(tok[1:], cache=sub)[:, -1:].argmax(-1)
                put_rows(cache, [1], sub)
                toks.append(tok)
                tok = torch.cat([tok, tok])
            outs.append(torch.cat(toks, 1))
    assert torch.equal(*outs)
    assert rec.recorded == 0


def test_a_step_that_fails_to_record_runs_eagerly_with_the_states_as_they_were(nested, caplog):
    eager = elastic_local.load(nested, dtype=torch.float32)
    m = elastic_local.load(nested, dtype=torch.float32)

    def refuse(run):
        run()  # the warm-up ran (and advanced the Mamba states) before the capture failed
        raise RuntimeError("operation not permitted when stream is capturing")

    m.net.capture_decode(record=refuse)
    prompts = [torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(7))]
    with torch.inference_mode():
        want_logits, want = decode(eager.net, eager.budget("half"), prompts, 4)
        got_logits, got = decode(m.net, m.budget("half"), prompts, 4)
    assert torch.equal(got, want)
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert m.net.graphs == {m.budget("half"): None}
    assert "runs eagerly" in caplog.text


def test_graphs_record_and_replay_on_the_gpu_their_tensors_live_on(nested, monkeypatch):
    """A capture records the current device's stream only: a model on cuda:1 recorded while cuda:0 is
    current would replay an empty graph (stale logits, silently). Recording and replay make the tensors'
    device current (graphs.on)."""
    picked = graphs.on(torch.device("cuda", 1))
    assert isinstance(picked, torch.cuda.device) and picked.idx == 1
    seen = []
    monkeypatch.setattr(graphs, "on", lambda device: seen.append(device) or contextlib.nullcontext())
    m = elastic_local.load(nested, dtype=torch.float32)
    rec = Recorder()
    m.net.capture_decode(record=rec)
    prompts = [torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(3))]
    with torch.inference_mode():
        decode(m.net, m.budget("full"), prompts, 4)
    assert rec.recorded == 1 and len(seen) == 1 + rec.replays and set(seen) == {torch.device("cpu")}


def test_cuda_graphs_refuse_a_model_on_the_cpu_before_reading_weights(nested):
    m = elastic_local.load(nested, dtype=torch.float32)
    with pytest.raises(ValueError, match="CUDA graphs record GPU kernels.*--device cuda"):
        m.net.capture_decode()
    with pytest.raises(ValueError, match="the device is cpu.*--device cuda"):
        elastic_local.load(nested / "missing", cuda_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the device check runs it)")
def test_cuda_graph_decode_equals_eager_on_a_gpu(nested):
    eager = elastic_local.load(nested, device="cuda", dtype=torch.float32, cuda_graphs=False)
    replayed = elastic_local.load(nested, device="cuda", dtype=torch.float32, cuda_graphs=True)
    assert replayed.net.graphs == {}
    decodes_like(replayed, eager, seed=8, device="cuda", tol=1e-3)
    assert None not in replayed.net.graphs.values()
    assert isinstance(next(iter(replayed.net.graphs.values())), graphs.StepGraph)


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_packed_experts_are_stacked_in_place_and_each_still_dequantizes_as_before(nested, precision):
    m = elastic_local.load(nested, dtype=torch.float32, precision=precision)
    layer = next(layer for layer in m.net.layers if layer.kind == "E")
    before = [w.dequantize(torch.float32) for w in layer.mixer.up]
    weight_bytes = sum(t.nbytes for t in m.net.tensors())
    m.net.capture_decode(record=Recorder())
    stack = layer.mixer.up
    assert isinstance(stack, ExpertStack) and isinstance(layer.mixer.down, ExpertStack)
    assert sum(t.nbytes for t in m.net.tensors()) == weight_bytes  # the stack replaced them: no copy stays
    base = stack.stacked["weight"]
    for e, w in enumerate(stack):
        assert w.weight.data_ptr() == base[e].data_ptr()  # a view of the stack
        assert torch.equal(w.dequantize(torch.float32), before[e])
    pick = torch.tensor([3, 0, 3])
    for rows, cols in ((stack[0].shape[0], stack[0].shape[1]), (16, 32)):
        want = torch.stack([before[e][:rows, :cols] for e in pick.tolist()])
        assert torch.equal(stack.dequantize(pick, rows, cols, torch.float32), want)


def test_experts_in_mixed_formats_keep_the_eager_step_with_a_warning(nested, caplog):
    m = elastic_local.load(nested, dtype=torch.float32, precision="fp8")
    layer = next(layer for layer in m.net.layers if layer.kind == "E")
    layer.mixer.up[1] = layer.mixer.up[1].dequantize(torch.float32)  # as a `keep` pattern matching one would
    m.net.capture_decode(record=Recorder())
    assert m.net.graphs is None
    # a CPU load keeps FP8 codes in column panels (quant.fp8.FP8Panels)
    assert "expert 1 is a Tensor unlike expert 0's FP8Panels" in caplog.text and "runs eagerly" in caplog.text


@pytest.mark.parametrize("precision", ["fp8", "nvfp4", "nvfp4-a4"])
@pytest.mark.parametrize("rows", [1, 3])
def test_gathered_packed_experts_equal_the_per_expert_ones_on_every_budget(nested, rows, precision):
    """nvfp4-a4: the gathered experts round their inputs as each expert's own product does (W4A4)."""
    m = elastic_local.load(nested, dtype=torch.float32, precision=precision.removesuffix("-a4"),
                           activations="nvfp4" if precision.endswith("-a4") else "float")
    m.net.capture_decode(record=Recorder())
    for name in m.budgets:
        b = m.budget(name)
        for i, (layer, s) in enumerate(zip(m.net.layers, b.layers)):
            if s.kind != "E" or not s.enabled:
                continue
            x = torch.randn(rows, 1, b.hidden, generator=torch.Generator().manual_seed(i))
            args = (x, layer.mixer, s.experts, s.expert_channels, s.shared_channels, m.net.cfg)
            torch.testing.assert_close(moe(*args, sync_free=True), moe(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_replayed_decode_equals_eager_with_packed_weights(nested, precision):
    eager = elastic_local.load(nested, dtype=torch.float32, precision=precision)
    replayed = elastic_local.load(nested, dtype=torch.float32, precision=precision)
    rec = Recorder()
    replayed.net.capture_decode(record=rec)
    decodes_like(replayed, eager, seed=6)
    assert rec.recorded == 2 * len(eager.budgets) and None not in replayed.net.graphs.values()


def test_the_compiled_step_keeps_quantized_weights_eager_with_a_warning(nested, caplog):
    m = elastic_local.load(nested, dtype=torch.float32, precision="fp8")
    m.net.compile_decode()
    assert m.net.compiled is None
    assert "compiled decode step covers float weights" in caplog.text


@pytest.mark.parametrize("options, captured", [
    ({}, True),  # the default on a GPU
    ({"cuda_graphs": False}, False),
    ({"compile": True}, False),  # asked for the compiled step: that one runs
    ({"precision": "fp8"}, True),  # packed experts too (stacked)
])
def test_a_model_on_a_gpu_decodes_through_cuda_graphs_by_default(nested, monkeypatch, options, captured):
    from elastic_local.model.nemotron_h import NemotronH

    calls = []
    monkeypatch.setattr(NemotronH, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(NemotronH, "capture_decode", lambda self: calls.append(self))
    elastic_local.load(nested, dtype=torch.float32, **options)
    assert bool(calls) == captured
    monkeypatch.undo()
    assert elastic_local.load(nested, dtype=torch.float32, **options).net.graphs is None  # on the CPU: off


@pytest.mark.parametrize("precision", [None, "fp8"])
def test_the_engine_stays_exact_on_the_graph_step_across_a_live_switch(tmp_path, precision):
    """The generation oracle (tests/test_generate.py) with replayed steps: every sampled token is the argmax
    of its budget run from scratch, eagerly, on the sequence before it, through a switch and a hand-over."""
    from gen_util import assert_argmax, elastic_model, generate_with_a_live_switch

    m = elastic_model(tmp_path, seed=3, precision=precision)
    rec = Recorder()
    m.net.capture_decode(record=rec)
    ids, tokens = generate_with_a_live_switch(m)
    assert assert_argmax(m, ids, tokens) >= len(tokens) - 2
    assert set(m.net.graphs) == {m.budget("full"), m.budget("small")} and rec.replays > 0


@pytest.mark.parametrize("precision", [None, "fp8"])
def test_chat_turns_on_the_graph_step_equal_fresh_eager_runs(tmp_path, precision):
    """A chat reuses its caches across turns (a graph per budget and cache, kept while the cache lives):
    each turn's tokens are those of a fresh eager generation over the same conversation."""
    from gen_util import elastic_model

    options = dict(think_budget="small", answer_budget="full", max_think_tokens=6, max_answer_tokens=5,
                   ignore_eos=True, think_close="ok.")
    eager = elastic_model(tmp_path, seed=5, precision=precision)
    m = elastic_model(tmp_path, seed=5, precision=precision)
    rec = Recorder()
    m.net.capture_decode(record=rec)
    chat = m.chat(system="be brief", **options)
    for text in ("hi there", "what is the answer", "and then?"):
        prompt = chat.prompt(chat.messages + [{"role": "user", "content": text}])[0]
        assert chat.send(text).ids == eager.generate(prompt, **options).ids, text
    assert rec.replays > 0


def test_the_engines_sub_batches_keep_their_rows_out_and_replay_a_graph(tmp_path, monkeypatch):
    """Rows thinking on one budget and answering on another decode as sub-batches of each step. Without a C
    step in place (a GPU, another CPU) each budget's rows are copied out once and stepped there while the
    same rows decode (CacheSet.held), not copied out and back every step, so the graph step records them
    and replays; every row's tokens are the ones it gets alone, eagerly."""
    from gen_util import elastic_model

    from elastic_local.engine import cacheset
    from elastic_local.engine.generate import Generation, Request

    eager = elastic_model(tmp_path, seed=3)
    m = elastic_model(tmp_path, seed=3)
    rec = Recorder()
    m.net.capture_decode(record=rec)
    prompts = [m.chat_prompt("a"), m.chat_prompt("a longer question than that"), m.chat_prompt("no", think=False)]
    request = Request(think_budget="small", answer_budget="full", max_think_tokens=8, max_answer_tokens=10,
                      ignore_eos=True, think_close="ok.")
    taken = []
    monkeypatch.setattr(cacheset, "take_rows", lambda c, rows, _take=cacheset.take_rows: taken.append(rows) or
                        _take(c, rows))
    gen = Generation(m, prompts, request)
    results = gen.collect()
    steps = sum(r.stats.think_tokens + r.stats.answer_tokens for r in results) // len(prompts)
    assert 0 < len(taken) < steps  # copied out when the rows stepping change, not every step
    assert rec.replays > 0
    for p, r in zip(prompts, results):
        assert r.ids == Generation(eager, [p], request).collect()[0].ids
