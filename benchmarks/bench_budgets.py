"""Do smaller budgets decode faster in proportion to the bytes they read? Both CPU weight layouts side by side.

    .venv/bin/python benchmarks/bench_budgets.py [--models demo,gen] [--reps 5] [--new-tokens 48] [--threads 1]
                                                 [--compile]

Models: the embedded demo model (5.6M parameters, budgets full / mid / small) and bench_generate.py's
~136M random nested model (full / mid / small at 60% and 35% of the parameters; built once under
benchmarks/_work/gen/). Each is loaded twice in float32: with the CPU inference layout (`Transposed`,
weights kept [in, out], the default) and with `ELASTIC_LOCAL_CPU_LAYOUT=rows` ([out, in], as stored).
Batch-1 greedy decode of --new-tokens tokens after a 32-token prompt, eos ignored, through
`m.generate`; runs interleaved (rep, budget, layout) because the machine is shared and noisy; medians.
`--compile` adds a third load, the [in, out] layout with the decode step compiled (`load(compile=True)`),
each budget compiled in the warm-up.

Columns: `read/token` is the weight bytes a decoded token reads (active parameters: the routed experts it
uses, not the embedding table); `speed-up` is tok/s against the same layout's full budget; `efficiency`
is that speed-up over the ideal one (full bytes / budget bytes): 1.0 means a budget is exactly as much
faster as it reads less. The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYOUTS = ("rows", "transposed")
HEADS = {"rows": "[out,in]", "transposed": "[in,out]", "compiled": "compiled"}


def load(path: Path | None, layout: str):
    import elastic_local
    from elastic_local.engine.load import LAYOUT_ENV

    os.environ[LAYOUT_ENV] = "rows" if layout == "rows" else "transposed"
    try:
        return elastic_local.load(path, dtype=torch.float32, compile=layout == "compiled")
    finally:
        del os.environ[LAYOUT_ENV]


def read_bytes(m, budget: str) -> int:
    from elastic_local.model.budget import count_params

    b = m.budget(budget)
    active = count_params(m.config, b)[1]
    return (active - m.config.vocab_size * b.hidden) * 4  # one embedding row per token, float32


def decode_tok_s(m, budget: str, new_tokens: int) -> float:
    prompt = list(range(20, 52))
    st = m.generate(prompt, answer_budget=budget, max_answer_tokens=new_tokens, ignore_eos=True).stats
    return st.answer_tokens / st.answer_s


def bench(name: str, path: Path | None, args) -> dict:
    layouts = LAYOUTS + (("compiled",) if args.compile else ())
    models = {layout: load(path, layout) for layout in layouts}
    budgets = models["rows"].budgets
    ref = torch.tensor([list(range(20, 52))])
    diff = (models["transposed"].logits(ref) - models["rows"].logits(ref)).abs().max().item()
    for m in models.values():  # warm-up
        for b in budgets:
            decode_tok_s(m, b, 4)
    runs = {(layout, b): [] for layout in layouts for b in budgets}
    for _ in range(args.reps):
        for b in budgets:
            for layout in layouts:
                runs[layout, b].append(decode_tok_s(models[layout], b, args.new_tokens))
    full = budgets[0]
    rows = []
    for b in budgets:
        nbytes = read_bytes(models["rows"], b)
        ideal = read_bytes(models["rows"], full) / nbytes
        row = {"model": name, "budget": b, "read_bytes": nbytes, "ideal_speedup": ideal}
        for layout in layouts:
            tok_s = median(runs[layout, b])
            speedup = tok_s / median(runs[layout, full])
            row[layout] = {"tok_s": tok_s, "speedup": speedup, "efficiency": speedup / ideal}
        row["transposed_over_rows"] = row["transposed"]["tok_s"] / row["rows"]["tok_s"]
        if "compiled" in layouts:
            row["compiled_over_transposed"] = row["compiled"]["tok_s"] / row["transposed"]["tok_s"]
        rows.append(row)
    return {"rows": rows, "max_logit_diff": diff, "layouts": layouts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="demo,gen")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="also the [in, out] layout with a compiled decode step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for name in args.models.split(","):
        if name == "demo":
            path = None
        elif name == "gen":
            import bench_generate

            path = bench_generate.build()
        else:
            raise SystemExit(f"--models: unknown {name!r} (demo, gen)")
        results[name] = bench(name, path, args)

    print(f"\ndecode tok/s, batch 1, float32, {args.threads} thread(s), median of {args.reps}; "
          "speed-up vs the full budget (efficiency = speed-up / bytes ratio)")
    for name, res in results.items():
        layouts = res["layouts"]
        print(f"{'model':6} {'budget':7} {'read/token':>10} {'ideal':>6} | "
              + " | ".join(f"{HEADS[v] + ' tok/s':>14} {'speed-up':>8} {'eff.':>5}" for v in layouts)
              + f" | {'[in,out]/[out,in]':>17}" + (f" | {'compiled/[in,out]':>17}" if "compiled" in layouts else ""))
        for r in res["rows"]:
            cells = [f"{r[v]['tok_s']:14.1f} {r[v]['speedup']:7.2f}x {r[v]['efficiency']:5.2f}" for v in layouts]
            print(f"{name:6} {r['budget']:7} {r['read_bytes'] / 2**20:8.1f}MB {r['ideal_speedup']:5.2f}x | "
                  + " | ".join(cells) + f" | {r['transposed_over_rows']:16.2f}x"
                  + (f" | {r['compiled_over_transposed']:16.2f}x" if "compiled" in layouts else ""))
        print(f"{name:6} max |logit difference| between the layouts: {res['max_logit_diff']:.2e}")
    print(json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
