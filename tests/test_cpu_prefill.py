"""A prefill's C parts on the CPU (step.c, through model/kernels.py and model/moe.py): the Mamba2 causal
convolution and scan, the norms, and the routed experts. A whole network against transformers' forward (the oracle),
and each part against the torch code it replaces (ssd.py's chunked scan and convolution, the recurrence
the decode step runs, moe.py's grouped experts) on shapes that leave every vector tail, on one thread and
on three; and where torch keeps the work (gradients, other kernels)."""

import pytest
import torch
import torch.nn.functional as F
from test_cpu_gemv import X86
from test_model_vs_transformers import CONFIGS
from tiny import ALIGNED, hf_logits, make_checkpoint

import elastic_local
from elastic_local.model import gemv, kernels, moe, ssd

pytestmark = pytest.mark.skipif(not X86, reason="step.c is x86 AVX2 only; elsewhere torch's layers run")


@pytest.fixture(autouse=True)
def library_built():
    assert gemv.library() is not None, "the CPU kernels did not build (see the warning)"


@pytest.fixture
def c_calls(monkeypatch):
    """The names of the C parts a forward ran."""
    seen = []

    def spy(run, name):
        def call(*a, **k):
            out = run(*a, **k)
            if out is not None:
                seen.append(name)
            return out
        return call

    for module, name in ((kernels, "_cpu_conv"), (kernels, "_cpu_scan"), (kernels, "cpu_rms_norm"),
                         (moe, "_experts_cpu")):
        monkeypatch.setattr(module, name, spy(getattr(module, name), name))
    return seen


# head sizes 12 (no whole 8 of rows: the row-wise scan) and 40 (32 + 8 rows), a state size with a tail,
# expert channels with a last column block narrower than 16, a conv width of 3
SHAPES = {
    "p12": dict(mamba_head_dim=12, ssm_state_size=12, moe_intermediate_size=24, conv_kernel=3),
    "p40": dict(mamba_head_dim=40, ssm_state_size=16, moe_intermediate_size=40, hidden_size=48),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_prefill_in_c_gives_transformers_logits(tmp_path, shape, threads, c_calls):
    hf = make_checkpoint(tmp_path, seed=4, **SHAPES[shape])
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(3))
    m = elastic_local.load(tmp_path)
    with torch.inference_mode():
        whole = m.forward(ids)
        cache = m.new_cache(batch_size=2)
        parts = [m.forward(ids[:, :2], cache), m.forward(ids[:, 2:13], cache), m.forward(ids[:, 13:], cache)]
    want = hf_logits(hf, ids)
    torch.testing.assert_close(whole, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat(parts, dim=1), want, atol=1e-4, rtol=0)  # continued from the states
    assert {"_cpu_conv", "_cpu_scan", "cpu_rms_norm", "_experts_cpu"} <= set(c_calls)


