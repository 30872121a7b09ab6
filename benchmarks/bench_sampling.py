"""Sampled decode on the CPU: model/sample.c's draw, run ahead in the C step, against torch's draw a step at a time.

    .venv/bin/python benchmarks/bench_sampling.py [--vocabs 512,32000,131072] [--models demo,30m,100m]
                                                  [--reps 7] [--new-tokens 128] [--threads 2]

a. draw     one sampled token from [1, V] logits, microseconds, for each vocabulary size: 512 (the demo
            model), 32000 (bench_decode's 30m / 100m), 131072 (Star Elastic); temperature 0.8 alone, with
            top_p 0.95, and with top_k 40, top_p 0.95 and min_p 0.02; on peaked logits (6 x N(0, 1): a
            small nucleus, as a trained model's usually is) and flat ones (0.5 x N(0, 1): the nucleus most
            of the vocabulary). `sampling.sample` on the CPU (sample.c through ctypes, the engine's steps)
            against the torch ops it replaced (`draw(logits_to_probs(...))`, still the path off the CPU).
b. decode   batch-1 decode through `m.generate` (eos ignored, thinking closed at once, a 32-token prompt),
            answer tokens over their time, three ways alternated rep by rep in one process:
              greedy   temperature 0, run ahead in the C step
              sampled  temperature 0.8, top_p 0.95: run ahead in the C step, sample.c drawing
              steps    the same sampling as before sample.c: a step and torch's draw per token (the run
                       ahead declined and sample.c's draw off, in this process)
            each budget of the demo model (with its efficiency: speed-up over the full budget / ratio of the
            weight bytes read, as bench_budgets), and the full budget of bench_decode's 30m / 100m checkpoints
            in float32 (built once under benchmarks/_work/).
Medians and their ratios; the last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_budgets import read_bytes  # noqa: E402

from elastic_local.engine.sampling import Sampling, draw, logits_to_probs, sample  # noqa: E402

SETTINGS = {"T": Sampling(temperature=0.8), "T+top_p": Sampling(temperature=0.8, top_p=0.95),
            "T+k+p+min_p": Sampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02)}
SAMPLED = dict(temperature=0.8, top_p=0.95)


def timed_us(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def bench_draws(vocabs: list[int], reps: int) -> dict:
    out = {}
    for v in vocabs:
        for shape, scale in (("peaked", 6.0), ("flat", 0.5)):
            logits = torch.randn(1, v, generator=torch.Generator().manual_seed(v)) * scale
            for name, s in SETTINGS.items():
                g = torch.Generator().manual_seed(0)
                calls = max(10, 100_000 // v)
                us = {"c": [], "torch": []}
                for _ in range(reps):
                    us["c"].append(timed_us(lambda s=s, x=logits, g=g: sample(x, s, g), calls))
                    us["torch"].append(timed_us(lambda s=s, x=logits, g=g: draw(logits_to_probs(x, s), g), calls))
                r = out[f"{v} {shape} {name}"] = {k: median(x) for k, x in us.items()}
                print(f"vocab {v:>7} {shape:6} {name:12} torch {r['torch']:8.1f} us  sample.c {r['c']:7.1f} us  "
                      f"speed-up {r['torch'] / r['c']:5.1f}x", flush=True)
    return out


@contextlib.contextmanager
def steps_as_before():
    """Sampled tokens a step and a torch draw each, as before sample.c: the run ahead declines sampled rows
    and `sample` finds no C draw."""
    from elastic_local.engine.generate import Generation
    from elastic_local.model import sample as c_sample

    ahead, rows = Generation._run_ahead, c_sample.rows
    Generation._run_ahead = lambda self, start: (None if not self.options[self.rows[self.active[0]].index]
                                                 .sampling.greedy else ahead(self, start))
    c_sample.rows = lambda *args: None
    try:
        yield
    finally:
        Generation._run_ahead, c_sample.rows = ahead, rows


def checkpoint(name: str) -> Path | None:
    if name == "demo":
        return None  # load(): the embedded demo model
    from bench_decode import build_checkpoint

    return build_checkpoint(name)


def bench_decode(models: list[str], reps: int, new_tokens: int) -> dict:
    import elastic_local

    ways = {"greedy": ({}, contextlib.nullcontext), "sampled": (SAMPLED, contextlib.nullcontext),
            "steps": (SAMPLED, steps_as_before)}
    out = {}
    for name in models:
        m = elastic_local.load(checkpoint(name), dtype=torch.float32)
        budgets = m.budgets if name == "demo" else m.budgets[:1]
        prompt = torch.randint(3, m.config.vocab_size, (32,), generator=torch.Generator().manual_seed(1)).tolist()
        base = dict(max_think_tokens=0, max_answer_tokens=new_tokens, ignore_eos=True, seed=0)

        def tok_s(budget: str, way: str, m=m, prompt=prompt, base=base) -> float:
            options, context = ways[way]
            with context():
                st = m.generate(prompt, answer_budget=budget, **base, **options).stats
            return st.answer_tokens / st.answer_s

        for b in budgets:  # warm-up: caches, kernels, each budget's C step
            for way in ways:
                tok_s(b, way)
        runs = {(b, w): [] for b in budgets for w in ways}
        for _ in range(reps):
            for b in budgets:
                for w in ways:
                    runs[b, w].append(tok_s(b, w))
        rows = out[name] = {}
        for b in budgets:
            r = rows[b] = {w: median(runs[b, w]) for w in ways}
            r["ideal"] = read_bytes(m, budgets[0]) / read_bytes(m, b)
            print(f"{name:>5} {b:6} greedy {r['greedy']:8.0f} tok/s  sampled {r['sampled']:8.0f} tok/s  steps "
                  f"{r['steps']:8.0f} tok/s | sampled / steps {r['sampled'] / r['steps']:5.2f}x  sampled / greedy "
                  f"{r['sampled'] / r['greedy']:5.2f}x", flush=True)
        if len(budgets) > 1:
            for b in budgets[1:]:
                effs = {w: rows[b][w] / rows[budgets[0]][w] / rows[b]["ideal"] for w in ways}
                rows[b]["efficiency"] = effs
                print(f"{name:>5} {b:6} efficiency (speed-up over {budgets[0]} / bytes ratio "
                      f"{rows[b]['ideal']:.2f}x): " + "  ".join(f"{w} {e:.2f}" for w, e in effs.items()))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocabs", default="512,32000,131072")
    p.add_argument("--models", default="demo,30m,100m", help="demo and bench_decode's configs ('' to skip)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    draws = bench_draws([int(v) for v in args.vocabs.split(",") if v], args.reps)
    decode = bench_decode([m for m in args.models.split(",") if m], args.reps, args.new_tokens)
    print(json.dumps({"args": vars(args), "draw_us": draws, "decode_tok_s": decode}))


if __name__ == "__main__":
    main()
