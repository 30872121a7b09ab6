"""What only a GPU can check: the real mamba_ssm / causal_conv1d kernels and torch._scaled_mm against the
torch path, the compiled step on CUDA, the shipped model on the GPU against the CPU, and NVML on a real
driver. Skipped without CUDA; `benchmarks/gpu_check.sh` runs it on a GPU (CUDA graphs: test_cuda_graphs.py).
"""

from dataclasses import replace

import pytest
import torch
from test_compiled_decode import decodes_like
from test_kernel_seam import half_mamba, run
from tiny import ALIGNED, make_checkpoint

import elastic_local
from elastic_local.checkpoint.load import load_network
from elastic_local.hardware.fit import live_profile
from elastic_local.model import kernels
from elastic_local.model.cost import NATIVE_CAPABILITY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs it on one)")


def counting(ks: kernels.KernelSet, calls: dict[str, int]) -> kernels.KernelSet:
    """`ks` with each kernel it has counting its calls into `calls`."""
    def wrap(name, fn):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call

    names = ("chunk_scan", "state_update", "conv", "conv_update", "scaled_mm")
    return replace(ks, **{n: wrap(n, getattr(ks, n)) for n in names if getattr(ks, n) is not None})


@pytest.fixture
def restore_kernels():
    previous = kernels.use(kernels.TORCH)
    yield
    kernels.use(previous)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("half", [False, True], ids=["all-heads", "half-the-heads"])
def test_mamba_ssm_and_causal_conv1d_compute_what_the_torch_path_computes(restore_kernels, tmp_path, half):
    real = kernels._import_cuda_kernels()
    present = {n for n in ("chunk_scan", "state_update", "conv", "conv_update") if getattr(real, n) is not None}
    if not present:  # either package alone is checked
        pytest.skip("; ".join(f"{p}: {why}" for p, why in real.missing.items()))
    make_checkpoint(tmp_path, seed=5)
    net = load_network(tmp_path, device="cuda")
    budget = half_mamba(net) if half else None
    ids = torch.randint(0, net.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
    ref = run(net, ids, budget)
    calls: dict[str, int] = {}
    kernels.use(counting(real, calls))
    got = run(net, ids, budget)
    assert set(calls) == present, (calls, real.missing)
    # the Triton scan's float32 dot products run in TF32 (10-bit mantissa): near, not bit-equal
    for what, a, b in (("whole", got[0], ref[0]), ("cached", got[1], ref[1]), ("cached vs whole", got[1], got[0])):
        assert relative_error(a, b) < 5e-3, (what, relative_error(a, b))
    for (conv, ssm), (conv_ref, ssm_ref) in zip(got[2], ref[2]):
        assert relative_error(conv, conv_ref) < 5e-3  # upstream layers ran the TF32 scan
        assert relative_error(ssm, ssm_ref) < 5e-3


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_quantized_weights_take_the_scaled_matmul_exactly_where_the_gpu_runs_it(restore_kernels, tmp_path,
                                                                                precision):
    make_checkpoint(tmp_path, seed=2, **ALIGNED)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
    net = load_network(tmp_path, dtype=torch.bfloat16, precision=precision, device="cuda")
    calls: dict[str, int] = {}
    with torch.inference_mode():
        dequantized = net.forward(ids)
        kernels.use(counting(replace(kernels._import_cuda_kernels(), chunk_scan=None, state_update=None,
                                     conv=None, conv_update=None), calls))
        native = net.forward(ids)
    if torch.cuda.get_device_capability() >= NATIVE_CAPABILITY[precision]:
        assert calls.get("scaled_mm", 0) > 0
        # activations are quantized too (test_kernel_seam.py's bound, through the fake of the same kernel)
        assert relative_error(native, dequantized) < {"fp8": 0.25, "nvfp4": 0.6}[precision]
    else:
        assert calls == {}
        assert torch.equal(native, dequantized)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < NATIVE_CAPABILITY["nvfp4"],
                    reason="the block-scaled NVFP4 kernel needs Blackwell")
