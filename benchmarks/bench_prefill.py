"""CPU prefill: gemv.c's products on float32 weights in column panels against torch's matmul (MKL) on the
plain transpose, product by product, side by side in one process.

    .venv/bin/python benchmarks/bench_prefill.py [--configs 30m,100m] [--reps 9] [--threads 2] [--bf16]
    .venv/bin/python benchmarks/bench_prefill.py --short [--configs demo,gen,100m]

Every distinct float32 projection of the config (linear.Panels: Mamba's in_proj and out_proj,
attention's, the shared expert's), x of 16 / 128 / 1024 rows (a short prompt, the benchmark prompt, a
prefill chunk), and a budget's view (half the outputs of the widest): `x @ t` on the contiguous
transpose t [in, out] against `Panels.linear`, alternated rep by rep: GFLOP/s medians and the ratio.
With --bf16, the same products in bfloat16 (bf16 x on the weight's bf16 panels, as a bfloat16 load of a BF16
file runs them): torch's bf16 matmul, the panels widened to float32 FMAs (ELASTIC_LOCAL_BF16_DOT=0) and the
panels on the CPU's bf16 dot products (AVX512-BF16, gemv.c's gemm_p_bf16x); then whole prompts of 128 and
512 tokens of the config loaded in bfloat16, in BF16, FP8 and NVFP4 (gemm_packed_bf16x), the dots off and on.
Whole prompts against an earlier revision: bench_revs.py (each revision's own layout and code).
With --short, only prompts of 2-64 tokens of one sequence: the C step's rows (model/step.c's decode_rows,
which `forward` runs up to step.PREFILL_ROWS tokens) against the torch layers, whole prompts alternated.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ab  # noqa: E402

ROWS = (16, 128, 1024)


def alternate(fns: dict, reps: int, inner: int) -> dict[str, float]:
    """Median seconds per call of each function, the functions alternated within every rep."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps + 1):  # the first round warms up
        for name, fn in fns.items() if rep % 2 else reversed(fns.items()):
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            if rep:
                times[name].append((time.perf_counter() - t) / inner)
    return {name: median(v) for name, v in times.items()}


def projections(m) -> list:
    """The distinct float32 weights in panels (one per shape) of the model's layers."""
    from elastic_local.model.linear import Panels

    seen: dict[tuple, Panels] = {}
    for layer in m.net.layers:
        if layer.mixer is None:
            continue
        for f in dataclasses.fields(layer.mixer):
            w = getattr(layer.mixer, f.name)
            if isinstance(w, Panels) and w.p.ndim == 3:
                seen.setdefault(w.shape, w)
    return list(seen.values())


