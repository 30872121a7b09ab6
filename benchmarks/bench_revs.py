"""Two revisions of the whole package side by side: decode and prefill speed of the same checkpoints, each
through its own code, alternated rep by rep.

    .venv/bin/python benchmarks/bench_revs.py --base REV [--models gen,demo,30m,100m] [--budgets full,mid,small]
                                              [--precisions f32,fp8,nvfp4] [--reps 7] [--tokens 48]
                                              [--prompt 128] [--threads 2]

Why: bench_ab.py swaps only the kernels under the working tree's step.py. A change to how the weights are
laid out or described (the column panels, say) needs each side's own Python as well. Each side is a
worker process that imports its own tree: the base from a `git worktree` under benchmarks/_work/revs/,
the working tree as it is. Each loads every model once per precision (float32 compute, its default CPU
layout; fp8 / nvfp4 quantized while loading), then the
driver asks the two in turn, never both at once, for one measurement:
    decode   tok/s of `m.generate` (greedy, eos ignored) after a 32-token prompt, sampled tokens only
    prefill  tok/s of one --prompt-token forward into a fresh cache
It prints each side's median and the tree's speed-up (above 1: the tree is faster); the last line is one
JSON object with every sample. Budgets a model does not have are skipped. After each measurement a worker
gives its OpenMP threads back (`gemv.release_threads`, where its revision has it): left spinning, they
took a core from the other side's measurement (demo 5171-6474 tok/s on 2 threads; 6445-8904 with the
release; both sides alike, so only the absolute figures moved). The two sides still evict each other's
weights from the caches between reps, so their absolute figures stay below one process's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

# Run by each side's interpreter with its tree first on sys.path. Only the API both revisions share.
WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(int(sys.argv[2]))
import elastic_local
from elastic_local.model import gemv
assert elastic_local.__file__.startswith(sys.argv[1]), elastic_local.__file__
release = getattr(gemv, "release_threads", lambda: None)
models = {}
with torch.inference_mode():
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "load":
            m = models[req["model"]] = elastic_local.load(req["path"], dtype=torch.float32,
                                                          precision=req["precision"])
            out = {"budgets": list(m.budgets)}
        elif req["op"] == "decode":
            st = models[req["model"]].generate(list(range(20, 52)), answer_budget=req["budget"],
                                               max_answer_tokens=req["tokens"], ignore_eos=True).stats
            out = {"tok_s": st.answer_tokens / st.answer_s}
        else:
            m = models[req["model"]]
            b = m.budget(req["budget"])
            ids = torch.randint(3, 500, (1, req["tokens"]), generator=torch.Generator().manual_seed(0))
            cache = m.net.new_cache(1, budget=b, capacity=req["tokens"] + 1)
            t = time.perf_counter()
            m.net.forward(ids, cache=cache, last_only=True)
            out = {"tok_s": req["tokens"] / (time.perf_counter() - t)}
        release()  # this side's OpenMP workers would spin on while the other side measures
        print(json.dumps(out), flush=True)
"""


class Side:
    def __init__(self, tree: Path, threads: int):
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tree), str(threads)], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=tree)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker stopped (exit code {self.proc.wait()}); its error is above")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def worktree(rev: str) -> Path:
    """A checkout of `rev` under benchmarks/_work/revs/<commit> (made once, reused)."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True)
    if commit.returncode:
        raise SystemExit(f"--base {rev}: {commit.stderr.strip()}")
    sha = commit.stdout.strip()
    where = ROOT / "benchmarks" / "_work" / "revs" / sha[:12]
    if not (where / "elastic_local").is_dir():
        made = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), sha],
                              capture_output=True, text=True)
        if made.returncode:
            raise SystemExit(f"git worktree add {where}: {made.stderr.strip()}")
    return where


def checkpoint(name: str) -> Path:
    if name == "demo":
        from elastic_local.paths import DEMO_MODEL

        return DEMO_MODEL
    from bench_ab import checkpoint as built

    return built(name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision to compare the working tree with")
    p.add_argument("--models", default="gen,demo", help="gen, demo, and bench_decode's configs (30m, 100m, ...)")
    p.add_argument("--budgets", default="full,mid,small")
    p.add_argument("--precisions", default="f32", help="f32, fp8, nvfp4 (comma-separated)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--tokens", type=int, default=48, help="decoded tokens per rep")
    p.add_argument("--prompt", type=int, default=128, help="prefill tokens per rep (0: no prefill)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    sides = {"base": Side(worktree(args.base), args.threads), "tree": Side(ROOT, args.threads)}
    samples: dict[str, dict[str, list[float]]] = {}
    try:
        for name, precision in ((n, q) for n in args.models.split(",") for q in args.precisions.split(",")):
            path, model = str(checkpoint(name)), f"{name} {precision}"
            loaded = dict(op="load", model=model, path=path, precision=None if precision == "f32" else precision)
            have = [side.ask(**loaded)["budgets"] for side in sides.values()]
            budgets = [b for b in args.budgets.split(",") if all(b in h for h in have)]
            ops = [("decode", args.tokens)] + ([("prefill", args.prompt)] if args.prompt else [])
            for budget in budgets:
                for op, tokens in ops:
                    req = dict(op=op, model=model, budget=budget, tokens=tokens)
                    for side in sides.values():  # warm-up
                        side.ask(**req)
                    key = f"{model} {budget} {op}"
                    samples[key] = {s: [] for s in sides}
                    for _ in range(args.reps):
                        for s, side in sides.items():
                            samples[key][s].append(side.ask(**req)["tok_s"])
                    base, tree = (median(samples[key][s]) for s in sides)
                    print(f"{key:32} base {base:9.1f} tok/s  tree {tree:9.1f} tok/s  tree speed-up {tree / base:.3f}x",
                          flush=True)
    finally:
        for side in sides.values():
            side.close()
    print(json.dumps({"args": vars(args), "samples": samples}))


if __name__ == "__main__":
    main()
