"""CPU prefill: gemv.c's packed-panel products against torch's matmul (MKL), product by product, and whole
prompts against an earlier revision's kernels, side by side in one process.

    .venv/bin/python benchmarks/bench_prefill.py [--configs 30m,100m] [--base REV] [--precisions f32,nvfp4]

Products: every distinct float32 projection of the config ([in, out], linear.Transposed: Mamba's in_proj
and out_proj, attention's, the shared expert's), x of 16 / 128 / 1024 rows (a short prompt, the benchmark
prompt, a prefill chunk) and a budget's strided view (half the outputs of the widest), `x @ t` against
`gemv.matmul_t`, alternated rep by rep: GFLOP/s medians and the ratio.

Whole prompts (with `--base`): a prompt of --prompt tokens through `forward` on bench_decode's checkpoints,
the working tree's kernels against `--base`'s (bench_ab.build), alternated. A base
without the packed product (before it was added) runs its many-row projections on torch's matmul, as that
revision did; its experts run that revision's C. The working tree's Python runs both sides.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import sys
import tempfile
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


def projections(m) -> list[torch.Tensor]:
    """The distinct [in, out] float32 weights (one per shape) of the model's layers."""
    from elastic_local.model.linear import Transposed

    seen: dict[tuple, torch.Tensor] = {}
    for layer in m.net.layers:
        if layer.mixer is None:
            continue
        for f in dataclasses.fields(layer.mixer):
            w = getattr(layer.mixer, f.name)
            if isinstance(w, Transposed) and w.t.ndim == 2:
                seen.setdefault(tuple(w.t.shape), w.t)
    return list(seen.values())


def products(m, name: str, reps: int) -> None:
    from elastic_local.model import gemv

    ts = projections(m)
    widest = max(ts, key=lambda t: t.shape[1])
    cases = [(t, f"{t.shape[0]}x{t.shape[1]}") for t in ts]
    cases.append((widest[:, : widest.shape[1] // 2], f"{widest.shape[0]}x{widest.shape[1] // 2} view"))
    print(f"\n[{name}] products x [rows, in] @ t [in, out], GFLOP/s (median of {reps}), packed / torch")
    print(f"{'weight [in, out]':>22} " + "  ".join(f"{r:>4} rows: torch  packed  ratio" for r in ROWS))
    for t, label in cases:
        cells = []
        for rows in ROWS:
            x = torch.randn(rows, t.shape[0])
            torch.testing.assert_close(gemv.matmul_t(x, t), x @ t, rtol=1e-4, atol=1e-3)
            flop = 2 * rows * t.shape[0] * t.shape[1]
            s = alternate({"torch": lambda x=x, t=t: x @ t, "packed": lambda x=x, t=t: gemv.matmul_t(x, t)}, reps,
                          max(1, int(2e8 // flop)))
            cells.append(f"{'':>10}{flop / s['torch'] / 1e9:6.1f}  {flop / s['packed'] / 1e9:6.1f}  "
                         f"{s['torch'] / s['packed']:5.2f}x")
        print(f"{label:>22} " + "  ".join(cells))


def whole_prompts(m, name: str, libs: dict[str, ctypes.CDLL], prompt: int, reps: int) -> None:
    from elastic_local.model import gemv

    ids = torch.randint(3, 999, (1, prompt), generator=torch.Generator().manual_seed(0))
    packed = gemv.matmul_t

    def side(lib: ctypes.CDLL):
        def run():
            gemv._library = lib
            gemv.matmul_t = packed if hasattr(lib, "gemm_t_f32") else (lambda x, t: x @ t)
            m.forward(ids, cache=m.new_cache(batch_size=1), last_only=True)
        return run

    try:
        with torch.inference_mode():
            s = alternate({n: side(lib) for n, lib in libs.items()}, reps, 2)
    finally:
        gemv._library, gemv.matmul_t = libs["tree"], packed
    print(f"[{name}] prompt of {prompt}: base {prompt / s['base']:6.1f} tok/s  tree {prompt / s['tree']:6.1f} "
          f"tok/s  tree / base {s['base'] / s['tree']:.3f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="30m,100m")
    p.add_argument("--base", help="git revision whose kernels the whole prompts run against")
    p.add_argument("--precisions", default="f32", help="whole prompts: f32, fp8, nvfp4 (comma-separated)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import elastic_local
    from elastic_local.model import gemv

    if gemv.library() is None:
        raise SystemExit("the CPU kernels are unavailable here (see the warning): nothing to compare")
    print(f"{args.threads} threads; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        libs = None
        if args.base:
            libs = {"base": bench_ab.build(args.base, Path(tmp)), "tree": gemv.library()}
        for name in args.configs.split(","):
            path = str(bench_ab.checkpoint(name))
            with torch.inference_mode():
                products(elastic_local.load(path), name, args.reps)
            if libs:
                print(f"\n[{name}] whole prompts, {args.base} (base) against the working tree")
                for precision in args.precisions.split(","):
                    m = elastic_local.load(path, precision=None if precision == "f32" else precision)
                    whole_prompts(m, f"{name} {precision}", libs, args.prompt, args.reps)


if __name__ == "__main__":
    main()