@pytest.mark.parametrize("groups, p, width", [(1, 37, 37), (1, 256, 256), (2, 12, 48), (4, 5, 40)])
@pytest.mark.parametrize("gated", [False, True])
def test_the_norms_in_c_are_torch_s_rms_norm(groups, p, width, gated, threads):
    """Plain RMSNorm and Mamba2's group norm (rank-major: group g holds channels (q G + g) p ..), gated by
    silu of a strided z as in_proj's split leaves it, with vector tails (37, 5, 12 channels a run), against
    the torch formulas they replace."""
    x, w, eps = torch.randn(2, 9, width), torch.randn(width), 1e-5
    z = torch.randn(2, 9, width + 7)[..., 3:3 + width] if gated else None
    h = x * F.silu(z) if gated else x
    v = h.view(2, 9, -1, groups, p)  # [.., r, G, p]
    want = w * (v * torch.rsqrt(v.pow(2).mean(dim=(-3, -1), keepdim=True) + eps)).reshape(x.shape)
    torch.testing.assert_close(kernels.cpu_rms_norm(x, w, eps, groups, p, gate=z), want, atol=1e-6, rtol=1e-5)
    x.requires_grad_()  # training differentiates the torch ops
    assert kernels.cpu_rms_norm(x, w, eps, groups, p, gate=z) is None


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gated", [False, True])
def test_bf16_norms_in_c_compute_in_float32_and_round_once_as_torch_does(x_dtype, gated, threads):
    """A bfloat16 network's norms (bf16 rows, its gated group norm's float32 scan output with a bf16 z, bf16
    weights) widened, normed in float32 and rounded to x's dtype at the end, as the torch formulas do: one
    bf16 step apart at most, where the float32 sums' order tips a rounding. Not under grad mode."""
    groups, p, width = 2, 12, 48
    x = torch.randn(3, 9, width).to(x_dtype)
    w, z, eps = torch.randn(width).bfloat16(), torch.randn(3, 9, width).bfloat16() if gated else None, 1e-5
    h = x.float() * F.silu(z.float()) if gated else x.float()
    v = h.view(3, 9, -1, groups, p)
    want = (w.float() * (v * torch.rsqrt(v.pow(2).mean(dim=(-3, -1), keepdim=True) + eps)).reshape(x.shape))
    with torch.inference_mode():
        got = kernels.cpu_rms_norm(x, w, eps, groups, p, gate=z)
    assert got is not None and got.dtype == x_dtype
    if x_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), want.to(x_dtype).float(), rtol=2**-7, atol=1e-6)
        assert (got == want.to(x_dtype)).float().mean() > 0.95
    with torch.enable_grad():
        assert kernels.cpu_rms_norm(x.requires_grad_(), w, eps, groups, p, gate=z) is None


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_oracle_config_prefills_in_c_like_transformers(tmp_path, name):
    hf = make_checkpoint(tmp_path, seed=2, **CONFIGS[name])
    ids = torch.randint(0, 96, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = elastic_local.load(tmp_path).forward(ids)
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=0)


def scan_inputs(b, T, G, r, p, N, seed=0):
    """The scan's arguments as mamba2.py makes them: rank-major heads seen group-major, B and C views
    into one projection's columns."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, T, r, G, p, generator=g).transpose(2, 3)
    dt = torch.nn.functional.softplus(torch.randn(b, T, r, G, generator=g) - 1).transpose(2, 3)
    A = -torch.rand(r, G, generator=g).mul(4).t()
    BC = torch.randn(b, T, 2 * G * N + 3, generator=g)
    B, C = BC[..., :G * N].view(b, T, G, N), BC[..., G * N:2 * G * N].view(b, T, G, N)
    return x, dt, A, B, C, torch.randn(b, G, r, p, N, generator=g)


@pytest.mark.parametrize("p,N", [(12, 12), (16, 8), (40, 24), (64, 16)])
@pytest.mark.parametrize("start", ["zeros", "state"])
def test_the_scan_is_the_recurrence_the_chunked_scan_computes(p, N, start, threads, c_calls):
    x, dt, A, B, C, init = scan_inputs(2, 37, 2, 3, p, N)
    init = init if start == "state" else None
    with torch.no_grad():
        y, final = kernels.ssd_scan(x, dt, A, B, C, 8, init)
        y_ref, final_ref = ssd.ssd_chunked(x, dt, A, B, C, 8, init)
        state = torch.zeros_like(final) if init is None else init.clone()
        steps = torch.stack([ssd.ssm_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t]) for t in range(37)], 1)
    assert c_calls == ["_cpu_scan"]
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, final_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y, steps, atol=1e-4, rtol=1e-4)  # the decode step's recurrence, token by token
    torch.testing.assert_close(final, state, atol=1e-4, rtol=1e-4)
    if init is not None:
        assert not torch.equal(init, final)  # the caller's state is not written


@pytest.mark.parametrize("C,K", [(13, 4), (40, 2), (24, 3)])
@pytest.mark.parametrize("T", [2, 9])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_convolution_continues_and_updates_the_window_like_torch(C, K, T, bias, dtype, threads, c_calls):
    """In float32, and in bf16 (a bfloat16 prompt: the convolution rounded to bf16 before the silu and the
    silu after it, as torch's bf16 conv1d and silu round; one bf16 step apart at most, where the float32
    sums' order or the two exps tip a rounding)."""
    g = torch.Generator().manual_seed(C * T)
    x = torch.randn(2, T, C + 5, generator=g)[..., 2:C + 2].to(dtype)  # a view with a row stride, as xBC's
    w, b = torch.randn(C, K, generator=g).to(dtype), torch.randn(C, generator=g).to(dtype) if bias else None
    for state in (None, torch.randn(2, C, K, generator=g).to(dtype)):
        ref_state = None if state is None else state.clone()
        with torch.inference_mode():
            got = kernels.causal_conv1d(x, w, b, state)
            want = ssd.causal_conv1d(x, w, b, ref_state)
        assert got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        else:
            torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2**-7)
            assert (got == want).float().mean() > 0.9
        if state is not None:  # T < K keeps part of the old window
            assert torch.equal(state, ref_state)
    assert c_calls == ["_cpu_conv", "_cpu_conv"]


