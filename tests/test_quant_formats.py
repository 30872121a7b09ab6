"""FP8/NVFP4 quantization: bit-exact against nvidia-modelopt, nesting-safe, and the runtime matmul paths.

The modelopt comparisons need `pip install nvidia-modelopt==0.47.0 requests` (CPU is enough).
"""

import warnings

import pytest
import torch
from kernel_twins import blocked_offsets, fake_scaled_mm, unblock

from elastic_local.model import gemv, kernels
from elastic_local.model.kernels import KernelSet
from elastic_local.quant import (
    FP8Weight,
    NVFP4Weight,
    dequantize_fp8,
    quantize_fp8,
    quantize_nvfp4,
)
from elastic_local.quant import linear as qlinear
from elastic_local.quant.nvfp4 import round_to_nvfp4

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 16), (7, 64), (64, 256), (130, 1024)]
SCALES = [1e-3, 1.0, 300.0]


@pytest.fixture(scope="module")
def modelopt():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # modelopt warns about the installed transformers version
        # the test extra installs nvidia-modelopt: the oracle missing is a failure, not a skip
        import modelopt.torch.quantization.qtensor as qtensor
    return qtensor


def random_weight(shape, scale, dtype, seed=0):
    """Heavy-tailed rows and blocks, so block scales span a wide range (and hit the 2**-9 floor)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g)) * scale
    if shape[0] > 1:
        w[0, :16] *= 1e-7  # a block far below the tensor's amax
    return w.clamp(-6e4, 6e4).to(dtype)  # finite in fp16


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b)), f"{int((bits(a) != bits(b)).sum())} of {a.numel()} differ"


def assert_nvfp4_matches(modelopt, w, scale_2=None):
    ours = quantize_nvfp4(w, scale_2)
    q, scale, theirs_2 = modelopt.NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=scale_2)
    assert_bits_equal(ours.weight, q._quantized_data)
    assert_bits_equal(ours.weight_scale, scale)
    assert_bits_equal(ours.weight_scale_2, theirs_2.float())
    for dtype in (torch.float32, torch.bfloat16):
        deq = q.dequantize(dtype, scale=scale, double_scale=theirs_2, block_sizes={-1: 16})
        assert_bits_equal(ours.dequantize(dtype), deq)
    return ours


# Block layout of the hand-built tensor below (tensor amax 2688, so weight_scale_2 = 2688/2688 = 1 exactly).
TIES = [6, -6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5]
TIE_CODES = [7, 15, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14]
MIXED = [6, -0.0, 0.0, 1e-30, -1e-30, 0.2499, 0.2501, 0.7499, 0.7501, 4.5, 5.5, 3, 0.5, 1, 2, 4]
MIXED_CODES = [7, 0, 0, 0, 8, 0, 1, 1, 2, 6, 7, 5, 1, 2, 4, 6]


def edge_weight() -> tuple[torch.Tensor, list[list[int]], list[list[float]]]:
    rows = [
        # zero block | block holding the amax (scale 448) | scale 1 | amax 1e-6 (scale floors at 2**-9)
        [[0.0] * 16, [448 * v for v in TIES], MIXED, [1e-6, -1e-6] + [0.0] * 14],
        # negative zeros | scale 2 (ties doubled) | 5.9999 -> 6 | 6.2 clamps to 6
        [[-0.0] * 16, [2 * v for v in TIES], [5.9999] + [0.0] * 15, [6.2, -6.2] + [0.0] * 14],
    ]
    codes = [
        [[0] * 16, TIE_CODES, MIXED_CODES, [0, 8] + [0] * 14],
        [[0] * 16, TIE_CODES, [7] + [0] * 15, [7, 15] + [0] * 14],
    ]
    scales = [[1.0, 448.0, 1.0, 2**-9], [1.0, 2.0, 1.0, 1.0]]
    return torch.tensor([sum(r, []) for r in rows]), [sum(r, []) for r in codes], scales


def unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), -1).flatten(-2)


# ----- NVFP4 quantizer -----


def test_nvfp4_edge_cases_by_hand():
    w, codes, scales = edge_weight()
    q = quantize_nvfp4(w)
    assert q.weight.dtype == torch.uint8 and q.weight.shape == (2, 32)
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (2, 4)
    assert q.weight_scale_2.dtype == torch.float32 and q.weight_scale_2.item() == 1.0
    assert unpack(q.weight).tolist() == codes
    assert q.weight_scale.float().tolist() == scales
    assert q.weight[0, 8].item() == 7 | 15 << 4  # low nibble holds the first element


def test_nvfp4_edge_cases_match_modelopt(modelopt):
    assert_nvfp4_matches(modelopt, edge_weight()[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_matches_modelopt(modelopt, dtype):
    for i, shape in enumerate(SHAPES):
        for scale in SCALES:
            assert_nvfp4_matches(modelopt, random_weight(shape, scale, dtype, seed=i))


def test_nvfp4_shared_scale_matches_modelopt(modelopt):
    w = random_weight((32, 128), 1.0, torch.bfloat16)
    amax_scale = w.float().abs().amax() / (6 * 448)
    for factor in (4.0, 0.25):  # a looser shared scale, and a tighter one that saturates
        assert_nvfp4_matches(modelopt, w, amax_scale * factor)


def test_nvfp4_tiles_rows(monkeypatch, modelopt):
    monkeypatch.setattr("elastic_local.quant.nvfp4.TILE_ELEMENTS", 1000)
    assert_nvfp4_matches(modelopt, random_weight((100, 64), 1.0, torch.float32))


def test_nvfp4_all_zero_weight():
    q = quantize_nvfp4(torch.zeros(4, 32))  # modelopt itself would produce 0/0 here
    assert q.weight_scale_2.item() == 0.0 and not q.weight.any()
    assert q.weight_scale.float().eq(1.0).all()
    assert torch.equal(q.dequantize(torch.float32), torch.zeros(4, 32))


def test_nvfp4_rejects_bad_input():
    with pytest.raises(ValueError, match="in % 16"):
        quantize_nvfp4(torch.ones(4, 24))
    with pytest.raises(ValueError, match="positive"):
        quantize_nvfp4(torch.ones(4, 32), torch.tensor(0.0))


# ----- FP8 quantizer -----

# e4m3 around 1 steps by 0.125 and its subnormals by 2**-9: ties must go to the even neighbour.
FP8_EDGES = [448.0, -448.0, 1.0625, 1.1875, -0.0, 2**-10, 3 * 2**-10, 2**-12, 447.0, 1e-30]
FP8_EDGE_VALUES = [448.0, -448.0, 1.0, 1.25, -0.0, 0.0, 2**-8, 0.0, 448.0, 0.0]


def test_fp8_edge_cases_by_hand():
    q = quantize_fp8(torch.tensor(FP8_EDGES))  # amax 448: the scale is exactly 1
    assert q.weight.dtype == torch.float8_e4m3fn and q.weight_scale.item() == 1.0
    assert q.weight.float().tolist() == FP8_EDGE_VALUES
    assert bits(q.weight)[4].item() == 0x80  # negative zero kept


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_matches_modelopt(modelopt, dtype):
    from modelopt.torch.export.quant_utils import to_quantized_weight

    weights = [random_weight(shape, scale, dtype, i) for i, shape in enumerate(SHAPES) for scale in SCALES]
    for w in [*weights, torch.tensor([FP8_EDGES]).to(dtype)]:
        ours = quantize_fp8(w)
        assert ours.weight_scale.dtype == torch.float32 and ours.weight_scale.ndim == 0
        assert_bits_equal(ours.weight_scale, w.float().abs().amax() / 448)
        # Given the fp32 scale, modelopt (on a CPU) computes the same codes in FP8QTensor.quantize and the export.
        q, _ = modelopt.FP8QTensor.quantize(w.clone(), scales=ours.weight_scale)
        assert_bits_equal(ours.weight, q._quantized_data)
        assert_bits_equal(ours.weight, to_quantized_weight(w, ours.weight_scale, "fp8"))
        if dtype == torch.float32:  # fp32: modelopt's own scale is the same, so the whole call matches
            q, scale = modelopt.FP8QTensor.quantize(w.clone())
            assert_bits_equal(ours.weight, q._quantized_data)
            assert_bits_equal(ours.weight_scale, scale)
            assert_bits_equal(ours.dequantize(dtype), q.dequantize(dtype, scale=scale))


def test_fp8_all_zero_weight():
    q = quantize_fp8(torch.zeros(4, 32))
    assert q.weight_scale.item() == 0.0 and torch.equal(q.dequantize(torch.float32), torch.zeros(4, 32))


# ----- shared rules -----


@pytest.mark.parametrize("quantize", [quantize_nvfp4, quantize_fp8])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_raises(quantize, bad):
    w = torch.randn(8, 32, dtype=torch.bfloat16)
    w[3, 7] = bad
    with pytest.raises(ValueError, match="backbone.layers.3.mixer.in_proj.weight.*(NaN|Inf)"):
        quantize(w, name="backbone.layers.3.mixer.in_proj.weight")


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("quantize", [quantize_nvfp4, quantize_fp8])
def test_narrow_commutes_with_dequantize(quantize):
    q = quantize(random_weight((48, 256), 1.0, torch.bfloat16))
    full = q.dequantize(torch.float32)
    for out, k in [(48, 256), (48, 16), (17, 64), (1, 128), (32, 240), (40, 192)]:
        sub = q.narrow(out, k)
        assert sub.shape == (out, k)
        assert shares_storage(sub.weight, q.weight) and shares_storage(sub.weight_scale, q.weight_scale)
        assert_bits_equal(sub.dequantize(torch.float32), full[:out, :k])
        assert_bits_equal(sub.dequantize(torch.bfloat16), q.dequantize(torch.bfloat16)[:out, :k])
    assert q.narrow(48, 256) is q and q.narrow(17, 64) is q.narrow(17, 64)  # one object per cut
    sub = q.block(8, 24, 64)  # a row range, as fused projections are split
    assert_bits_equal(sub.dequantize(torch.float32), full[8:24, :64])
    assert_bits_equal(sub.narrow(4, 32).dequantize(torch.float32), full[8:12, :32])


def test_nvfp4_narrow_needs_16_aligned_cut():
    q = quantize_nvfp4(torch.randn(32, 64))
    with pytest.raises(ValueError, match="multiple of 16"):
        q.narrow(32, 24)
    with pytest.raises(ValueError, match="outside"):
        q.narrow(33, 64)
    assert quantize_fp8(torch.randn(32, 64)).narrow(32, 24).shape == (32, 24)  # per-tensor: any cut


# ----- runtime -----


@pytest.mark.parametrize("quantize", [quantize_nvfp4, quantize_fp8])
def test_linear_matches_dequantized_matmul(monkeypatch, quantize):
    monkeypatch.setattr(qlinear, "TILE_ELEMENTS", 2000)  # several row tiles, the last one ragged
    monkeypatch.setattr(gemv, "_library", None)  # torch's path (the CPU decode kernels: test_cpu_gemv.py)
    q = quantize(random_weight((100, 128), 0.1, torch.float32))
    x = torch.randn(3, 5, 128)
    for w in (q, q.narrow(70, 96)):
        out, k = w.shape
        assert w.kernel_name("cpu") == "dequant_matmul"
        y = w.linear(x[..., :k])
        assert y.shape == (3, 5, out)
        torch.testing.assert_close(y, x[..., :k] @ w.dequantize(torch.float32).T, rtol=1e-5, atol=1e-5)
        xb = x[..., :k].bfloat16()
        torch.testing.assert_close(w.linear(xb), xb @ w.dequantize(torch.bfloat16).T, rtol=1e-2, atol=1e-3)


def test_to_blocked_layout():
    q = quantize_nvfp4(torch.randn(300, 1024))
    for rows, k in [(300, 1024), (128, 64), (1, 16), (130, 96), (256, 512)]:
        scale = q.weight_scale[:rows, : k // 16]
        blocked = qlinear.to_blocked(scale)
        assert blocked.numel() == 128 * -(-rows // 128) * 4 * -(-k // 64)  # padded to 128 rows x 4 scales
        assert_bits_equal(unblock(blocked, rows, k // 16), scale.contiguous())
        padding = torch.ones(blocked.numel(), dtype=torch.bool)
        padding[blocked_offsets(rows, k // 16).flatten()] = False
        assert not bits(blocked)[padding].any()


def test_kernel_selection():
    fp8, nvfp4 = quantize_fp8(torch.randn(64, 128)), quantize_nvfp4(torch.randn(64, 128))
    previous = kernels.active()
    for cap, fp8_kernel, nvfp4_kernel in [
        ((8, 6), "dequant_matmul", "dequant_matmul"),
        ((8, 9), "scaled_mm_fp8", "dequant_matmul"),
        ((9, 0), "scaled_mm_fp8", "dequant_matmul"),
        ((10, 0), "scaled_mm_fp8", "scaled_mm_nvfp4"),
        ((12, 0), "scaled_mm_fp8", "scaled_mm_nvfp4"),
    ]:
        kernels.use(KernelSet("gpu", "cuda", scaled_mm=fake_scaled_mm, capability=lambda device, cap=cap: cap))
        assert (fp8.kernel_name("cuda"), nvfp4.kernel_name("cuda")) == (fp8_kernel, nvfp4_kernel)
    # Shapes the kernels cannot take fall back: NVFP4 needs in % 32, both need out % 16.
    assert nvfp4.narrow(64, 48).kernel_name("cuda") == "dequant_matmul"
    assert fp8.narrow(40, 128).kernel_name("cuda") == "dequant_matmul"
    assert fp8.narrow(48, 48).kernel_name("cuda") == "scaled_mm_fp8"
    kernels.use(kernels.TORCH)  # the torch path forced: no scaled matmul on any device
    assert fp8.kernel_name("cuda") == "dequant_matmul"
    kernels.use(previous)


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_scaled_mm_path(static, dtype):
    """torch._scaled_mm has a CPU FP8 kernel, so the GPU path's arguments can be checked here."""
    q = quantize_fp8(random_weight((64, 128), 0.1, torch.float32))
    x = torch.randn(5, 128).to(dtype)
    amax = x.float().abs().amax()
    w = FP8Weight(q.weight, q.weight_scale, amax / 448 if static else None).narrow(48, 96)
    x = x[:, :96]
    y = w._fast_linear(x, torch._scaled_mm)
    scale = (amax / 448) if static else x.float().abs().amax() / 448
    xq = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    ref = dequantize_fp8(xq, scale, torch.float32) @ w.dequantize(torch.float32).T
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)


