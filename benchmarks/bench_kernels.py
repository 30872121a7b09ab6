"""How fast each weight format's decode product runs on this CPU: float32 and bf16 column panels, FP8 and
NVFP4 rows (model/gemv.c), where the weights sit in the caches and where they stream from memory.

    .venv/bin/python benchmarks/bench_kernels.py [--threads 1,2] [--reps 7]

Why: batch-1 decode is one matrix-vector product per weight, so a format that reads fewer bytes is faster
only where the bytes, not the arithmetic, set the pace. Each format's kernel decodes its weights to float32
in registers (bf16: a shift or a mask per eight; FP8: an unpack, a shift and a mask into bf16s, then as
bf16; NVFP4: nibble masks and two byte shuffles into bf16s, then as bf16, and a scale per 16), and this
measures what that costs:
    cached    one [1536, 1024] weight, products repeated on it (6 MiB in float32, 0.8 MiB in NVFP4: all
              within this machine's 8 MiB L3)
    streamed  16 weights [4096, 1024] taken in turn (256 MiB in float32, 36 MiB in NVFP4: far past the
              caches), so every product reads its weight from memory
The same random weights in each format, through `linear`, as the model's layers call it on a prompt of
one token (the C kernel plus a few microseconds of Python and ctypes per product). Formats alternate
call group by call group (the machine is shared and noisy); medians. Columns: G weights/s, the bytes read
per second (the weight's own bytes), and the ratio to bf16's speed. A memory-copy rate (torch copy_ of
1 GiB, read + write) is sampled in every rep for scale. The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import CopyProbe  # noqa: E402

from elastic_local.model import gemv  # noqa: E402
from elastic_local.model.linear import Panels, linear  # noqa: E402
from elastic_local.quant.fp8 import quantize_fp8  # noqa: E402
from elastic_local.quant.nvfp4 import quantize_nvfp4  # noqa: E402

FORMATS = ("f32", "bf16", "fp8", "nvfp4")
PLACES = {"cached": (1, 1536, 1024), "streamed": (16, 4096, 1024)}  # (weights, out, in)


def product(fmt: str, w: torch.Tensor) -> tuple:
    """(the weight in `fmt` as the model keeps it on a CPU with the kernels, the bytes it holds) for a float32
    weight w [out, in]."""
    if fmt in ("f32", "bf16"):
        p = Panels.of(w if fmt == "f32" else w.bfloat16())
        return p, p.p.nbytes
    q = quantize_fp8(w) if fmt == "fp8" else quantize_nvfp4(w)
    return q, sum(t.nbytes for t in vars(q).values() if isinstance(t, torch.Tensor))


def build(place: str) -> dict[str, list]:
    count, out, inp = PLACES[place]
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=g) * 0.02 for _ in range(count)]
    return {fmt: [product(fmt, w) for w in weights] for fmt in FORMATS}


def time_group(products: list, x: torch.Tensor, weights: int) -> float:
    """G weights/s over about 0.2 s of products, the weights taken in turn."""
    calls = max(len(products), int(2e9 * 0.2 / weights / len(products)) * len(products))
    t = time.perf_counter()
    for i in range(calls):
        linear(x, products[i % len(products)][0])
    return calls * weights / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if gemv.library() is None:
        sys.exit("the decode kernels do not run here (model/gemv.py: an x86 CPU with AVX2, FMA and F16C and a C "
                 "compiler): nothing to measure")
    copy = CopyProbe()
    copies: list[float] = []
    results: dict = {}
    for place in PLACES:
        print(f"[{place}: building the weights in every format]", file=sys.stderr, flush=True)
        built = build(place)
        _, out, inp = PLACES[place]
        x = torch.randn(1, inp)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            samples: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
            for fmt in FORMATS:  # warm-up: the kernels built, the weights touched
                time_group(built[fmt], x, out * inp)
            for _ in range(args.reps):
                for fmt in FORMATS:
                    samples[fmt].append(time_group(built[fmt], x, out * inp))
                copies.append(copy())
            results[f"{place}/{threads}"] = {
                fmt: {"gw_s": median(s), "samples": s, "bytes_per_weight": built[fmt][0][1] / (out * inp)}
                for fmt, s in samples.items()}
        del built
    print(f"\nDecode products, batch 1: G weights/s (median of {args.reps}), the weight bytes read per second, "
          f"and the speed against bf16's")
    print(f"memory copy: {median(copies):.1f} GB/s read + write (torch copy_ of 1 GiB, "
          f"range {min(copies):.1f}-{max(copies):.1f})")
    print(f"{'place':9} {'threads':>7}  " + "  ".join(f"{fmt:>22}" for fmt in FORMATS))
    for key, row in results.items():
        place, threads = key.split("/")
        bf16 = row["bf16"]["gw_s"]
        cells = [f"{r['gw_s']:5.2f} Gw/s {r['gw_s'] * r['bytes_per_weight']:5.1f} GB/s {r['gw_s'] / bf16:4.2f}x"
                 for r in row.values()]
        print(f"{place:9} {threads:>7}  " + "  ".join(f"{c:>22}" for c in cells))
    print(json.dumps({"args": vars(args), "places": PLACES, "copy_gb_s": copies, "results": results}))


if __name__ == "__main__":
    main()
