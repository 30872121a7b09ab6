"""The kernel seam (model/kernels.py) drives the kernels with arguments they accept: the network runs
through fakes that check what mamba_ssm, causal_conv1d and torch._scaled_mm check (tests/kernel_twins.py)
and computes what the torch path computes, so a wrong argument fails here and not on a user's GPU."""

from dataclasses import replace
from unittest import mock

import pytest
import torch
from kernel_twins import (
    FAKES,
    calls,
    fake_causal_conv1d_fn,
    fake_causal_conv1d_update,
    fake_scaled_mm,
    fake_selective_state_update,
)
from tiny import ALIGNED, make_checkpoint

from elastic_local.checkpoint.load import load_network
from elastic_local.model import Budget, kernels, step
from elastic_local.model.mamba2 import MambaState


@pytest.fixture
def seam():
    """Restores the kernel choice after a test that swaps it."""
    previous = kernels.use(kernels.TORCH)
    calls.clear()
    yield kernels
    kernels.use(previous)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_checkpoint(path, seed=5)
    return path


def half_mamba(net) -> Budget:
    """The resident budget with half the Mamba heads: sliced conv weights and in_proj views."""
    layers = tuple(replace(s, mamba_heads=s.mamba_heads // 2) if s.kind == "M" else s for s in net.resident.layers)
    return Budget("half", net.resident.hidden, layers)


@torch.inference_mode()
def run(net, ids: torch.Tensor, budget: Budget | None):
    """Logits of a whole-sequence forward, then of a prefill, a continuing prefill and decode steps on one
    cache, and that cache's Mamba states. The CPU's C decode step stays out: the steps run the layers, and
    so the seam."""
    net.c_steps.clear()
    with mock.patch.object(step, "build", lambda net, b: None):
        return _run(net, ids, budget)


def _run(net, ids: torch.Tensor, budget: Budget | None):
    whole = net.forward(ids, budget)
    cache = net.new_cache(ids.shape[0], budget)
    steps = [net.forward(ids[:, :5], budget, cache), net.forward(ids[:, 5:9], budget, cache)]
    steps += [net.forward(ids[:, t:t + 1], budget, cache) for t in range(9, ids.shape[1])]
    states = [(s.conv.clone(), s.ssm.clone()) for s in cache.layers if isinstance(s, MambaState)]
    return whole, torch.cat(steps, 1), states


@pytest.mark.parametrize("half", [False, True])
def test_mamba_kernels_compute_what_the_torch_path_computes(seam, tiny, half):
    net = load_network(tiny)
    budget = half_mamba(net) if half else None
    ids = torch.randint(0, net.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = run(net, ids, budget)
    seam.use(FAKES)
    got = run(net, ids, budget)
    # every kernel ran: prefill scan and conv with and without a cache to continue, decode step and update
    assert {"mamba_chunk_scan_combined", "selective_state_update", "causal_conv1d_fn",
            "causal_conv1d_update"} <= set(calls)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], got[0], rtol=1e-4, atol=1e-4)  # cached == whole, on the kernel path
    for (conv, ssm), (conv_ref, ssm_ref) in zip(got[2], ref[2]):
        torch.testing.assert_close(conv, conv_ref)
        torch.testing.assert_close(ssm, ssm_ref, rtol=1e-4, atol=1e-5)


def test_the_fakes_refuse_what_the_kernels_refuse():
    """The calls the seam used to make, each rejected the way the real kernel rejects it."""
    b, h, p, N, G = 2, 4, 8, 16, 2
    state, x = torch.zeros(b, h, p, N), torch.randn(b, h, p)
    dt = torch.rand(b, h, 1).expand(b, h, p)
    A = (-torch.rand(h, 1, 1)).expand(h, p, N)
    B = C = torch.randn(b, G, N)
    with pytest.raises(AttributeError, match="stride"):  # dt_bias=None with a tied head dim (mamba_ssm >= 2.2.2)
        fake_selective_state_update(state, x, dt, A, B, C)
    with pytest.raises(TypeError, match="D is None"):
        fake_selective_state_update(state, x, dt, A, B, C, dt_bias=torch.zeros(h, p))
    dim, K, T = 24, 4, 5
    weight, xs = torch.randn(dim, K), torch.randn(b, T, dim).transpose(1, 2)  # (b, dim, T) channel-last
    conv_state = torch.randn(b, dim, K)
    with pytest.raises(RuntimeError, match="channels contiguous"):  # the state as stored: [b, C, K]
        fake_causal_conv1d_fn(xs, weight, initial_states=conv_state[:, :, 1:], activation="silu")
    with pytest.raises(RuntimeError, match="channel last"):  # channel-first x cannot continue a state
        fake_causal_conv1d_fn(xs.contiguous(), weight, activation="silu",
                              initial_states=conv_state[:, :, 1:].transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(RuntimeError, match="conv_state"):
        fake_causal_conv1d_update(xs[:, :, 0].bfloat16(), conv_state, weight.bfloat16(), activation="silu")
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    with pytest.raises(RuntimeError, match="column-major"):
        fake_scaled_mm(a, a.t().contiguous(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="float32"):
        fake_scaled_mm(a, a.t(), scale_a=one, scale_b=one.bfloat16(), out_dtype=torch.float32)


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_quantized_weights_reach_the_scaled_matmul_with_valid_operands(seam, tmp_path, precision):
    make_checkpoint(tmp_path, seed=2, **ALIGNED)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(0))
    net = load_network(tmp_path, dtype=torch.bfloat16, precision=precision)
    with torch.inference_mode():
        dequantized = net.forward(ids)
        seam.use(FAKES)
        native = net.forward(ids)
    assert calls["scaled_mm"] > 0
    # the native path quantizes activations too (to 4 bits for NVFP4, through every layer of a random
    # model): near, not equal; test_quant_formats.py pins each matmul's numerics
    assert (native - dequantized).norm() < {"fp8": 0.25, "nvfp4": 0.6}[precision] * dequantized.norm()


def test_forcing_the_torch_path_from_the_environment(seam, monkeypatch):
    monkeypatch.setenv(kernels.FORCE_ENV, "torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # even where a GPU is visible
    seam.use(None)
    assert kernels.active() is kernels.TORCH
    assert kernels.describe("cuda")["mamba_scan"] == "torch SSD reference"
    assert "forced" in kernels.describe("cuda")["note"]


def test_a_kernel_that_does_not_import_falls_back_and_says_why(seam, monkeypatch):
    import builtins

    real = builtins.__import__

    def broken(name, *args, **kwargs):  # a build against another torch fails when imported, not found
        if name.startswith(("mamba_ssm", "causal_conv1d")):
            raise ImportError(f"{name}: undefined symbol _ZN3c10")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    monkeypatch.delenv(kernels.FORCE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seam.use(None)
    k = kernels.active()
    assert k.chunk_scan is None and k.conv is None and set(k.missing) == {"mamba_ssm", "causal_conv1d"}
    d = kernels.describe("cuda")
    assert d["mamba_scan"] == "torch SSD reference" and "undefined symbol" in d["note"]
