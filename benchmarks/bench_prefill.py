"""CPU prefill: gemv.c's products on float32 weights in column panels against torch's matmul (MKL) on the
plain transpose, product by product, side by side in one process.

    .venv/bin/python benchmarks/bench_prefill.py [--configs 30m,100m] [--reps 9] [--threads 2]

Every distinct float32 projection of the config (linear.Panels: Mamba's in_proj and out_proj,
attention's, the shared expert's), x of 16 / 128 / 1024 rows (a short prompt, the benchmark prompt, a
prefill chunk), and a budget's view (half the outputs of the widest): `x @ t` on the contiguous
transpose t [in, out] against `Panels.linear`, alternated rep by rep: GFLOP/s medians and the ratio.
Whole prompts against an earlier revision: bench_revs.py (each revision's own layout and code).
"""

from __future__ import annotations

import argparse
import dataclasses
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="30m,100m")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import elastic_local
    from elastic_local.model import gemv

    if gemv.library() is None:
        raise SystemExit("the CPU kernels are unavailable here (see the warning): nothing to compare")
    print(f"{args.threads} threads; torch {torch.__version__}")
    for name in args.configs.split(","):
        with torch.inference_mode():
            products(elastic_local.load(str(bench_ab.checkpoint(name))), name, args.reps)


if __name__ == "__main__":
    main()
