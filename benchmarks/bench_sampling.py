"""Sampling a token on the CPU: torch.multinomial against the engine's inverse-CDF draw, side by side.

    .venv/bin/python benchmarks/bench_sampling.py [--vocabs 512,32000,131072] [--models demo,30m,100m]
                                                  [--reps 7] [--new-tokens 64] [--threads 2]

a. draw     one draw from a [1, V] distribution (a softmax of random logits), microseconds, for each
            vocabulary size: 512 (the demo model), 32000 (bench_decode's 30m / 100m), 131072 (Star Elastic).
b. top-p    the nucleus (top_p 0.95) of a [1, V] distribution, microseconds: one sort of the whole
            vocabulary against `sampling.nucleus` (the most likely 256, then 4096, then all, each stage
            where the vocabulary is 16 times larger), on a peaked
            distribution (softmax of 6 x N(0, 1) logits: a small nucleus, as a trained model's usually is)
            and a flat one (0.5 x N(0, 1): the worst case, the nucleus most of the vocabulary).
c. decode   sampled batch-1 decode (temperature 0.8, eos ignored, thinking closed at once, a 32-token
            prompt) through `m.generate`: answer tokens over the call's time, the same prompt's prefill in
            both; the engine's `sampling.draw` against the same engine with torch.multinomial swapped in; the
            demo model, and bench_decode's 30m / 100m checkpoints in float32 (built once under
            benchmarks/_work/).
Both alternate the two ways rep by rep in one process (the machine is shared and noisy); medians and
their ratio. The last line is one JSON object with every number.
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

from elastic_local.engine import sampling  # noqa: E402


def multinomial(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """What `sampling.draw` replaced."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


WAYS = {"multinomial": multinomial, "draw": sampling.draw}


def full_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """What `sampling.nucleus` replaced: one sort of the whole vocabulary."""
    p, order = probs.sort(dim=-1, descending=True)
    return probs.scatter(-1, order, p.masked_fill(p.cumsum(-1) - p >= top_p, 0.0))


def timed_us(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def bench_draws(vocabs: list[int], reps: int) -> dict:
    out = {}
    for v in vocabs:
        probs = torch.randn(1, v, generator=torch.Generator().manual_seed(v)).softmax(-1)
        g = torch.Generator().manual_seed(0)
        calls = max(20, 200_000 // v)
        us = {name: [] for name in WAYS}
        for _ in range(reps):
            for name, fn in WAYS.items():
                us[name].append(timed_us(lambda fn=fn, probs=probs, g=g: fn(probs, g), calls))
        out[v] = {name: median(s) for name, s in us.items()}
        print(f"vocab {v:>7}  multinomial {out[v]['multinomial']:8.1f} us  draw {out[v]['draw']:7.1f} us  "
              f"draw speed-up {out[v]['multinomial'] / out[v]['draw']:5.1f}x", flush=True)
    return out


def bench_top_p(vocabs: list[int], reps: int, top_p: float = 0.95) -> dict:
    out = {}
    for v in vocabs:
        for shape, scale in (("peaked", 6.0), ("flat", 0.5)):
            probs = (torch.randn(1, v, generator=torch.Generator().manual_seed(v)) * scale).softmax(-1)
            assert torch.equal(sampling.nucleus(probs, top_p), full_sort_nucleus(probs, top_p))
            size = int((sampling.nucleus(probs, top_p) > 0).sum())
            calls = max(5, 100_000 // v)
            us = {"sort": [], "nucleus": []}
            for _ in range(reps):
                us["sort"].append(timed_us(lambda probs=probs: full_sort_nucleus(probs, top_p), calls))
                us["nucleus"].append(timed_us(lambda probs=probs: sampling.nucleus(probs, top_p), calls))
            r = out[f"{v} {shape}"] = {"nucleus_tokens": size, **{k: median(x) for k, x in us.items()}}
            print(f"vocab {v:>7} {shape:6} top_p {top_p} ({size:>6} tokens)  sort {r['sort']:8.1f} us  nucleus "
                  f"{r['nucleus']:8.1f} us  speed-up {r['sort'] / r['nucleus']:5.2f}x", flush=True)
    return out


def checkpoint(name: str) -> Path | None:
    if name == "demo":
        return None  # load(): the embedded demo model
    from bench_decode import build_checkpoint

    return build_checkpoint(name)


def bench_decode(models: list[str], reps: int, new_tokens: int) -> dict:
    import elastic_local

    out = {}
    for name in models:
        m = elastic_local.load(checkpoint(name), dtype=torch.float32)
        prompt = torch.randint(3, m.config.vocab_size, (32,), generator=torch.Generator().manual_seed(1)).tolist()
        options = dict(max_think_tokens=0, max_answer_tokens=new_tokens, ignore_eos=True, temperature=0.8, seed=0)
        m.generate(prompt, **{**options, "max_answer_tokens": 4})  # warm-up: caches, kernels
        tok_s = {way: [] for way in WAYS}
        for _ in range(reps):
            for way, fn in WAYS.items():
                sampling.draw = fn  # `sample` looks it up by name on every call
                try:
                    t = time.perf_counter()
                    r = m.generate(prompt, **options)
                    tok_s[way].append(len(r.answer_ids) / (time.perf_counter() - t))
                finally:
                    sampling.draw = WAYS["draw"]
        out[name] = {way: median(s) for way, s in tok_s.items()}
        print(f"{name:>5} sampled decode  multinomial {out[name]['multinomial']:7.1f} tok/s  draw "
              f"{out[name]['draw']:7.1f} tok/s  draw speed-up {out[name]['draw'] / out[name]['multinomial']:.2f}x",
              flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocabs", default="512,32000,131072")
    p.add_argument("--models", default="demo,30m,100m", help="demo and bench_decode's configs ('' to skip)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    vocabs = [int(v) for v in args.vocabs.split(",") if v]
    draws = bench_draws(vocabs, args.reps)
    top_p = bench_top_p(vocabs, args.reps)
    decode = bench_decode([m for m in args.models.split(",") if m], args.reps, args.new_tokens)
    print(json.dumps({"args": vars(args), "draw_us": draws, "top_p_us": top_p, "decode_tok_s": decode}))


if __name__ == "__main__":
    main()