def products(m, name: str, reps: int) -> None:
    ws = projections(m)
    widest = max(ws, key=lambda w: w.shape[0])
    cases = [(w, f"{w.shape[1]}x{w.shape[0]}") for w in ws]
    cases.append((widest.block(0, widest.shape[0] // 2, widest.shape[1]),
                  f"{widest.shape[1]}x{widest.shape[0] // 2} view"))
    print(f"\n[{name}] products x [rows, in] @ W^T [in, out], GFLOP/s (median of {reps}), panels / torch")
    print(f"{'weight [in, out]':>22} " + "  ".join(f"{r:>4} rows: torch  panels  ratio" for r in ROWS))
    for w, label in cases:
        t = w.dense().contiguous()  # torch's best case: its own contiguous layout
        cells = []
        for rows in ROWS:
            x = torch.randn(rows, t.shape[0])
            torch.testing.assert_close(w.linear(x), x @ t, rtol=1e-4, atol=1e-3)
            flop = 2 * rows * t.shape[0] * t.shape[1]
            s = alternate({"torch": lambda x=x, t=t: x @ t, "panels": lambda x=x, w=w: w.linear(x)}, reps,
                          max(1, int(2e8 // flop)))
            cells.append(f"{'':>10}{flop / s['torch'] / 1e9:6.1f}  {flop / s['panels'] / 1e9:6.1f}  "
                         f"{s['torch'] / s['panels']:5.2f}x")
        print(f"{label:>22} " + "  ".join(cells))


@contextlib.contextmanager
def bf16_dot(on: bool):
    """The bf16 dot products (gemv.bf16_dot) on or off for what runs inside."""
    from elastic_local.model import gemv

    before = os.environ.get(gemv.BF16_DOT_ENV)
    os.environ[gemv.BF16_DOT_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[gemv.BF16_DOT_ENV]
        else:
            os.environ[gemv.BF16_DOT_ENV] = before


def bf16_products(m, name: str, reps: int) -> None:
    """The same products in bfloat16 (a bfloat16 load's prompt on a BF16 file's bf16 panels): torch's bf16
    matmul on the contiguous transpose, the panels widened to float32 FMAs, and the panels on bf16 dots."""
    from elastic_local.model.linear import Panels

    print(f"\n[{name}] bfloat16 products, GFLOP/s (median of {reps}): torch, panels widened, panels on bf16 dots")
    print(f"{'weight [in, out]':>22} " + "  ".join(f"{r:>4} rows: torch  widen    dot  dot/widen  dot/torch"
                                                  for r in ROWS))
    for w in projections(m):
        t = w.dense().bfloat16().contiguous()
        p = Panels.of(t.T)
        cells = []
        for rows in ROWS:
            x = torch.randn(rows, t.shape[0]).bfloat16()
            with bf16_dot(True):
                torch.testing.assert_close(p.linear(x).float(), (x @ t).float(), rtol=0.02, atol=0.02)
            flop = 2 * rows * t.shape[0] * t.shape[1]

            def on(dot: bool, x=x, p=p):
                with bf16_dot(dot):
                    return p.linear(x)
            s = alternate({"torch": lambda x=x, t=t: x @ t, "widen": lambda: on(False), "dot": lambda: on(True)},
                          reps, max(1, int(2e8 // flop)))
            g = {k: flop / v / 1e9 for k, v in s.items()}
            cells.append(f"{'':>10}{g['torch']:6.1f} {g['widen']:6.1f} {g['dot']:6.1f} {g['dot'] / g['widen']:9.2f}x "
                         f"{g['dot'] / g['torch']:9.2f}x")
        print(f"{w.shape[1]}x{w.shape[0]:<{21 - len(str(w.shape[1]))}} " + "  ".join(cells))


def bf16_prompts(path, name: str, reps: int) -> None:
    """Whole prompts of a bfloat16 load (the CPU's load where float32 does not fit), its weights in BF16 and
    quantized to FP8 / NVFP4 while loading, bf16 dots on and off, alternated: tok/s of a forward over the
    prompt into a fresh cache."""
    import elastic_local

    print(f"\n[{name}] bfloat16 load, whole prompts, tok/s (median of {reps}): bf16 dots off / on")
    for precision in ("bf16", "fp8", "nvfp4"):
        m = elastic_local.load(str(path), dtype=torch.bfloat16, precision=precision)
        for n in (128, 512):
            ids = torch.randint(10, m.net.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))

            def prompt(dot: bool, ids=ids, m=m):
                with bf16_dot(dot):
                    m.forward(ids, cache=m.new_cache(batch_size=1), last_only=True)
            s = alternate({"off": lambda: prompt(False), "on": lambda: prompt(True)}, reps, 1)
            print(f"{precision:>6} {n:>4} tokens: {n / s['off']:8.1f} / {n / s['on']:8.1f}  "
                  f"({s['off'] / s['on']:.2f}x)")


def short_prompts(m, name: str, reps: int) -> None:
    """One sequence's prompt of 2-64 tokens into a fresh cache, the C step's rows (`DecodeStep.prefill`: what
    `forward` runs up to step.PREFILL_ROWS tokens) against the torch layers, on the largest and smallest
    budget, alternated rep by rep: milliseconds (medians of reps, 3 prompts each) and the speed-up."""
    from unittest import mock

    from elastic_local.model import step

    print(f"\n{name}: short prompts, C step rows against the torch layers (ms, medians of {reps})")
    for T in (2, 4, 8, 16, 32, 64):
        ids = torch.randint(3, min(999, m.config.vocab_size), (1, T), generator=torch.Generator().manual_seed(T))
        for budget in dict.fromkeys((m.budgets[0], m.budgets[-1])):
            times: dict[str, list[float]] = {"c": [], "torch": []}
            for _ in range(reps):
                for side in times:
                    with mock.patch.object(step, "PREFILL_ROWS", step.PREFILL_ROWS if side == "c" else 0):
                        t = time.perf_counter()
                        for _ in range(3):
                            m.forward(ids, cache=m.new_cache(1, budget=budget), last_only=True)
                        times[side].append((time.perf_counter() - t) / 3)
            c, t = median(times["c"]), median(times["torch"])
            print(f"  {T:>3} tokens  {budget:<6} C {1e3 * c:8.3f}  torch {1e3 * t:8.3f}  C x{t / c:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="30m,100m")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--bf16", action="store_true", help="also the products and whole prompts in bfloat16, bf16 "
                   "dot products (AVX512-BF16) against the panels widened to float32")
    p.add_argument("--short", action="store_true", help="only short prompts: the C step's rows against the torch "
                   "layers (configs may include demo and gen)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import elastic_local
    from elastic_local.model import gemv

    if gemv.library() is None:
        raise SystemExit("the CPU kernels are unavailable here (see the warning): nothing to compare")
    print(f"{args.threads} threads; torch {torch.__version__}")
    for name in args.configs.split(","):
        path = bench_ab.checkpoint(name)
        with torch.inference_mode():
            m = elastic_local.load(str(path))
            if args.short:
                short_prompts(m, name, args.reps)
                continue
            products(m, name, args.reps)
            if args.bf16:
                if not gemv.bf16_dot():
                    raise SystemExit("--bf16: this CPU has no AVX512-BF16 dot products")
                bf16_products(m, name, args.reps)
                bf16_prompts(path, name, args.reps)


if __name__ == "__main__":
    main()
