"""Do smaller budgets decode faster in proportion to the bytes they read? The CPU decode paths side by side.

    .venv/bin/python benchmarks/bench_budgets.py [--models demo,gen,gen16] [--reps 5] [--new-tokens 48] [--threads 1]
                                                 [--variants torch,kernels,stepwise,rows,fixed,sampled] [--compile]
                                                 [--bf16] [--precision bf16|fp8|nvfp4]

Models: the embedded demo model (5.6M parameters, budgets full / mid / small) and bench_generate.py's
~136M random nested model (full / mid / small at 60% and 35% of the parameters; built once under
benchmarks/_work/gen/), stored in float32 (`gen`) or with its Linear weights in BF16 (`gen16`, as the demo
and published files are: the default then keeps them in bf16 panels, and every budget reads half the
bytes `read/token` counts, so the same ratios). Each is loaded in float32 once per variant:
    torch     weights kept [in, out] (`linear.Transposed`), torch's matmul (what ELASTIC_LOCAL_CPU_GEMV=0 runs)
    kernels   the default: weights in column panels (`linear.Panels`), decode steps in C (model/step.c on
              model/gemv.c's kernels)
    rows      ELASTIC_LOCAL_CPU_LAYOUT=rows: weights kept [out, in] in float32 (a BF16 file's too: twice the
              bytes the default's bf16 panels read), decode steps in C
    compiled  (--compile) the default with the decode step compiled (`load(compile=True)`), each budget
              compiled in the warm-up
    bf16      (--bf16) the default loaded with dtype=torch.bfloat16 (the CPU's load where float32 does not fit):
              the same bf16 panels, decode steps in C on a bf16 embedding and bf16 caches
    fixed     the default model with its C step always on torch's thread count (ELASTIC_LOCAL_STEP_THREADS=fixed),
              where the default times its counts and runs the fastest (model/threads.py)
    sampled   the default model sampling (temperature 0.8, top_p 0.95, seeded) where the others are greedy:
              run ahead in C too (model/sample.c)
    stepwise  the default model with the engine's run ahead off (`Generation._run_ahead` declining): the
              general step, its Python and numpy's argmax for every token, as before greedy tokens ran
              ahead in C
`--precision fp8` / `nvfp4` quantizes the weights while loading (the same numbers as a stored file) and
counts the bytes a token reads as a CPU load keeps them (quant/scheme.py weight_bytes: packed codes and
scales, the LM head and the other high-precision Linear weights in bf16, the rest float32).
Batch-1 greedy decode (sampled in the `sampled` variant) of --new-tokens tokens after a 32-token prompt, eos
ignored, through
`m.generate`; runs interleaved (rep, budget, variant) because the machine is shared and noisy; medians.
`--variants kernels` runs a rep's budgets back to back (milliseconds apart on the demo, where all four
variants put a torch run of hundreds of ms between them): the tightest pairs, for the efficiency alone.

Columns: `read/token` is the weight bytes a decoded token reads (active parameters: the routed experts it
uses, not the embedding table); `speed-up` is tok/s against the same variant's full budget; `efficiency`
is that speed-up over the ideal one (full bytes / budget bytes): 1.0 means a budget is exactly as much
faster as it reads less. A line per budget adds the kernels' efficiency counting all a token reads: the
weights as stored (bf16 panels for demo and gen16) and what every budget that keeps its Mamba and
attention heads reads alike, each Mamba block's convolution window and SSM state and the float32 K / V
cache up to the token's position (on average the prompt plus half the new tokens). The last line is one
JSON object with every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PRECISION = "bf16"  # --precision: the weights' (fp8 / nvfp4: quantized while loading, or as a file stores them)


def load(path: Path | None, variant: str):
    import elastic_local
    from elastic_local.engine.load import LAYOUT_ENV

    os.environ[LAYOUT_ENV] = "rows" if variant == "rows" else "transposed"
    try:
        with kernels_on(variant != "torch"):  # without the kernels, the plain transpose
            return elastic_local.load(path, dtype=torch.bfloat16 if variant == "bf16" else torch.float32,
                                      compile=variant == "compiled",
                                      precision=None if PRECISION == "bf16" else PRECISION)
    finally:
        os.environ.pop(LAYOUT_ENV, None)


def read_bytes(m, budget: str) -> int:
    """The weight bytes a decoded token reads, counted at 4 a weight (BF16: the ratios are a BF16 load's); at
    --precision fp8 / nvfp4 as a CPU load keeps them (packed codes and scales, the LM head and the other
    high-precision Linear weights in bf16 panels, the rest float32; quant/scheme.py weight_bytes)."""
    from elastic_local.model.budget import count_params
    from elastic_local.quant.scheme import weight_bytes

    b = m.budget(budget)
    if PRECISION != "bf16":
        return weight_bytes(m.config, b, PRECISION, active=True, float32=True, bf16_linears=True)
    active = count_params(m.config, b)[1]
    return (active - m.config.vocab_size * b.hidden) * 4  # one embedding row per token, float32


def all_read_bytes(m, budget: str, weight_bytes: int, position: float) -> float:
    """Everything a decoded token at `position` reads: its weights at `weight_bytes` each, its embedding
    row as the load keeps it, the Mamba blocks' convolution windows and SSM states and the K / V caches
    (float32, the load's compute dtype; cost.ArchShape, which takes the budget's largest Mamba block for
    each)."""
    from elastic_local.model.cost import arch_shape

    shape = arch_shape(m.config, m.budget(budget))
    embedding_row = m.budget(budget).hidden * m.net.embed.element_size()
    weights = read_bytes(m, budget) if PRECISION != "bf16" else read_bytes(m, budget) / 4 * weight_bytes
    return weights + embedding_row + shape.state_bytes() + shape.kv_bytes(position, 4)


@contextlib.contextmanager
def kernels_on(on: bool):
    """The CPU decode kernels on or off (the `torch` variant) for what runs inside."""
    from elastic_local.model import gemv

    library, gemv._library = gemv._library, gemv._library if on else None
    try:
        yield
    finally:
        gemv._library = library


def fixed_threads(on: bool):
    """The C step on torch's thread count (the `fixed` variant), not the count it finds fastest."""
    from unittest import mock

    from elastic_local.model import threads

    return mock.patch.dict(os.environ, {threads.ENV: "fixed"}) if on else contextlib.nullcontext()


def thread_tokens(m, budget: str) -> dict[int, int]:
    """The tokens the budget's C step has run on each thread count (model/threads.py)."""
    c_step = m.net.c_steps.get(m.budget(budget))
    return dict(c_step.threads.tokens) if c_step is not None else {}


@contextlib.contextmanager
def run_ahead(on: bool):
    """The engine's run ahead of greedy tokens on or off (the `stepwise` variant) for what runs inside."""
    from elastic_local.engine.generate import Generation

    ahead = Generation._run_ahead
    if not on:
        Generation._run_ahead = lambda self, start: None  # every step the general one
    try:
        yield
    finally:
        Generation._run_ahead = ahead


def decode_tok_s(m, budget: str, new_tokens: int, variant: str = "kernels") -> float:
    prompt = list(range(20, 52))
    sampling = dict(temperature=0.8, top_p=0.95, seed=0) if variant == "sampled" else {}
    with kernels_on(variant != "torch"), run_ahead(variant != "stepwise"), fixed_threads(variant == "fixed"):
        st = m.generate(prompt, answer_budget=budget, max_answer_tokens=new_tokens, ignore_eos=True,
                        **sampling).stats
    return st.answer_tokens / st.answer_s


def step_logits(m, kernels: bool) -> torch.Tensor:
    """Logits of one decode step after a 31-token prompt (a prefill would not reach the kernels)."""
    ids = torch.tensor([list(range(20, 52))])
    with kernels_on(kernels):
        cache = m.new_cache(batch_size=1)
        m.forward(ids[:, :-1], cache=cache)
        return m.forward(ids[:, -1:], cache=cache)


def bench(name: str, path: Path | None, args) -> dict:
    from elastic_local.model import gemv

    if gemv.library() is None:
        raise SystemExit("the CPU decode kernels are unavailable here (see the warning): nothing to compare")
    variants = tuple(args.variants.split(",")) + (("compiled",) if args.compile else ()) \
        + (("bf16",) if args.bf16 else ())
    models = {v: load(path, v) for v in variants if v not in ("stepwise", "fixed", "sampled")}
    for v in ("stepwise", "fixed", "sampled"):
        models[v] = models["kernels"]  # the same weights, the engine set otherwise
    budgets = models["kernels"].budgets
    torch_model = models["torch"] if "torch" in models else load(path, "torch")
    diff = (step_logits(torch_model, False) - step_logits(models["kernels"], True)).abs().max().item()
    del torch_model
    for v, m in models.items():  # warm-up
        for b in budgets:
            decode_tok_s(m, b, 4, v)
    runs = {(v, b): [] for v in variants for b in budgets}
    meets, counts = [], {b: {} for b in budgets}  # the kernels' tokens on each thread count
    for _ in range(args.reps):
        meets.append(meeting_ns(args.threads))
        for b in budgets:
            for v in variants:
                before = thread_tokens(models[v], b)
                runs[v, b].append(decode_tok_s(models[v], b, args.new_tokens, v))
                if v == "kernels":
                    for c, k in thread_tokens(models[v], b).items():
                        counts[b][c] = counts[b].get(c, 0) + k - before.get(c, 0)
    full = budgets[0]
    rows = []
    for b in budgets:
        nbytes = read_bytes(models["kernels"], b)
        ideal = read_bytes(models["kernels"], full) / nbytes
        weight_bytes = 4 if name == "gen" else 2  # demo and gen16 decode from bf16 panels
        position = 32 + (args.new_tokens - 1) / 2
        all_ideal = all_read_bytes(models["kernels"], full, weight_bytes, position) \
            / all_read_bytes(models["kernels"], b, weight_bytes, position)
        row = {"model": name, "budget": b, "read_bytes": nbytes, "ideal_speedup": ideal,
               "all_read_bytes": all_read_bytes(models["kernels"], b, weight_bytes, position),
               "all_ideal_speedup": all_ideal}
        for v in variants:
            tok_s = median(runs[v, b])
            speedup = tok_s / median(runs[v, full])
            row[v] = {"tok_s": tok_s, "speedup": speedup, "efficiency": speedup / ideal}
        for a, b_ in RATIOS:
            if a in variants and b_ in variants:
                row[f"{a}_over_{b_}"] = row[a]["tok_s"] / row[b_]["tok_s"]
        # the kernels' efficiency rep by rep, beside that rep's meeting time
        row["kernels_by_rep"] = [k / f / ideal for k, f in zip(runs["kernels", b], runs["kernels", full])]
        rows.append(row)
    for row in rows:
        row["kernels_thread_tokens"] = counts[row["budget"]]
    return {"rows": rows, "max_logit_diff": diff, "variants": variants, "meet_ns": meets}


RATIOS = (("kernels", "torch"), ("rows", "torch"), ("kernels", "stepwise"), ("compiled", "torch"),
          ("kernels", "fixed"), ("sampled", "kernels"))


def meeting_ns(threads: int) -> float:
    """What one of the C step's meetings of `threads` threads (step.c's `meet`) costs now, in ns: set by where
    the machine runs the threads, it moves from run to run (a VM's two vCPUs: 30 to 320 ns)."""
    import ctypes

    from elastic_local.model import gemv

    ns = ctypes.c_double()
    gemv.library().meet_time(20000, threads, ctypes.byref(ns))
    return ns.value


def by_meeting(meets: list[float], effs: list[float]) -> str:
    """The median efficiency in the reps whose meetings were the faster half, and in the slower half."""
    order = sorted(range(len(meets)), key=meets.__getitem__)
    half = len(order) // 2
    if not half:
        return ""
    fast, slow = order[:half], order[-half:]
    return (f"{median(effs[i] for i in fast):.2f} where the meetings took {max(meets[i] for i in fast):.0f} ns "
            f"or less, {median(effs[i] for i in slow):.2f} where {min(meets[i] for i in slow):.0f} ns or more")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="demo,gen")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default="torch,kernels,stepwise,rows",
                    help="which of torch, kernels, stepwise, rows, fixed, sampled to run (kernels always)")
    ap.add_argument("--compile", action="store_true", help="also the default with a compiled decode step")
    ap.add_argument("--bf16", action="store_true", help="also the default loaded in bfloat16")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp8", "nvfp4"),
                    help="the weights' precision: fp8 / nvfp4 quantized while loading")
    args = ap.parse_args()
    global PRECISION
    PRECISION = args.precision
    unknown = set(args.variants.split(",")) - {"torch", "kernels", "stepwise", "rows", "fixed", "sampled"}
    if unknown or "kernels" not in args.variants.split(","):
        raise SystemExit(f"--variants: {', '.join(sorted(unknown)) or 'kernels missing'} (torch, kernels, "
                         "stepwise, rows, fixed, sampled; kernels always)")
    torch.set_num_threads(args.threads)
    results = {}
    for name in args.models.split(","):
        if name == "demo":
            path = None
        elif name in ("gen", "gen16"):
            import bench_generate

            path = bench_generate.build() if name == "gen" else bench_generate.build_bf16()
        else:
            raise SystemExit(f"--models: unknown {name!r} (demo, gen, gen16)")
        results[name] = bench(name, path, args)

    print(f"\ndecode tok/s, batch 1, {args.precision} weights, float32 compute, {args.threads} thread(s), median of "
          f"{args.reps}; "
          "speed-up vs the full budget (efficiency = speed-up / bytes ratio)")
    for name, res in results.items():
        variants = res["variants"]
        ratios = [f"{a}_over_{b}" for a, b in RATIOS if a in variants and b in variants]
        print(f"{'model':6} {'budget':7} {'read/token':>10} {'ideal':>6} | "
              + " | ".join(f"{v + ' tok/s':>14} {'speed-up':>8} {'eff.':>5}" for v in variants)
              + "".join(f" | {k.replace('_over_', '/'):>16}" for k in ratios))
        for r in res["rows"]:
            cells = [f"{r[v]['tok_s']:14.1f} {r[v]['speedup']:7.2f}x {r[v]['efficiency']:5.2f}" for v in variants]
            print(f"{name:6} {r['budget']:7} {r['read_bytes'] / 2**20:8.1f}MB {r['ideal_speedup']:5.2f}x | "
                  + " | ".join(cells) + "".join(f" | {r[k]:15.2f}x" for k in ratios))
        print(f"{name:6} max |logit difference| of a decode step, kernels against torch: "
              f"{res['max_logit_diff']:.2e}")
        m = res["meet_ns"]
        print(f"{name:6} a meeting of the C step's {args.threads} thread(s): {min(m):.0f}-{max(m):.0f} ns across the "
              f"reps (median {median(m):.0f}); each token passes two dozen")
        used = "; ".join(
            r["budget"] + " " + ", ".join(f"{k} on {c}" for c, k in sorted(r["kernels_thread_tokens"].items()))
            for r in res["rows"])
        print(f"{name:6} kernels' tokens by thread count (model/threads.py): {used}")
        for r in res["rows"][1:]:
            effs = sorted(r["kernels_by_rep"])
            line = f"median {median(effs):.2f}, {effs[0]:.2f}-{effs[-1]:.2f}"
            if args.threads > 1 and (split := by_meeting(m, r["kernels_by_rep"])):
                line += f"; {split}"
            print(f"{name:6} {r['budget']:7} kernels efficiency rep by rep (against the rep's full budget): {line}")
            print(f"{name:6} {r['budget']:7} kernels efficiency counting all a token reads "
                  f"({r['all_read_bytes'] / 2**20:.2f} MB, ideal {r['all_ideal_speedup']:.2f}x): "
                  f"{r['kernels']['speedup'] / r['all_ideal_speedup']:.2f}")
    print(json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