def test_blackwell_s_nvfp4_computes_what_the_cpu_s_w4a4_does(tmp_path):
    """The native kernel rounds the inputs (W4A4); a CPU load with activations='nvfp4' rounds them the same
    way, so its logits lie nearer the GPU's than the exact CPU path's (W4A16) do (bf16 compute on the GPU)."""
    make_checkpoint(tmp_path, seed=2, **ALIGNED)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        gpu = elastic_local.load(tmp_path, precision="nvfp4", device="cuda").logits(ids.cuda()).cpu()
        w4a4 = elastic_local.load(tmp_path, precision="nvfp4", activations="nvfp4").logits(ids)
        w4a16 = elastic_local.load(tmp_path, precision="nvfp4").logits(ids)
    assert relative_error(gpu, w4a4) < 0.5 * relative_error(gpu, w4a16), (relative_error(gpu, w4a4),
                                                                        relative_error(gpu, w4a16))


def test_compiled_decode_equals_eager_on_a_gpu(nested):
    eager = elastic_local.load(nested, device="cuda", dtype=torch.float32, cuda_graphs=False)
    compiled = elastic_local.load(nested, device="cuda", dtype=torch.float32, compile=True)
    decodes_like(compiled, eager, seed=3, device="cuda", tol=1e-3)
    assert None not in compiled.net.compiled.values()


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_cuda_graph_decode_of_packed_weights_stays_near_eager_on_a_gpu(nested, precision):
    """The graph's MoE dequantizes the routed experts it gathers and multiplies in the compute dtype, where
    eager runs each expert's own product (on sm_89+ FP8's `_scaled_mm`, which quantizes activations too):
    near, within the bound the scaled matmul itself is held to, not equal."""
    eager = elastic_local.load(nested, device="cuda", dtype=torch.float32, precision=precision, cuda_graphs=False)
    replayed = elastic_local.load(nested, device="cuda", dtype=torch.float32, precision=precision)
    assert replayed.net.graphs == {}
    prompt = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(9)).cuda()
    with torch.inference_mode():
        for name in eager.budgets:
            caches = [m.net.new_cache(1, budget=m.budget(name)) for m in (eager, replayed)]
            tok = eager.net.forward(prompt, cache=caches[0], last_only=True)[:, -1:].argmax(-1)
            replayed.net.forward(prompt, cache=caches[1], last_only=True)
            for _ in range(6):  # the same tokens into both: eager's greedy ones
                want = eager.net.forward(tok, cache=caches[0])
                got = replayed.net.forward(tok, cache=caches[1])
                assert relative_error(got, want) < {"fp8": 0.25, "nvfp4": 0.6}[precision], name
                tok = want[:, -1:].argmax(-1)
    assert None not in replayed.net.graphs.values()


def test_the_shipped_model_decodes_on_the_gpu_as_on_the_cpu():
    cpu, gpu = elastic_local.load(), elastic_local.load(device="cuda", dtype=torch.float32)
    prompt = cpu.tokenizer.encode("What is 17 + 25?")
    for budget in cpu.budgets:
        options = dict(think_budget=budget, answer_budget=budget, max_think_tokens=24, max_answer_tokens=8)
        want, got = cpu.generate(prompt, **options), gpu.generate(prompt, **options)
        assert got.ids == want.ids, budget
    ids = torch.tensor([want.ids])
    with torch.inference_mode():
        want_logits = cpu.net.forward(ids)
        got_logits = gpu.net.forward(ids.cuda()).cpu()
    torch.testing.assert_close(got_logits, want_logits, atol=1e-3, rtol=1e-3)


def test_the_live_profile_reads_the_gpu_torch_sees_through_nvml():
    p = live_profile("cuda")
    props = torch.cuda.get_device_properties(0)
    assert p.kind == "cuda"
    assert p.compute_capability == (props.major, props.minor)
    assert abs(p.memory_bytes - props.total_memory) < 0.02 * props.total_memory
    assert p.memory_bandwidth_gbps is not None and p.memory_bandwidth_gbps > 100
