"""The decode step's shares of the products learned from the threads' speeds, against equal shares, on a
core made slower on purpose.

    .venv/bin/python benchmarks/bench_balance.py [--slow 1.0,1.5,2.0] [--budgets full,small] [--reps 15]
                                                 [--tokens 32] [--threads 2]

Why: step.c moves each thread's share of the products toward its speed, as timed on them (`rebalance`),
for CPUs whose cores are not equally fast (efficiency cores; a core that also takes the interrupts or
the chat app's drawing). This project's two vCPUs are equally fast, so the benchmark makes one slower: it
builds the working tree's kernels with thread 1 spinning, after each of its runs of products, (s - 1)
times what they took, so that its products run at 1 / s of its speed (s = --slow; timed inside, as a
slower core's would be). On that build it alternates, rep by rep on the embedded demo model, two decode
steps of the same budget: `learned` (the step as it ships) and `equal` (its shares held equal: no
balance). Each rep is one greedy call of --tokens tokens from the same position (the engine's run ahead);
it prints each side's median tok/s, learned / equal and the shares the learned side ended with. With
--slow 1.0 the build is the shipped step plus the spin's bookkeeping: what learning costs where the
threads are alike.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

ROOT = Path(__file__).resolve().parents[1]

RUNS = '''    for (int i = 0; i < count; i++) run(&p[i]);
    if (me->tally) {'''
SLOWED = '''    for (int i = 0; i < count; i++) run(&p[i]);
    if (thread_here() == 1 && SLOW > 1.) { /* bench_balance.py: a core 1 / SLOW as fast */
        const unsigned long long spent = __rdtsc() - t_slow;
        const unsigned long long until = __rdtsc() + (unsigned long long)((SLOW - 1.) * spent);
        while (__rdtsc() < until) _mm_pause();
    }
    if (me->tally) {'''


def build(where: Path, slow: float) -> ctypes.CDLL:
    """The working tree's kernels with thread 1's products slowed `slow` times (module docstring)."""
    from elastic_local.model import gemv

    sources = []
    for src in gemv.SOURCES:
        text = src.read_text()
        if src.name == "step.c":
            start = "    const unsigned long long t0 = me->tally ? __rdtsc() : 0;\n"
            if RUNS not in text or start not in text:
                raise SystemExit("step.c's runs() changed: update bench_balance.py's patch")
            text = text.replace(start, start + "    const unsigned long long t_slow = __rdtsc();\n", 1)
            text = f"#define SLOW {slow!r}\n" + text.replace(RUNS, SLOWED, 1)
        (where / src.name).write_text(text)
        sources.append(where / src.name)
    out = where / f"slow-{slow}.so"
    why = gemv._compile(out, sources)
    if why:
        raise SystemExit(f"building the slowed kernels: {why}")
    lib = ctypes.CDLL(str(out))
    for entry, args in gemv._SIGNATURES.items():
        getattr(lib, entry).argtypes, getattr(lib, entry).restype = args, ctypes.c_int
    return lib


def compare(m, lib: ctypes.CDLL, budget: str, reps: int, tokens: int) -> dict:
    from elastic_local.model import step

    b = m.budget(budget)
    prompt = 32
    cache = m.net.new_cache(1, budget=b, capacity=prompt + tokens + 1)
    sides = {"learned": step.DecodeStep(m.net, b, lib), "equal": step.DecodeStep(m.net, b, lib)}
    kept = (ctypes.c_double * (1 + step.BALANCED))()

    def forgotten(count: int) -> ctypes.Array:  # what the last call learned is forgotten: equal shares, every call
        kept[0] = 0
        return kept

    sides["equal"].balance = forgotten
    rates: dict[str, list[float]] = {side: [] for side in sides}
    with torch.inference_mode():
        ids = torch.randint(3, m.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
        m.net.forward(ids, cache=cache)
        for rep in range(reps + 3):  # three rounds to warm up and learn
            for side, decode in sides.items():
                t = time.perf_counter()
                decode.ahead(5, cache, tokens, [])
                if rep >= 3:
                    rates[side].append(tokens / (time.perf_counter() - t))
                cache.lengths = [prompt]  # the same positions for both sides
    tok_s = {side: median(v) for side, v in rates.items()}
    return {"budget": budget, "tok_s": tok_s, "ratio": tok_s["learned"] / tok_s["equal"],
            "shares": sides["learned"].shares}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slow", default="1.0,1.5,2.0", help="how many times slower thread 1's products run")
    p.add_argument("--budgets", default="full,small")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens a call")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["ELASTIC_LOCAL_STEP_THREADS"] = "fixed"  # exactly that many: model/threads.py chooses no fewer
    import elastic_local
    from elastic_local.model import gemv

    if gemv.library() is None:
        raise SystemExit("the CPU decode kernels are unavailable here (see the warning): nothing to compare")
    m = elastic_local.load(None, dtype=torch.float32)
    print(f"demo model, {args.threads} threads, greedy calls of {args.tokens} tokens, median of {args.reps} reps, "
          "learned shares against equal ones, alternated")
    with tempfile.TemporaryDirectory() as tmp:
        for slow in (float(s) for s in args.slow.split(",")):
            lib = build(Path(tmp), slow)
            for budget in args.budgets.split(","):
                r = compare(m, lib, budget, args.reps, args.tokens)
                t, shares = r["tok_s"], ", ".join(f"{x:.3f}" for x in r["shares"] or [])
                print(f"thread 1 {slow:.1f}x slower  {budget:6} learned {t['learned']:8.0f} tok/s  "
                      f"equal {t['equal']:8.0f} tok/s  learned/equal {r['ratio']:.3f}x  shares [{shares}]",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
