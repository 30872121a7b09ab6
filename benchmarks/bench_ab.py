"""Two builds of the CPU kernels against each other in one process: the whole C decode step of each,
alternated rep by rep on the same weights and cache.

    .venv/bin/python benchmarks/bench_ab.py --base HEAD~1 [--configs 30m,100m,gen] [--budgets full,small]
                                            [--reps 12] [--position 128] [--greedy]

Why: on a shared machine, runs minutes apart differ by more than a kernel change gains (bench_decode's
decode spreads reached 40-80% here). Alternating two builds of model/gemv.c + step.c every 32 steps inside
one process cancels most of that. `--base` is a git revision of the two sources; the other side is the
working tree. For each config (bench_decode's presets, its checkpoints) it prints each side's median ms
per decode step, the working tree's speed-up (above 1: faster; the ratio of the medians, then the median of
the reps' ratios, steadier where the machine drifts between reps) and the largest logit difference
between the two over a few greedy tokens (0: the change kept every bit). Both sides run the working tree's
step.py, so `--base` must read what it describes (from `decode_token` on; across a change to the
layout, bench_revs.py runs each revision's own Python).
`--greedy` runs each rep's steps as one call of that many greedy tokens (`DecodeStep.greedy`, as
`generate` runs a lone greedy sequence) instead of one call a step. Where the threads' meeting time
(bench_budgets.meeting_ns, measured before each rep) falls on both sides of 150 ns, the speed-up is also
given for the reps below and above it: a VM's vCPUs close together or apart.
`demo` is the embedded demo model (budgets full / mid / small); `gen` is bench_generate.py's nested model
(budgets full / mid / small), for changes to what every layer costs whatever its budget; `gen16` the
same with its Linear weights stored BF16 (as published files are).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import build_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def build(rev: str, where: Path) -> ctypes.CDLL:
    """The kernels as they were at git revision `rev`, built into `where`, with the entry points `rev` has
    bound (later ones are missing: callers check with hasattr)."""
    from elastic_local.model import gemv

    sources = []
    for src in gemv.SOURCES:
        rel = src.relative_to(ROOT).as_posix()
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], capture_output=True, text=True)
        if text.returncode:
            raise SystemExit(f"git show {rev}:{rel}: {text.stderr.strip()}")
        (where / src.name).write_text(text.stdout)
        sources.append(where / src.name)
    out = where / "base.so"
    why = gemv._compile(out, sources)
    if why:
        raise SystemExit(f"building {rev}'s kernels: {why}")
    lib = ctypes.CDLL(str(out))
    for entry, args in gemv._SIGNATURES.items():
        if hasattr(lib, entry):
            getattr(lib, entry).argtypes, getattr(lib, entry).restype = args, ctypes.c_int
    return lib


def checkpoint(name: str) -> Path:
    if name == "demo":
        from elastic_local.paths import DEMO_MODEL

        return DEMO_MODEL
    if name in ("gen", "gen16"):
        import bench_generate

        return bench_generate.build() if name == "gen" else bench_generate.build_bf16()
    return build_checkpoint(name)


def compare(m, name: str, libs: dict[str, ctypes.CDLL], budget: str | None, reps: int, steps: int,
            prompt: int, greedy: bool, threads: int) -> dict:
    from bench_budgets import meeting_ns

    from elastic_local.model import step

    b = m.budget(budget) if budget else m.net.resident
    cache = m.net.new_cache(1, budget=b, capacity=prompt + steps + 1)
    times: dict[str, list[float]] = {side: [] for side in libs}
    meets: list[float] = []
    with torch.inference_mode():
        ids = torch.randint(3, min(999, m.config.vocab_size), (1, prompt), generator=torch.Generator().manual_seed(0))
        m.net.forward(ids, cache=cache)
        decoders = {side: step.DecodeStep(m.net, b, lib) for side, lib in libs.items()}
        for rep in range(reps + 1):  # the first round warms up
            meets.append(meeting_ns(threads) if threads > 1 else 0.0)
            for side, decode in decoders.items():
                t = time.perf_counter()
                if greedy:
                    decode.ahead(5, cache, steps, [])
                else:
                    for _ in range(steps):
                        decode(5, cache)
                if rep:
                    times[side].append((time.perf_counter() - t) / steps * 1e3)
                cache.lengths = [prompt]  # the same positions for both sides
    ms = {side: median(v) for side, v in times.items()}
    ratios = [base / tree for base, tree in zip(times["base"], times["tree"], strict=True)]
    placed = {where: [r for r, ns in zip(ratios, meets[1:], strict=True) if (ns < 150) == (where == "close")]
              for where in ("close", "apart")}
    return {"config": name, "budget": b.name, "ms": ms, "speedup": ms["base"] / ms["tree"], "paired": median(ratios),
            "placed": {where: (len(v), median(v)) for where, v in placed.items()} if all(placed.values()) else {},
            "diff": difference(m, b, decoders, ids)}


def difference(m, b, decoders: dict, ids: torch.Tensor, steps: int = 8) -> float:
    """The largest |logit| difference between the sides over `steps` greedy tokens, each from its own cache
    after the same prompt (0.0: the change kept every bit)."""
    logits = {}
    with torch.inference_mode():
        for side, decode in decoders.items():
            cache = m.net.new_cache(1, budget=b, capacity=ids.shape[1] + steps)
            token, out = int(m.net.forward(ids, cache=cache)[0, -1].argmax()), []
            for _ in range(steps):
                out.append(decode(token, cache))
                token = int(out[-1].argmax())
            logits[side] = torch.cat(out)
    return (logits["base"] - logits["tree"]).abs().max().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision of the kernels to compare the working tree with")
    p.add_argument("--configs", default="30m,100m")
    p.add_argument("--budgets", help="budgets of the checkpoints, comma-separated (default: the full one)")
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--steps", type=int, default=32, help="decode steps per rep and side")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--position", type=int, default=128,
                   help="prompt tokens before the timed steps (attention reads this many positions)")
    p.add_argument("--greedy", action="store_true", help="each rep's steps as one call of greedy tokens")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["ELASTIC_LOCAL_STEP_THREADS"] = "fixed"  # exactly that many: model/threads.py chooses no fewer
    import elastic_local
    from elastic_local.model import gemv

    if gemv.library() is None:
        raise SystemExit("the CPU decode kernels are unavailable here (see the warning): nothing to compare")
    with tempfile.TemporaryDirectory() as tmp:
        base = build(args.base, Path(tmp))
        if not hasattr(base, "decode_token"):
            raise SystemExit(f"{args.base}'s kernels have no decode_token (the step's arguments in one struct, "
                             "which the working tree's step.py passes): compare across it with bench_revs.py")
        libs = {"base": base, "tree": gemv.library()}
        calls = "one call of greedy tokens" if args.greedy else "one call a step"
        print(f"C decode step, {args.base} (base) against the working tree, {args.threads} threads, "
              f"median of {args.reps} reps of {args.steps} steps ({calls}) after {args.position} tokens, alternated")
        for name in args.configs.split(","):
            m = elastic_local.load(str(checkpoint(name)), dtype=torch.float32)
            for budget in args.budgets.split(",") if args.budgets else [None]:
                r = compare(m, name, libs, budget, args.reps, args.steps, args.position, args.greedy, args.threads)
                ms = r["ms"]
                placed = "".join(f"; {where} ({n} reps) {x:.3f}x" for where, (n, x) in r["placed"].items())
                print(f"{name:6} {r['budget']:8} base {ms['base']:7.3f} ms  tree {ms['tree']:7.3f} ms  "
                      f"tree speed-up {r['speedup']:.3f}x (rep by rep {r['paired']:.3f}x{placed})  "
                      f"max |logit diff| {r['diff']:.1e}")


if __name__ == "__main__":
    main()
