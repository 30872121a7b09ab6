"""NVFP4's one-row decode products on a budget's weight shapes, against bf16 column panels, in C alone.

    .venv/bin/python benchmarks/bench_rows.py [--against OTHER_CHECKOUT] [--reps 21] [--shapes 256x16,...]

Why: a small budget's rows are short (the demo's small budget reads rows of 16-80 inputs), and there a
product of a few thousand weights takes about a microsecond: through `linear` the Python and ctypes
around each call would be most of what is timed. `rows_harness.c` calls gemv.c's kernels directly, one
thread, weights in the caches (8 copies cycled where they are small), whole rows (a budget's cut rows, read
a stride apart with their prefetches, are not timed here), and takes each kernel's fastest of REPS
alternated call groups:
    nvfp4   exact NVFP4 rows (permute_nvfp4 + part_nvfp4)
    w4a4    NVFP4 with x rounded to NVFP4 too (part_nvfp4_a4_rows, the rounding included)
    bf16    the same shape in bf16 column panels (panels_vec)
With --against, the same kernels built from another checkout's gemv.c run alternated in the same process:
before / after, side by side. Needs a C compiler and an x86 CPU with AVX2 (as the kernels do). The last line
is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a budget's shapes (out x in): the demo's small and mid down projections and MLP, the 17M model's p35
# experts, then longer rows
SHAPES = "256x16,192x32,256x48,256x80,256x160,256x224,256x304,768x192,256x768,1536x1024"


def build(tree: Path, out: Path, cc: str) -> Path:
    """gemv.c of `tree` as a shared library (the flags model/gemv.py builds it with)."""
    sys.path.insert(0, str(ROOT))
    from elastic_local.model.gemv import FLAGS

    lib = out / f"gemv-{len(list(out.iterdir()))}.so"
    subprocess.run([cc, *FLAGS, "-fopenmp", str(tree / "elastic_local/model/gemv.c"), "-o", str(lib), "-lm"],
                   check=True)
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, help="another checkout whose gemv.c runs beside this tree's")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated OUTxIN, IN a multiple of 16")
    args = ap.parse_args()
    cc = os.environ.get("CC") or "cc"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    trees = [ROOT] + ([args.against.resolve()] if args.against else [])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        libs = [build(tree, out, cc) for tree in trees]
        harness = out / "rows_harness"
        subprocess.run([cc, "-O2", str(ROOT / "benchmarks/rows_harness.c"), "-o", str(harness), "-ldl"], check=True)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [str(harness), str(args.reps), *map(str, libs), "--", *(str(v) for s in shapes for v in s)]
        lines = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.split("\n")
    ns: dict[tuple[int, int], dict[str, float]] = {}
    for line in filter(None, lines):
        n, k, lib, kind, t = line.split()
        ns.setdefault((int(n), int(k)), {})[f"{kind}@{lib}"] = float(t)
    names = ["this tree"] + ([str(args.against)] if args.against else [])
    print(f"One row of x, one thread, ns a product (fastest of {args.reps} alternated groups); "
          f"x bf16: bf16 panels' time / this kernel's")
    head = f"{'out x in':>11} {'nvfp4':>8} {'w4a4':>8} {'bf16':>8} {'nvfp4 x bf16':>13} {'w4a4 x bf16':>12}"
    if args.against:
        head += f" {'nvfp4 new/old':>14} {'w4a4 new/old':>13}"
    print(head)
    for (n, k), t in ns.items():
        row = (f"{n:>5}x{k:<5} {t['nvfp4@0']:>8.0f} {t['w4a4@0']:>8.0f} {t['bf16@0']:>8.0f} "
               f"{t['bf16@0'] / t['nvfp4@0']:>13.2f} {t['bf16@0'] / t['w4a4@0']:>12.2f}")
        if args.against:
            row += f" {t['nvfp4@1'] / t['nvfp4@0']:>13.2f}x {t['w4a4@1'] / t['w4a4@0']:>12.2f}x"
        print(row)
    print(json.dumps({"args": {**vars(args), "against": str(args.against) if args.against else None},
                      "trees": names, "ns": {f"{n}x{k}": t for (n, k), t in ns.items()}}))


if __name__ == "__main__":
    main()