@pytest.mark.parametrize("static", [True, False])
def test_nvfp4_scaled_mm_path_emulated(static):
    """Plumbing of the Blackwell path (swizzle, operand layout, global scales) against an emulated GEMM."""
    q = quantize_nvfp4(random_weight((160, 256), 0.1, torch.float32))
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    scale_2 = x.float().abs().amax() / (6 * 448)
    w = NVFP4Weight(q.weight, q.weight_scale, q.weight_scale_2, scale_2 if static else None).narrow(144, 192)
    x = x[:, :192]
    y = w._fast_linear(x, fake_scaled_mm)
    swizzled = w._blocked_scale
    assert torch.equal(w._fast_linear(x, fake_scaled_mm), y) and w._blocked_scale is swizzled  # swizzled once
    # each row rounded on its own scale where no input_scale is calibrated: the CPU's W4A4 rounding
    ref = round_to_nvfp4(x, scale_2 if static else None) @ w.dequantize(torch.float32).T
    if not static:  # a row's result does not depend on the rows beside it
        torch.testing.assert_close(w._fast_linear(x[2:3], fake_scaled_mm), y[2:3], rtol=0, atol=0)
    assert y.dtype == torch.bfloat16 and y.shape == (7, 144)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=1e-3)
    exact = x.float() @ w.dequantize(torch.float32).T  # activation rounding to 4 bits stays modest
    assert (y.float() - exact).norm() < 0.2 * exact.norm()


def test_nvfp4_inputs_are_rounded_for_every_product_where_the_block_scaled_kernel_runs(monkeypatch):
    """A CUDA graph's experts dequantize (moe._experts_gathered); where the block-scaled kernel runs the
    weight's other products, they round their inputs as it does, so graph and eager steps agree."""
    w = quantize_nvfp4(random_weight((32, 64), 0.1, torch.float32))
    x = torch.randn(3, 64)
    assert torch.equal(w.round_inputs(x), x)  # a CPU: the exact product
    monkeypatch.setattr(NVFP4Weight, "_scaled_mm", lambda self, device: fake_scaled_mm)
    assert torch.equal(w.round_inputs(x), round_to_nvfp4(x, None))
