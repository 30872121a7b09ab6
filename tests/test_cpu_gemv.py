"""model/gemv.c, the CPU decode kernels: every format against torch's matmul of the dequantized weight, on
the views budgets cut, and the fallbacks around them."""

import platform
import threading

import pytest
import torch
import torch.nn.functional as F
from tiny import make_checkpoint

import elastic_local
from elastic_local.model import gemv, step
from elastic_local.model.linear import linear
from elastic_local.quant import quantize_fp8, quantize_nvfp4

X86 = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
    "AVX2", "AVX512")
# On an x86 CPU with AVX2 (every CI machine and development box here) the kernels must build: a compiler
# problem fails these tests rather than silently testing torch against itself.
pytestmark = pytest.mark.skipif(not X86, reason="the kernels are x86 AVX2 only; elsewhere torch's matmul runs")

# (out, in): a K that is a multiple of 32, one with an odd block of 16, tails below 16 (float formats)
SHAPES = [(96, 256), (37, 48), (300, 80)]
FLOAT_ONLY_SHAPES = [(5, 7), (33, 1000)]


def weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 0.1


@pytest.fixture(autouse=True)
def kernels_built():
    assert gemv.library() is not None, "the CPU decode kernels did not build (see the warning)"


@pytest.mark.parametrize("rows", [1, 2, 4, 7])
@pytest.mark.parametrize("shape", SHAPES + FLOAT_ONLY_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_matvec_equals_torch_matmul(shape, rows, dtype):
    w = weight(shape).to(dtype)
    x = torch.randn(rows, 1, shape[1]).to(dtype)
    y = gemv.matvec(x, w)
    assert y.shape == (rows, 1, shape[0]) and y.dtype == dtype
    ref = F.linear(x.float(), w.float()).to(dtype)
    torch.testing.assert_close(y, ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


def views(out: int, k: int) -> list[tuple[int, int, int]]:
    """(r0, r1, cols) blocks of an [out, k] weight: the whole of it, a budget's output and input cut, one
    that starts and ends inside a 24-output panel, and a single output."""
    return [(0, out, k), (out // 4, out - out // 8, (k + 1) // 2), (1, max(2, out - 3), k), (out - 1, out, k)]


@pytest.mark.parametrize("rows", [1, 2, 4, 7])
@pytest.mark.parametrize("shape", SHAPES + FLOAT_ONLY_SHAPES + [(5000, 700)])
def test_panel_float32_weights_and_their_budget_views_equal_torch_matmul(shape, rows):
    """The default CPU layout (column panels): the whole weight and blocks of it against F.linear on the
    stored [out, in] weight's block."""
    from elastic_local.model.linear import Panels

    out, k = shape
    w = weight(shape, seed=4)
    panels = Panels.of(w)
    assert torch.equal(panels.dense(), w.T)
    for r0, r1, cols in views(out, k):
        view, x = panels.block(r0, r1, cols), torch.randn(rows, 1, cols)
        y = view.linear(x)
        assert view.shape == (r1 - r0, cols) and y.shape == (rows, 1, r1 - r0)
        torch.testing.assert_close(y, F.linear(x, w[r0:r1, :cols]), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", [(5, 7), (37, 48), (3, 50, 70), (24, 16), (100, 257), (2, 300, 80)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_the_repacking_into_panels_in_c_equals_torch_s_copy(shape, dtype, monkeypatch):
    """gemv.c's panel_copy (a load's repacking of bf16 weights and e4m3 codes): the same panels,
    bf16 columns in BF16_COLUMNS' order, as torch's copy makes, over stacks, widths that are no multiple of
    16 or 8, and a last panel of fewer than 24 outputs."""
    from elastic_local.model.linear import Panels

    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8) if dtype == torch.uint8 \
        else torch.randn(shape, generator=g).bfloat16()
    got = Panels.of(w).p.clone()
    assert gemv.panel_copy(w, torch.zeros_like(got))  # the C copy made `got`, not torch's
    monkeypatch.setattr(gemv, "panel_copy", lambda *a: False)
    assert torch.equal(got, Panels.of(w).p)


def test_a_view_of_a_panel_view_and_of_a_stacked_expert_cut_the_same_weights():
    """Blocks compose (a budget's view cut again, as step.py's in_proj parts are) and stacked experts
    index before or after the cut."""
    from elastic_local.model.linear import Panels

    w = weight((4 * 70, 50), seed=6).view(4, 70, 50)
    stack = Panels.of(w)
    x = torch.randn(1, 30)
    for e in range(4):
        twice = stack[e].block(5, 65, 40).block(20, 53, 30)
        torch.testing.assert_close(twice.linear(x), F.linear(x, w[e, 25:58, :30]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stack.block(5, 65, 40)[e].dense(), w[e, 5:65, :40].T)


@pytest.mark.parametrize("rows", [1, 3, 5, gemv.MAX_PACKED_ROWS])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_and_nvfp4_equal_the_dequantized_matmul(shape, rows):
    w = weight(shape, seed=1)
    x = torch.randn(rows, shape[1])
    for q in (quantize_fp8(w), quantize_nvfp4(w)):
        assert q.kernel_name("cpu", rows=rows) == "cpu_gemv"
        assert q.kernel_name("cpu", rows=gemv.MAX_PACKED_ROWS + 1) == "dequant_matmul"
        ref = F.linear(x, q.dequantize(torch.float32))
        torch.testing.assert_close(q.linear(x), ref, rtol=1e-5, atol=1e-5)
        # bf16 activations against the product of the same rounded inputs: against the float32 inputs'
        # product, rounding x alone reached 1.02x this bound over 80 random inputs (a flaky failure)
        xb = x.bfloat16()
        torch.testing.assert_close(q.linear(xb), F.linear(xb.float(), q.dequantize(torch.float32)).bfloat16(),
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [4, 13, 130])
@pytest.mark.parametrize("shape", [(50, 784), (30, 1040)])
def test_a_float32_prompt_decodes_packed_weights_a_block_of_inputs_at_a_time(shape, rows, threads):
    """gemv.c's panels: each 24-row panel decoded 256 inputs at a time, a last block of 16 (a part of
    NVFP4's 64-input groups), past one 128-row block of x."""
    w = weight(shape, seed=2)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    for q in (quantize_fp8(w), quantize_nvfp4(w)):
        assert q.kernel_name("cpu", rows=rows) == "cpu_gemv"
        torch.testing.assert_close(q.linear(x), F.linear(x, q.dequantize(torch.float32)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 5, gemv.MAX_PACKED_ROWS])
@pytest.mark.parametrize("shape", SHAPES + [(5000, 700)])
def test_fp8_panels_and_their_budget_views_equal_the_dequantized_matmul(shape, rows):
    """The CPU's FP8 layout (FP8Panels: the codes in column panels): the whole weight and the blocks budgets
    cut (views), one row (codes decoded in registers), a few (the tiles widen them) and many (a panel's
    block widened once; a bf16 prompt on bf16 dots), against the rows layout's own block; its dequantized
    values are the rows layout's exactly."""
    out, k = shape
    q = quantize_fp8(weight(shape, seed=5))
    panels = q.cpu_layout()
    assert type(panels).__name__ == "FP8Panels" and panels.cpu_layout() is panels
    for r0, r1, cols in views(out, k):
        view, rows_view = panels.block(r0, r1, cols), q.block(r0, r1, cols)
        dense = rows_view.dequantize(torch.float32)
        assert view.shape == (r1 - r0, cols) and torch.equal(view.dequantize(torch.float32), dense)
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        assert view.kernel_name("cpu", rows=rows) == "cpu_gemv"
        torch.testing.assert_close(view.linear(x), F.linear(x, dense), rtol=1e-5, atol=1e-4)
        assert view.step_weight().format == step.PANELS_FP8
        xb = x.bfloat16()
        torch.testing.assert_close(view.linear(xb), F.linear(xb.float(), dense).bfloat16(), rtol=1e-2, atol=1e-2)


def fp8_layouts():
    """FP8's two CPU layouts: [out, in] rows (as quantized or read) and column panels (a CPU load's)."""
    return pytest.mark.parametrize("layout", [lambda q: q, lambda q: q.cpu_layout()], ids=["rows", "panels"])


@fp8_layouts()
@pytest.mark.parametrize("size", [1e-3, 100.0, 300.0, 1e6, 1e30])
def test_fp8_decode_product_holds_for_inputs_of_any_size(size, layout):
    """The one-row product scales x by a power of two that keeps x times it finite (exactly 2^120 while
    every |x| < 128): small, large and huge inputs, one of them far above the rest, against the dequantized
    matmul."""
    w = weight((40, 100), seed=3)
    x = torch.randn(1, 100, generator=torch.Generator().manual_seed(7))
    x[0, 37] = size
    q = layout(quantize_fp8(w))
    ref = F.linear(x.double(), q.dequantize(torch.float64))
    torch.testing.assert_close(q.linear(x).double(), ref, rtol=1e-5, atol=1e-5 * size)


@fp8_layouts()
def test_fp8_subnormal_weights_survive_a_thread_that_flushes_subnormals(layout):
    """The decode product reads e4m3's subnormals as float32 subnormals; with torch.set_flush_denormal on,
    the calling thread's products still read them (the kernel clears the bit for its products)."""
    fp8 = layout(every_fp8_code(64))
    subnormal = torch.tensor([b for b in range(256) if b & 0x78 == 0 and b & 0x07])  # exponent 0, mantissa not
    dense = fp8.dequantize(torch.float32)
    assert torch.all(dense.flatten()[subnormal] != 0)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        got = torch.cat([fp8.linear(x[None]) for x in torch.eye(64)])  # one row at a time: the decode product
    finally:
        torch.set_flush_denormal(False)
    torch.testing.assert_close(got, dense.T, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [5, 130])
def test_fp8_panels_take_an_input_width_that_is_no_multiple_of_8(rows):
    """The decoded rows are transposed into the panels 8 x 8 at a time; the last K % 8 inputs one by one."""
    w = weight((29, 44), seed=2)
    x = torch.randn(rows, 44, generator=torch.Generator().manual_seed(rows))
    q = quantize_fp8(w)
    torch.testing.assert_close(q.linear(x), F.linear(x, q.dequantize(torch.float32)), rtol=1e-5, atol=1e-5)


def every_fp8_code(inputs: int):
    """An FP8 weight [256 / inputs, inputs] holding each of the 256 e4m3 codes once (subnormals, both zeros)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[[0x7F, 0xFF]] = 0x7E  # e4m3's two NaN codes, which the quantizer never writes
    fp8 = quantize_fp8(torch.ones(256 // inputs, inputs))
    fp8.weight = codes.view(256 // inputs, inputs).view(torch.float8_e4m3fn)
    return fp8


@fp8_layouts()
def test_every_fp8_code_and_nvfp4_code_decodes_exactly(layout):
    """One-hot inputs read single weights back: all 256 e4m3 codes (subnormals and both zeros), in rows of 16
    (the decode product's one-by-one tail) and of 64 (its blocks of 32), in rows and in panels, and every
    e2m1 code under every e4m3 block scale the quantizer can write, in rows of 32 (blocks of 16) and of 64
    (one block of 64)."""
    for inputs in (16, 64):
        fp8 = layout(every_fp8_code(inputs))
        dense = fp8.dequantize(torch.float32)
        for rows in (1, 4, 16):
            for i in range(0, inputs, rows):
                x = torch.eye(inputs)[i:i + rows]
                torch.testing.assert_close(fp8.linear(x), dense[:, i:i + rows].T, rtol=0, atol=0)

    for inputs in (32, 64):  # blocks of 16 one at a time; a block of 64 (four blocks decoded together)
        blocks = inputs // 16
        nv = quantize_nvfp4(torch.ones(128, inputs))  # every byte value 8 or 16 times
        nv.weight = torch.arange(128 * inputs // 2).remainder(256).to(torch.uint8).view(128, inputs // 2)
        scales = torch.arange(1, 127, dtype=torch.uint8)  # every positive finite e4m3 code (127 is NaN)
        nv.weight_scale = scales.repeat(5)[: 128 * blocks].view(128, blocks).view(torch.float8_e4m3fn)
        dense = nv.dequantize(torch.float32)
        for rows in (1, 16):  # the fused path, and the decode-once path of several rows
            for i in range(0, inputs, rows):  # the kernel rounds code * scale * scale_2 once, the dequantizer twice
                got = nv.linear(torch.eye(inputs)[i:i + rows])
                torch.testing.assert_close(got, dense[:, i:i + rows].T, rtol=2e-7, atol=0)


@pytest.mark.parametrize("inputs", [16, 32, 48, 80, 160])
def test_nvfp4_rows_four_at_a_time_take_every_leftover_row_count_and_short_tail(inputs, threads):
    """gemv.c's rows_nvfp4: four weight rows a group, the last group's missing rows standing in as repeats,
    and a row's last inputs % 64 decoded a block of each of four rows together; rows of fewer than 64 inputs
    eight a group (short_rows_nvfp4); in whole rows and in a budget's cut rows (ldw past the inputs read),
    1-8 rows and more, for 1-3 rows of x (each row its own product) and 5 (decode_nvfp4's panels: a row's last
    1-3 blocks decoded together); and W4A4's integer kernels alike."""
    from elastic_local.quant.nvfp4 import round_to_nvfp4

    w = weight((70, inputs + 32), seed=inputs)
    full, w4a4 = quantize_nvfp4(w), quantize_nvfp4(w)
    w4a4.quantize_inputs = True  # the same kernels' integer twins (short_rows_a4, rows_a4)
    for r0, r1 in ((0, 70), *((3, 3 + rows) for rows in range(1, 9)), (9, 66)):
        for cols in (inputs, inputs + 32):
            view, view4 = full.block(r0, r1, cols), w4a4.block(r0, r1, cols)
            for rows in (1, 2, 3, 5):
                x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + r1))
                ref = F.linear(x, view.dequantize(torch.float32))
                torch.testing.assert_close(view.linear(x), ref, rtol=1e-5, atol=1e-5)
                ref = round_to_nvfp4(x, None).double() @ view4.dequantize(torch.float64).T
                assert torch.allclose(view4.linear(x).double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("quantize", [None, quantize_fp8, quantize_nvfp4])
def test_budget_prefix_views_stream_without_copies(quantize):
    """A budget's block of a wider weight (rows r0:r1, the first `cols` inputs) is read in place."""
    w = weight((192, 320), seed=2)
    full = w if quantize is None else quantize(w)
    x = torch.randn(1, 160)
    if quantize is None:
        view = w[32:160, :160]
        assert not view.is_contiguous()
        ref = F.linear(x, view)
        torch.testing.assert_close(linear(x, view), ref, rtol=1e-5, atol=1e-5)
    else:
        view = full.block(32, 160, 160)
        assert view.weight.untyped_storage().data_ptr() == full.weight.untyped_storage().data_ptr()
        ref = F.linear(x, view.dequantize(torch.float32))
        torch.testing.assert_close(view.linear(x), ref, rtol=1e-5, atol=1e-5)


# (out, in) for the packed product: K over two panels of 256 rows with a tail, N over one group of eight
# 24-wide blocks with a narrower last block, both below one block
PACKED_SHAPES = [(200, 600), (23, 7), (1000, 40)]


@pytest.mark.parametrize("rows", [gemv.MAX_ROWS + 1, 13, 130, 300])
@pytest.mark.parametrize("shape", PACKED_SHAPES)
def test_many_rows_on_panel_float32_weights_and_views_equal_torch_matmul(shape, rows, threads):
    """A prompt's projections (gemv.c's tiles on the panels): row counts past one 128-row block of x and
    with every tail of its 4-row tiles, the whole weight and budget views, uneven thread shares."""
    from elastic_local.model.linear import Panels

    out, k = shape
    w = weight(shape, seed=5)
    panels = Panels.of(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    for r0, r1, cols in views(out, k):
        got = panels.block(r0, r1, cols).linear(x[:, :cols])
        torch.testing.assert_close(got, F.linear(x[:, :cols], w[r0:r1, :cols]), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 4, 7, 130, 300])
@pytest.mark.parametrize("shape", [(300, 80), (33, 1000), (5000, 700)])
def test_bf16_panels_give_exactly_the_float32_panels_results(shape, rows, threads):
    """BF16 weights kept in bf16 panels (a float32 load of a BF16 file on the kernels) are widened as they
    are read: every view, decode-sized and prompt-sized, sums exactly what the same weight upcast to float32
    panels sums (inputs past one 256-row slab of the tiles: 1000, 700)."""
    from elastic_local.model.linear import Panels

    out, k = shape
    w = weight(shape, seed=6).bfloat16()
    half, full = Panels.of(w), Panels.of(w.float())
    assert half.p.dtype == torch.bfloat16 and torch.equal(half.dense(), full.dense())
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    for r0, r1, cols in views(out, k):
        got = half.block(r0, r1, cols).linear(x[:, :cols])
        assert torch.equal(got, full.block(r0, r1, cols).linear(x[:, :cols])), (r0, r1, cols)
        torch.testing.assert_close(got, F.linear(x[:, :cols], w[r0:r1, :cols].float()), rtol=1e-5, atol=1e-4)


def bf16_dot_or_skip() -> None:
    if not gemv.bf16_dot():
        pytest.skip("this CPU has no AVX512-BF16 dot products: bf16 prompts widen to float32 (tested above)")


def float32_sum_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|error| of any float32 sum of x @ w.T's K exact products, in any order: K u sum_k |x_k w_k|."""
    return x.shape[-1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("rows", [5, 8, 13, 130, 300])
@pytest.mark.parametrize("shape", [(300, 80), (33, 1000), (5000, 700)])
def test_a_bf16_prompt_on_bf16_dot_products_sums_its_exact_products_in_float32(shape, rows, threads):
    """gemm_p_bf16x (AVX512-BF16): every view of a bf16 panel weight, prompt-sized rows of bf16 x (past 8-row
    tiles, a 128-row block and a 256-input slab), within a float32 sum's error bound of the exact products
    (the widening path's bound too), and rounded to bf16 through Panels.linear as torch's bf16 matmul is."""
    from elastic_local.model.linear import Panels

    bf16_dot_or_skip()
    out, k = shape
    w = weight(shape, seed=7).bfloat16()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    p = Panels.of(w)
    for r0, r1, cols in views(out, k):
        cols -= cols % 2  # even inputs: an odd count takes the widening path (next test)
        v, xs = p.block(r0, r1, cols), x[:, :cols].contiguous()
        y = torch.empty(rows, r1 - r0)
        assert gemv.library().gemm_p_bf16x(xs.data_ptr(), v.p.data_ptr(), y.data_ptr(), rows, r1 - r0, cols,
                                           v.p.stride(0), v.skip, threads) == 0
        exact = xs.double() @ w[r0:r1, :cols].double().T
        assert ((y.double() - exact).abs() <= float32_sum_bound(xs, w[r0:r1, :cols])).all(), (r0, r1, cols)
        torch.testing.assert_close(v.linear(xs), y.bfloat16(), rtol=0, atol=0)


def test_bf16_prompts_take_the_dot_products_only_where_they_can(monkeypatch):
    """Where the CPU has them: a bf16 prompt of an even input count on bf16 panels; an odd count, float32 x,
    a decode row or ELASTIC_LOCAL_BF16_DOT=0 widen to float32 instead. Inputs below bf16's normal range
    count as zero there (the instruction's DAZ, as gemv.c says)."""
    from elastic_local.model.linear import Panels

    bf16_dot_or_skip()
    spy = Spy(gemv.library())
    monkeypatch.setattr(gemv, "_library", spy)
    w = weight((48, 64)).bfloat16()
    p = Panels.of(w)
    x = torch.randn(9, 64).bfloat16()
    for view, xs in ((p, x), (p.block(0, 48, 63), x[:, :63]), (p, x.float()), (p, x[:1])):
        spy.called.clear()
        view.linear(xs)
        assert [c for c in spy.called if c.startswith("gem")] == (
            ["gemm_p_bf16x"] if xs is x else ["gemv_p_bf16"] if len(xs) == 1 else ["gemm_p_bf16"])
    monkeypatch.setenv(gemv.BF16_DOT_ENV, "0")
    spy.called.clear()
    p.linear(x)
    assert "gemm_p_bf16x" not in spy.called and "gemm_p_bf16" in spy.called
    y = torch.empty(8, 24)
    assert gemv.library().gemm_p_bf16x(x.data_ptr(), p.p.data_ptr(), y.data_ptr(), 8, 24, 63, p.p.stride(0), 0, 1) == -2
    tiny = Panels.of(torch.full((24, 16), 1e30).bfloat16())
    sub = torch.full((8, 16), 1e-39).bfloat16()  # subnormal in bf16
    assert gemv.library().gemm_p_bf16x(sub.data_ptr(), tiny.p.data_ptr(), y.data_ptr(), 8, 24, 16, tiny.p.stride(0),
                                       0, 1) == 0
    assert (y == 0).all()


@pytest.mark.parametrize("rows", [4, 9, 130, 300])
@pytest.mark.parametrize("shape", SHAPES + [(3608, 768)])
def test_a_bf16_prompt_on_packed_weights_sums_their_exact_products_on_the_bf16_dots(shape, rows, threads):
    """gemm_packed_bf16x: FP8 and NVFP4 rows decoded unscaled (exact in bf16), on the bf16 dots, the scale on
    the sums: within a float32 sum's error bound of the exact products, plus the scale's rounding; and what
    the formats' linear returns for a bf16 prompt (NVFP4's inputs permuted as its decode orders them)."""
    bf16_dot_or_skip()
    w = weight(shape, seed=3)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
    for q in (quantize_fp8(w), quantize_nvfp4(w)):
        wd = q.dequantize(torch.float32)
        fp8 = q.weight.dtype == torch.float8_e4m3fn
        codes = q.weight.view(torch.uint8)
        scales = None if fp8 else q.weight_scale.view(torch.uint8)
        y = torch.empty(rows, shape[0])
        assert gemv.library().gemm_packed_bf16x(
            gemv._FP8 if fp8 else gemv._NVFP4, x.data_ptr(), codes.data_ptr(), 0 if fp8 else scales.data_ptr(),
            y.data_ptr(), rows, shape[0], shape[1], codes.stride(0), 0 if fp8 else scales.stride(0),
            (q.weight_scale if fp8 else q.weight_scale_2).item(), threads) == 0
        exact = x.double() @ wd.double().T
        bound = float32_sum_bound(x, wd) + 2.0**-23 * exact.abs()
        assert ((y.double() - exact).abs() <= bound).all(), q
        torch.testing.assert_close(q.linear(x), y.bfloat16(), rtol=0, atol=0)


def test_bf16_prompts_on_packed_weights_take_the_dots_only_where_they_can(monkeypatch):
    """From MAX_ROWS rows of bf16 x on FP8 / NVFP4 weights the dots; fewer rows, float32 x or
    ELASTIC_LOCAL_BF16_DOT=0 the float32 kernels."""
    bf16_dot_or_skip()
    spy = Spy(gemv.library())
    monkeypatch.setattr(gemv, "_library", spy)
    w = weight((48, 64))
    x = torch.randn(gemv.MAX_ROWS, 64).bfloat16()
    for q, kernel in ((quantize_fp8(w), "gemv_fp8"), (quantize_nvfp4(w), "gemv_nvfp4")):
        for xs, want in ((x, "gemm_packed_bf16x"), (x[:-1], kernel), (x.float(), kernel)):
            spy.called.clear()
            q.linear(xs)
            assert [c for c in spy.called if c.startswith("gem")] == [want]
        monkeypatch.setenv(gemv.BF16_DOT_ENV, "0")
        spy.called.clear()
        q.linear(x)
        assert [c for c in spy.called if c.startswith("gem")] == [kernel]
        monkeypatch.delenv(gemv.BF16_DOT_ENV)


class Spy:
    """The kernels' library, noting which entry points are called."""

    def __init__(self, lib):
        self.lib, self.called = lib, []

    def __getattr__(self, name: str):
        self.called.append(name)
        return getattr(self.lib, name)


def test_decode_rows_take_the_matvec_and_more_rows_the_blocked_product(monkeypatch):
    """Panel weights: up to MAX_ROWS rows the decode kernel, more the blocked product, inside a compiled
    step too (through the opaque op); [out, in] weights take torch's matmul past MAX_ROWS; weights being
    trained take torch's op."""
    from elastic_local.model.linear import Panels

    w = weight((64, 64))
    spy = Spy(gemv.library())
    monkeypatch.setattr(gemv, "_library", spy)
    for layout in (w, Panels.of(w)):
        for rows in (gemv.MAX_ROWS, gemv.MAX_ROWS + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(linear(x, layout), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert spy.called == ["gemv_f32", "gemv_p_f32", "gemm_p_f32"]
    spy.called.clear()
    with monkeypatch.context() as p:  # a compiled step: the custom ops, which call the same kernels
        p.setattr(torch.compiler, "is_compiling", lambda: True)
        for rows in (1, gemv.MAX_ROWS + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(Panels.of(w).linear(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert spy.called == ["gemv_p_f32", "gemm_p_f32"]
    spy.called.clear()
    w.requires_grad_(True)  # training: autograd needs torch's op
    linear(torch.randn(1, 64), w)
    assert spy.called == []


def test_a_missing_compiler_warns_and_torch_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTIC_LOCAL_HOME", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(gemv, "_library", False)
    with pytest.warns(UserWarning, match="CPU decode kernels unavailable.*no C compiler"):
        assert gemv.library() is None
    w = weight((32, 64))
    x = torch.randn(1, 64)
    assert not gemv.usable(x)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
    q = quantize_fp8(w)
    assert q.kernel_name("cpu") == "dequant_matmul"
    torch.testing.assert_close(q.linear(x), F.linear(x, q.dequantize(torch.float32)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("script, message", [
    ("echo 'cc: error: unrecognized option' >&2\nexit 1\n", "cc: error: unrecognized option"),
    # the sources compile (in parallel), the link fails
    ('case " $* " in *" -c "*) shift $(($# - 1)); : > "$1"; exit 0;; esac\n'
     "echo 'ld: cannot find -lm' >&2\nexit 1\n", "ld: cannot find -lm"),
], ids=["compile", "link"])
def test_a_compiler_error_names_the_compiler_and_leaves_nothing(monkeypatch, tmp_path, script, message):
    fake_cc = tmp_path / "cc"
    fake_cc.write_text("#!/bin/sh\n" + script)
    fake_cc.chmod(0o755)
    monkeypatch.setenv("ELASTIC_LOCAL_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(fake_cc))
    monkeypatch.setattr(gemv, "_library", False)
    with pytest.warns(UserWarning, match=f"cc failed: {message}"):
        assert gemv.library() is None
    assert not list((tmp_path / "cache" / "kernels").iterdir())  # no objects, no half-written library


def test_a_corrupt_cached_library_is_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTIC_LOCAL_HOME", str(tmp_path))
    monkeypatch.setattr(gemv, "_library", False)
    cached = gemv.library_path()
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"\x7fELF" + bytes(60))  # a truncated build
    lib = gemv.library()
    assert lib is not None and cached.stat().st_size > 1000
    w, x = weight((48, 64)), torch.randn(1, 64)
    torch.testing.assert_close(gemv.matvec(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_both_layouts_decode_every_budget_like_torch_matmul(tmp_path, monkeypatch):
    """Both CPU float32 layouts on the kernels (the default column panels and ELASTIC_LOCAL_CPU_LAYOUT=rows):
    every budget decodes the tokens that the stored [out, in] weights give with the kernels off (torch's
    matmul)."""
    from test_compiled_decode import decode
    from tiny import ALIGNED

    from elastic_local.elastic.nest import nest
    from elastic_local.engine.load import LAYOUT_ENV
    from elastic_local.model.linear import Panels

    make_checkpoint(tmp_path / "parent", seed=3, **ALIGNED)
    nested = nest(tmp_path / "parent", tmp_path / "nested", {"half": 0.5})

    def panels(m) -> bool:
        return any(isinstance(w, Panels) for layer in m.net.layers for w in vars(layer.mixer).values())

    m_default = elastic_local.load(nested)
    monkeypatch.setenv(LAYOUT_ENV, "rows")
    m_rows = elastic_local.load(nested)
    assert panels(m_default) and not panels(m_rows)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (9,), generator=g), torch.randint(0, 96, (4,), generator=g)]
    kernels = gemv.library()
    monkeypatch.setattr(step, "build", lambda net, b: None)  # the layers' products, not the C step's rows
    with torch.inference_mode():
        for name in m_default.budgets:
            monkeypatch.setattr(gemv, "_library", None)  # the reference: torch's path throughout
            want_logits, want = decode(m_rows.net, m_rows.budget(name), prompts, 6)
            for m, entry in ((m_default, "gemv_p_f32"), (m_rows, "gemv_f32")):
                spy = Spy(kernels)
                monkeypatch.setattr(gemv, "_library", spy)
                got_logits, got = decode(m.net, m.budget(name), prompts, 6)
                assert entry in spy.called, "the decode steps did not reach the kernels"
                assert torch.equal(got, want), name
                for a, b in zip(got_logits, want_logits):
                    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_bf16_file_loads_into_bf16_panels_and_decodes_like_its_float32_weights(tmp_path, monkeypatch, threads):
    """A float32 CPU load of a BF16 checkpoint keeps its Linear weights and LM head in bf16 column panels
    (half of float32's memory; embeddings and norms in float32). Every budget then decodes what the same
    weights give in float32 on torch's path (kernels off): batched steps (the panels' entry points) and one
    sequence (the C step), token for token."""
    from test_compiled_decode import decode
    from tiny import ALIGNED

    from elastic_local.elastic.nest import nest
    from elastic_local.model.linear import Panels, Transposed

    make_checkpoint(tmp_path / "f32", seed=3, **ALIGNED).to(torch.bfloat16).save_pretrained(tmp_path / "parent")
    nested = nest(tmp_path / "parent", tmp_path / "nested", {"half": 0.5})
    kernels = gemv.library()
    m = elastic_local.load(nested)
    weights = [w for layer in m.net.layers for w in vars(layer.mixer).values() if isinstance(w, Panels)]
    assert weights and {w.p.dtype for w in weights} == {m.net.lm_head.p.dtype} == {torch.bfloat16}
    assert m.net.embed.dtype == torch.float32
    monkeypatch.setattr(gemv, "_library", None)
    ref = elastic_local.load(nested)  # where the kernels do not run the bf16 weights are widened
    assert isinstance(ref.net.lm_head, Transposed) and ref.net.lm_head.t.dtype == torch.float32
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (9, 4)]
    with torch.inference_mode():
        for name in m.budgets:
            monkeypatch.setattr(gemv, "_library", None)
            want_logits, want = decode(ref.net, ref.budget(name), prompts, 6)
            want_one = ref.generate(prompts[0].tolist(), answer_budget=name, think_budget=name,
                                    max_think_tokens=3, max_answer_tokens=6, ignore_eos=True).ids
            spy = Spy(kernels)
            monkeypatch.setattr(gemv, "_library", spy)
            with monkeypatch.context() as p:  # the layers' products, not the C step's rows
                p.setattr(step, "build", lambda net, b: None)
                m.net.c_steps.clear()
                got_logits, got = decode(m.net, m.budget(name), prompts, 6)
            m.net.c_steps.clear()
            assert "gemv_p_bf16" in spy.called and "gemm_p_bf16" in spy.called
            assert torch.equal(got, want), name
            for a, b in zip(got_logits, want_logits):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            assert m.generate(prompts[0].tolist(), answer_budget=name, think_budget=name, max_think_tokens=3,
                              max_answer_tokens=6, ignore_eos=True).ids == want_one, name
            assert m.net.c_steps[m.budget(name)] is not None  # the one sequence ran in the C step


def test_loading_builds_the_kernels_in_the_background(monkeypatch, tmp_path):
    """The first run after an install: `load` starts the build before it reads the weights, then waits for
    it, saying so, and picks the float32 layout by the library that build made (compiled once, on the
    background thread)."""
    from elastic_local.model.linear import Panels
    from elastic_local.paths import DEMO_MODEL

    monkeypatch.setenv("ELASTIC_LOCAL_HOME", str(tmp_path))
    monkeypatch.setattr(gemv, "_library", False)
    started, builds, said, weights_read, compile_ = [], [], [], threading.Event(), gemv._compile
    prebuild = gemv.prebuild

    def slow_compile(*a):  # still building when the weights are read
        builds.append(threading.current_thread().name)
        weights_read.wait(60)
        return compile_(*a)

    def progress(done: int, total: int, what: str) -> None:
        said.append(what)
        if what == "done":
            weights_read.set()

    monkeypatch.setattr(gemv, "prebuild", lambda: started.append(prebuild()) or started[-1])
    monkeypatch.setattr(gemv, "_compile", slow_compile)
    m = elastic_local.load(DEMO_MODEL, progress=progress)
    assert isinstance(started[0], threading.Thread)
    assert builds == ["elastic-kernels-build"] and gemv.library() is not None
    assert said[-1] == "building the CPU kernels (once per install)"
    assert isinstance(m.net.lm_head, Panels)
    assert gemv.prebuild() is None  # loaded: nothing left to build


# ---------------------------------------------------------------------------------------------- W4A4


def w4a4_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose blocks span what NVFP4's rounding meets: rows from 1e-3 to 1e3, a zero block, a block
    whose e4m3 scale is subnormal and one whose scale is clamped to e4m3's least (ties: the test below)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[0, :16] = 0
    if k > 32:
        x[-1, 16:32] *= 2e-5  # against the row's amax, this block's e4m3 scale is subnormal (about 2^-7)
    if k > 48:
        x[-1, 32:48] *= 1e-7  # and this one's below e4m3's least, 2^-9: clamped to it
    return x


@pytest.mark.parametrize("k", [16, 48, 64, 112, 256, 272, 784])
def test_w4a4_rounds_inputs_as_modelopt_s_dynamic_nvfp4_and_to_the_nearest_grid_value(k):
    from elastic_local.quant.nvfp4 import E2M1_VALUES, round_to_nvfp4

    x = w4a4_inputs(5, k, seed=k)
    for input_scale in (None, torch.tensor(x.abs().max().item() / 2688)):
        ref = round_to_nvfp4(x, input_scale)  # quantize_blocks, modelopt's op for op
        assert torch.equal(gemv.nvfp4_round(x, 0.0 if input_scale is None else input_scale.item()), ref)
        # independently of the codes: each block's unit is its amax / 6 in e4m3 (torch's cast) under the row's
        # scale, and every value is the grid value nearest x at that unit
        s2 = (x.abs().amax(-1, keepdim=True) / 2688).clamp_min(torch.finfo(torch.float32).tiny) \
            if input_scale is None else input_scale
        blocks = x.unflatten(-1, (-1, 16))
        scale = (blocks.abs().amax(-1) / (6 * s2)).clamp(2**-9, 448).to(torch.float8_e4m3fn).float()
        unit = torch.where(blocks.abs().amax(-1) == 0, 1.0, scale) * s2
        levels = torch.tensor(E2M1_VALUES)[None, None, None, :] * unit[..., None, None]
        nearest = (blocks[..., None] - levels).abs().min(-1).values
        assert torch.all((blocks - ref.unflatten(-1, (-1, 16))).abs() <= nearest + 1e-6 * unit[..., None])


def test_w4a4_rounds_a_tie_to_the_even_code_as_modelopt_does():
    """Inputs exactly between two e2m1 values, at a unit pinned exactly (a block whose amax is 6 units under
    a power-of-two input_scale, so its e4m3 scale is 1): each tie goes to the even code, the lower value at
    0.25, 1.25, 2.5 and 5 units, the upper at 0.75, 1.75 and 3.5."""
    from elastic_local.quant.nvfp4 import round_to_nvfp4

    unit = 2.0**-4
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([torch.tensor([6.0]), ties, -ties, torch.tensor([0.0])])[None] * unit
    want = torch.cat([torch.tensor([6.0]), torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]),
                      -torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]), torch.tensor([0.0])])[None] * unit
    assert torch.equal(gemv.nvfp4_round(x, unit), want)
    assert torch.equal(round_to_nvfp4(x, torch.tensor(unit)), want)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, gemv.MAX_PACKED_ROWS])
@pytest.mark.parametrize("shape", [(96, 256), (37, 48), (300, 80), (61, 272), (8, 784)])
def test_w4a4_products_equal_the_matmul_of_the_rounded_inputs(shape, rows, threads):
    """Up to 7 rows take gemv.c's integer products a row at a time (four weight rows at a time, a last 1-3,
    tail blocks past a multiple of 64); 8 and more the weight-only kernels on the rounded inputs: both the
    same sums."""
    from elastic_local.quant.nvfp4 import round_to_nvfp4

    w = weight(shape, seed=3)
    x = w4a4_inputs(rows, shape[1], seed=rows) if rows > 1 else torch.randn(1, shape[1])
    for input_scale in (None, torch.tensor(2.0 / 2688)):
        q = quantize_nvfp4(w)
        q.input_scale, q.quantize_inputs = input_scale, True
        ref = round_to_nvfp4(x, input_scale).double() @ q.dequantize(torch.float64).T
        got = q.linear(x)
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        # a budget's prefix view (rows ldw bytes apart, K cut) and the dequantizing path past the kernels
        view = q.block(0, shape[0] // 2 + 1, 16 * (shape[1] // 32 or 1))
        xv = x[:, : view.shape[1]].contiguous()
        ref = round_to_nvfp4(xv, input_scale).double() @ view.dequantize(torch.float64).T
        assert torch.allclose(view.linear(xv).double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    long = torch.randn(gemv.MAX_PACKED_ROWS + 1, shape[1])
    assert q.kernel_name("cpu", rows=len(long)) == "dequant_matmul"
    ref = round_to_nvfp4(long, q.input_scale) @ q.dequantize(torch.float32).T
    torch.testing.assert_close(q.linear(long), ref, rtol=1e-5, atol=1e-4)


def test_w4a4_rows_are_rounded_each_on_its_own_scale():
    """Without a calibrated input_scale a row's numbers never depend on the rows beside it (a batch's)."""
    q = quantize_nvfp4(weight((40, 64), seed=4))
    q.quantize_inputs = True
    x = torch.randn(3, 64)
    before = q.linear(x)
    alone = q.linear(x[:1])
    x[1:] *= 1000  # other rows far larger
    assert torch.equal(q.linear(x)[0], before[0])
    torch.testing.assert_close(alone[0], before[0], rtol=1e-5, atol=1e-6)
