"""The C decode step of a bfloat16 network: float32 arithmetic on bf16 weights, embedding, convolution
states and K / V caches (model/step.py). Against transformers in float32 on the same bf16-rounded weights
(the oracle), against the torch path's bf16 ops, and its rounding against torch's."""

import pytest
import torch
from test_cpu_gemv import X86
from test_model_vs_transformers import CONFIGS
from tiny import hf_logits, make_checkpoint

import elastic_local
from elastic_local.model import NemotronH, gemv, step
from elastic_local.model.linear import Panels

pytestmark = pytest.mark.skipif(not X86, reason="the C decode step is x86 AVX2 only; elsewhere torch's layers run")

# what a bfloat16 load keeps in float32 (the router, and Mamba's dt_bias, A_log and D); the oracle rounds
# every other parameter to bf16, as the load does
FLOAT32 = ("A_log", ".D", "dt_bias", "gate.weight", "e_score_correction_bias")


def bf16_oracle(hf):
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not name.endswith(FLOAT32):
                p.copy_(p.to(torch.bfloat16).float())
    return hf


def decode_logits(net, ids: torch.Tensor, prompt: int, in_c: bool, budget=None) -> torch.Tensor:
    """Logits of ids[prompt:] [T - prompt, V], each position one decode step after a prefill of the prompt
    (teacher-forced: every path reads the same tokens); in C, or on the torch layers (grad mode)."""
    cache = net.new_cache(budget=budget)
    with torch.no_grad():
        net.forward(ids[:, :prompt - 1], cache=cache)
    out = []
    with torch.set_grad_enabled(not in_c):
        for t in range(prompt - 1, ids.shape[1]):
            out.append(net.decode_token(int(ids[0, t]), cache).float())
    return torch.cat(out).detach()


@pytest.mark.parametrize("name", sorted(n for n, c in CONFIGS.items() if c.get("n_group", 1) == 1))
def test_a_bfloat16_network_decodes_in_c_nearer_transformers_than_its_torch_ops(tmp_path, name):
    """Measured: mean |error| 1.5-6x smaller than the torch path's bf16 ops; what is left is the bf16
    prompt's (torch's) and the bf16 states'."""
    hf = bf16_oracle(make_checkpoint(tmp_path, seed=2, **CONFIGS[name]))
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    want = hf_logits(hf, ids)[0, 8:]
    m = elastic_local.load(tmp_path, dtype=torch.bfloat16)
    assert m.net.dtype == torch.bfloat16
    in_c = decode_logits(m.net, ids, 9, in_c=True)
    assert isinstance(m.net.c_steps[m.budget()], step.DecodeStep)
    on_torch = decode_logits(m.net, ids, 9, in_c=False)
    err_c, err_torch = (in_c - want).abs(), (on_torch - want).abs()
    assert err_c.mean() < err_torch.mean()
    assert err_c.max() < 0.05 * want.abs().max()


def rounded_to_bf16(net: NemotronH) -> NemotronH:
    """A float32 network with what a bfloat16 load keeps in bf16 rounded to bf16 in place: the float32
    reference of that load's values (quantized weights are the same bytes in both)."""
    kept = {"gate", "bias", "dt_bias", "A", "D"}  # FLOAT32's
    tensors = [net.embed, net.lm_head, net.norm_f]
    for layer in net.layers:
        tensors += [layer.norm, *(w for name, w in vars(layer.mixer).items() if name not in kept)]
    with torch.no_grad():
        for t in tensors:
            t = t.p if isinstance(t, Panels) else t
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                t.copy_(t.bfloat16())
    net.c_steps.clear()
    return net


@pytest.mark.parametrize("precision", [None, "fp8", "nvfp4"])
def test_every_budget_of_a_bfloat16_network_decodes_in_c_nearer_float32_than_its_torch_ops(nested_tails, precision,
                                                                                          threads):
    """70 steps (the KV cache regrows past 64 inside the C step), every budget and precision, against the
    float32 load of the same values (its C step is transformers' to 1e-4, test_decode_step.py)."""
    m = elastic_local.load(nested_tails, precision=precision, dtype=torch.bfloat16)
    ref = rounded_to_bf16(elastic_local.load(nested_tails, precision=precision).net)
    ids = torch.randint(0, 96, (1, 80), generator=torch.Generator().manual_seed(5))
    copies = 0
    for b in (m.budget(name) for name in m.budgets):
        want = decode_logits(ref, ids, 10, in_c=True, budget=b)
        in_c = decode_logits(m.net, ids, 10, in_c=True, budget=b)
        assert isinstance(m.net.c_steps[b], step.DecodeStep), b.name
        on_torch = decode_logits(m.net, ids, 10, in_c=False, budget=b)
        # the median over positions: where the bf16 rounding tips a near-tie of the router, one position's
        # logits jump and the states carry it for a dozen tokens, on either path (measured: 0.79 at one position
        # of 71, against 0.002-0.004 at the others)
        err_c, err_torch = ((x - want).abs().mean(-1).median() for x in (in_c, on_torch))
        assert err_c < err_torch, (precision, b.name, err_c, err_torch)
        copies = copies or len(m.net.c_floats)
        assert len(m.net.c_floats) == copies > 0  # the float32 norms and convolution: one copy for every budget