def expert_weights(E, I, d, seed=0, dtype=torch.float32):
    from elastic_local.model.linear import Panels

    g = torch.Generator().manual_seed(seed)
    up, down = torch.randn(E, I, d, generator=g) / d ** 0.5, torch.randn(E, d, I, generator=g) / I ** 0.5
    return moe.MoEWeights(torch.randn(E, d), torch.zeros(E), Panels.of(up.to(dtype)), Panels.of(down.to(dtype)),
                          None, None)


@pytest.mark.parametrize("p,N", [(12, 12), (64, 16)])
@pytest.mark.parametrize("start", ["zeros", "state", "strided state"])
def test_a_mixer_s_scan_adds_the_skip_in_its_heads_order_and_advances_the_cache_s_state(p, N, start, threads,
                                                                                        c_calls):
    """mamba_scan's one C pass against the torch ops it replaces: ssd_scan, the D skip, the heads from
    group-major to rank-major; the state tensor given is the one advanced (the decode step holds its
    pointer), a strided one through a contiguous copy."""
    x, dt, A, B, C, init = scan_inputs(2, 37, 2, 3, p, N)
    D = torch.randn(2, 3, generator=torch.Generator().manual_seed(5))
    state = None if start == "zeros" else init.clone()
    if start == "strided state":  # the same values, N before p in memory
        state = state.transpose(-1, -2).contiguous().transpose(-1, -2)
    with torch.no_grad():
        y_ref, final_ref = ssd.ssd_chunked(x, dt, A, B, C, 8, None if state is None else init)
        want = (y_ref + D[..., None] * x).transpose(2, 3).reshape(2, 37, 3 * 2 * p)
        y = kernels.mamba_scan(x, dt, A, D, B, C, 8, state)
    assert c_calls == ["_cpu_scan"]
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    if state is not None:  # `state` is still the caller's tensor: its values must be the final state
        torch.testing.assert_close(state, final_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("start", ["state", "strided state"])
def test_a_scan_without_memory_for_its_state_copies_says_so_and_leaves_the_cache_s_state(start, monkeypatch):
    """ssm_scan allocates every thread's state copy before any thread starts, so where that fails (here a
    team so large that no address space holds the copies: 2^31 - 1 threads of a 128x256 state, 2^48
    bytes) a MemoryError names them and the cache's state is as it was, not half advanced."""
    x, dt, A, B, C, init = scan_inputs(1, 5, 1, 2, 128, 256)
    state = init.clone()
    if start == "strided state":
        state = state.transpose(-1, -2).contiguous().transpose(-1, -2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2**31 - 1)
    with torch.no_grad(), pytest.raises(MemoryError, match="128x256 SSM state copies"):
        kernels.mamba_scan(x, dt, A, torch.ones(1, 2), B, C, 8, state)
    assert torch.equal(state, init)


@pytest.mark.parametrize("experts,d,k", [(8, 32, 2), (6, 20, 3), (32, 300, 4)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_router_in_c_chooses_and_weighs_the_experts_as_torch_does(experts, d, k, norm, dtype, threads,
                                                                        monkeypatch):
    """A budget's router (fewer experts and inputs than resident: a view with rows wider than d), bf16 tokens
    widened, scores with and without normalizing the top k."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(experts + d)
    gate, bias = torch.randn(40, 320, generator=g) / 8, torch.randn(40, generator=g) / 4
    x = torch.randn(57, d, generator=g).to(dtype)
    cfg = SimpleNamespace(n_group=1, topk_group=1, num_experts_per_tok=k, norm_topk_prob=norm,
                          routed_scaling_factor=2.5)
    calls = []
    real = moe._route_cpu
    monkeypatch.setattr(moe, "_route_cpu", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        weights, ids = moe.route(x, gate, bias, experts, cfg)
        monkeypatch.setattr(moe, "_route_cpu", lambda *a: None)
        want_weights, want_ids = moe.route(x, gate, bias, experts, cfg)
    assert calls and ids.dtype == want_ids.dtype
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("experts,channels,d", [(8, 48, 32), (6, 40, 32), (8, 9, 20), (7, 30, 300)])
@pytest.mark.parametrize("n", [1, 3, 29])
def test_the_routed_experts_sum_what_the_grouped_torch_path_sums(experts, channels, d, n, threads):
    """Budget views (fewer experts, channels and inputs than resident), 24-column blocks with narrower last
    ones, row tiles of 1-4, inputs over two 256-row panels, experts that got no token."""
    w = expert_weights(8, 48, 320)
    g = torch.Generator().manual_seed(n)
    flat = torch.randn(n, d, generator=g)
    ids = torch.stack([torch.randperm(experts - 2, generator=g)[:3] for _ in range(n)])  # the last two: none
    weights = torch.rand(n, 3, generator=g)
    got = moe._experts_cpu(flat, w, experts, channels, ids, weights)
    assert got is not None
    torch.testing.assert_close(got, moe._experts_grouped(flat, w, experts, channels, ids, weights, None),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dots", [True, False])
@pytest.mark.parametrize("experts,channels,d", [(8, 48, 32), (6, 40, 32), (8, 10, 20), (7, 30, 300)])
@pytest.mark.parametrize("n", [1, 3, 29, 200])
def test_a_bfloat16_prompt_s_routed_experts_run_in_c_at_the_torch_path_s_rounding_points(experts, channels, d, n,
                                                                                         dots, threads, monkeypatch):
    """experts_prefill_bf16: bf16 tokens on bf16 panels (budget views, rows past one 128-row block of an
    expert), each product rounded to bf16 and relu(h)^2 too, as the grouped torch path in bf16 does: the
    same sums but for the order the float32 total adds the experts in. On the CPU's bf16 dots, and without
    them (a CPU that lacks them, or ELASTIC_LOCAL_BF16_DOT=0) on the inputs widened to float32."""
    if dots and not gemv.bf16_dot():
        pytest.skip("this CPU has no AVX512-BF16 dot products (the widened path is the other case)")
    if not dots:
        monkeypatch.setenv(gemv.BF16_DOT_ENV, "0")
    w = expert_weights(8, 48, 320, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(n)
    flat = torch.randn(n, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(experts - 2, generator=g)[:3] for _ in range(n)])
    weights = torch.rand(n, 3, generator=g)
    got = moe._experts_cpu(flat, w, experts, channels, ids, weights)
    assert got is not None and got.dtype == torch.float32
    want = moe._experts_grouped(flat, w, experts, channels, ids, weights, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3 * float(want.abs().max()))  # measured 1e-7


@pytest.fixture(scope="module")
def nested(tmp_path_factory):
    from elastic_local.elastic.nest import nest

    tmp = tmp_path_factory.mktemp("prefill")
    make_checkpoint(tmp / "parent", seed=7, **ALIGNED)
    return nest(tmp / "parent", tmp / "nested", {"half": 0.5})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision,layout", [(None, "rows"), (None, None), ("fp8", None), ("nvfp4", None)])
def test_every_format_s_experts_run_in_c_like_the_torch_path(nested, precision, layout, dtype, threads, monkeypatch,
                                                              c_calls):
    """Packed FP8 / NVFP4 experts (gemv.c's kernels, NVFP4's inputs permuted), float ones kept [out, in] and
    in panels, for every budget (fewer channels: views of the packed rows); in a bfloat16 load on the bf16
    dots (experts_prefill_bf16) where the CPU has them, else widened to float32."""
    if layout:
        monkeypatch.setenv("ELASTIC_LOCAL_CPU_LAYOUT", layout)
    m = elastic_local.load(nested, precision=precision, dtype=dtype)
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(4))
    for name in m.budgets:
        with torch.inference_mode():
            got = m.forward(ids, budget=name)
            with monkeypatch.context() as p:
                p.setattr(moe, "_experts_cpu", lambda *a: None)
                want = m.forward(ids, budget=name)
        tol = 1e-4 if dtype == torch.float32 else 0.02 * float(want.abs().max())
        torch.testing.assert_close(got, want, atol=tol, rtol=1e-4, msg=name)
    assert c_calls.count("_experts_cpu") == 2 * len(m.budgets)  # two MoE layers per forward


def test_replaced_expert_weights_are_described_anew(nested):
    """The experts' C descriptions hold pointers: kept per budget while the weights stay the same objects."""
    m = elastic_local.load(nested)
    w = next(layer.mixer for layer in m.net.layers if isinstance(layer.mixer, moe.MoEWeights))
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        before = m.forward(ids)
        w.up = type(w.up)(w.up.p * 2, w.up.skip, w.up.n)  # a new weight object (another storage)
        after = m.forward(ids)
        with pytest.MonkeyPatch.context() as p:
            p.setattr(moe, "_experts_cpu", lambda *a: None)
            want = m.forward(ids)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, want, atol=1e-4, rtol=1e-4)


def test_gradients_and_other_kernels_keep_the_torch_path(c_calls):
    x, dt, A, B, C, init = scan_inputs(1, 9, 2, 2, 8, 8)
    x.requires_grad_()
    y, _ = kernels.ssd_scan(x, dt, A, B, C, 4, init)
    y.sum().backward()  # training differentiates the torch reference
    assert x.grad is not None and c_calls == []
    w = expert_weights(4, 16, 8)
    flat = torch.randn(5, 8, requires_grad=True)
    assert moe._experts_cpu(flat, w, 4, 16, torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2)) is None
    with torch.no_grad():
        assert kernels.ssd_scan(x.bfloat16(), dt, A, B, C, 4, None)[0].dtype == torch.float32  # torch's scan
        rows = moe.MoEWeights(w.gate, w.bias, w.up.dense().transpose(1, 2), w.down.dense().transpose(1, 2), None, None)
        assert moe._experts_cpu(flat, rows, 4, 16, torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2)) is None
    assert c_calls == []


def test_what_a_prefill_caches_on_the_experts_is_not_taken_for_a_weight(nested):
    """The experts' descriptions are kept on the layer's weights object (moe._described) after a prefill
    with nothing to differentiate, as an evaluation between training steps runs one; the code that lists
    a layer's weights (training's slots, the compiled and CUDA-graph steps' float-weights check) must
    not take them for one."""
    from elastic_local.train.weights import slots

    m = elastic_local.load(nested, dtype=torch.float32)
    with torch.no_grad():
        m.net.forward(torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(3)))
    assert any("_described" in vars(layer.mixer) for layer in m.net.layers if layer.mixer is not None)
    assert not [s.name for s in slots(m.net) if "_described" in s.name]
    assert m.net._float_weights("a check")