def test_a_bfloat16_load_keeps_its_linear_weights_in_bf16_panels_for_prompts_and_steps(nested_tails):
    """Panels against the [out, in] rows (`ELASTIC_LOCAL_CPU_LAYOUT=rows`): a prompt widened to float32 on
    the panels against torch's bf16 matmul on the rows, and the C step on each (the same float32 sums but
    for their order)."""
    def in_proj(m):
        return next(layer for layer in m.net.layers if hasattr(layer.mixer, "in_proj")).mixer.in_proj

    m = elastic_local.load(nested_tails, dtype=torch.bfloat16)
    assert isinstance(in_proj(m), Panels) and in_proj(m).dtype == torch.bfloat16
    with pytest.MonkeyPatch.context() as p:
        p.setenv("ELASTIC_LOCAL_CPU_LAYOUT", "rows")
        rows = elastic_local.load(nested_tails, dtype=torch.bfloat16)
    assert isinstance(in_proj(rows), torch.Tensor) and in_proj(rows).dtype == torch.bfloat16
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = m.logits(ids), rows.logits(ids)
    torch.testing.assert_close(got, want, atol=0.03 * float(want.abs().max()), rtol=0)
    for b in (m.budget(name) for name in m.budgets):
        got, want = decode_logits(m.net, ids, 20, True, b), decode_logits(rows.net, ids, 20, True, b)
        assert isinstance(rows.net.c_steps[b], step.DecodeStep)
        torch.testing.assert_close(got, want, atol=1e-3 * float(want.abs().max()), rtol=0)  # measured 1.4e-5


def test_rounding_to_bf16_is_torchs_to_nearest_even():
    lib = gemv.library()
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF, 0x7F7FFFFF, 0x7F800000, 0xFF800000,
                         0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x00000001, 0x00008000, 0x80018000, 0],
                        dtype=torch.int64).to(torch.int32)  # ties to even both ways, overflow, infinities,
    special = bits.view(torch.float32)                       # NaNs of every payload, subnormals, -0
    x = torch.cat([special, torch.randn(1000) * torch.logspace(-40, 38, 1000)])
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    lib.to_bf16(x.data_ptr(), out.data_ptr(), x.numel())
    want = x.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_a_bfloat16_network_gives_the_same_bits_on_one_thread_and_two(nested_tails):
    """On two threads each takes one of the two Mamba groups, and for a call of own_states_tokens or more
    keeps its groups' states (bf16 convolution, float32 SSM) on pages of its own (step.c's own_states_in),
    written back at the end: one-token steps and a run ahead of 40 tokens give one thread's logits and
    tokens to the bit; after one call of that many tokens the cache holds one thread's states, and the
    torch layers continue from them alike."""
    m = elastic_local.load(nested_tails, dtype=torch.bfloat16)
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(6))
    prompt = ids[0, :9].tolist()
    n = gemv.library().own_states_tokens()
    runs = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            steps = decode_logits(m.net, ids, 9, in_c=True)
            ahead = m.generate(prompt, max_answer_tokens=40, ignore_eos=True).answer_ids
            cache = m.net.new_cache()
            with torch.no_grad():
                m.net.forward(ids[:, :8], cache=cache)
                m.net.decode_ahead(int(ids[0, 8]), cache, n, [])
            states = [t.clone() for s in cache.layers if hasattr(s, "ssm") for t in (s.conv, s.ssm)]
            with torch.set_grad_enabled(True):  # the torch layers, from the C step's states
                after = m.net.decode_token(5, cache).float().detach()
            runs[threads] = steps, ahead, after, states
    finally:
        torch.set_num_threads(before)
    assert isinstance(m.net.c_steps[m.net.resident], step.DecodeStep)
    assert torch.equal(runs[1][0], runs[2][0])
    assert runs[1][1] == runs[2][1] and len(runs[1][1]) == 40
    assert torch.equal(runs[1][2], runs[2][2])
    assert all(torch.equal(a, b) for a, b in zip(runs[1][3], runs[2][3], strict=True)) and runs[1][3]
