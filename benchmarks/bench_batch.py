"""Batch files on a CPU: continuous batching against the same requests one at a time, and peak memory
against the fit planner's figure.

    .venv/bin/python benchmarks/bench_batch.py [--model demo|random] [--requests 16] [--batches 4,8,16]
        [--mixes short,mixed,long] [--reps 3] [--threads N] [--skip-memory] [--skip-throughput]

The model: the embedded demo model (`elastic_local.load()`) when it is installed, else (or with
`--model random`) bench_generate.py's 136M-parameter random nested model (budgets full / mid / small,
`</think>` pinned so thinking always ends at the think budget). Float32, as the CLI loads on a CPU.

0. the batched step: one decode step of 1 and of each `--batches` rows (positions 20-40), step.c's
   rows (`DecodeStep.rows`: every product once for all the rows) against the torch layers (the batched
   step before it), and its tokens a second against one row's C step; medians, interleaved.
1. throughput: `--requests` requests per mix of prompt lengths. On the demo model: chats of its own
   held-out questions, "short" (one question, ~20 tokens), "long" (the question after 8 earlier answered
   turns, ~200-400 tokens), "mixed" (0-8 earlier turns), rendered with every turn in ChatML (engine.chat's
   template for files that ship none; the demo's own shows only the latest question) and sent as
   /v1/completions lines of their token ids. On the random model: /v1/completions
   lines of random token ids ending in `<think>`, short (16..48 tokens), mixed (16..384), long (256..384).
   Each thinks 24 tokens (then the think budget appends `</think>` alone) and answers 24, eos ignored
   (every request generates the same count); every phase on the largest budget, or ("cycled") the think budget cycling
   through the model's budgets so that rows on different budgets share the batch. The file is parsed by
   the batch reader (requests.py); the same jobs then run one at a time (a Generation each) and through
   `run_jobs` (continuous batching) at each `--batches` size, and "adaptive": up to the largest size where
   the first jobs' timing says batching is the faster (scheduler.Admission, what `elastic-local batch` runs);
   interleaved, `--reps` times (medians).
   Generated tokens per second of wall time, the ratio to one at a time, and how many requests came out
   token for token identical to their run alone. `--catch-ups-alone` adds each fixed batch with every
   catch-up (a joining prompt, the tokens that close thinking) in a call of its own, as before they ran
   in the decoding rows' step, and prints together / alone.
2. memory: in a fresh process, the model loaded in bf16 (what the planner plans for), the "mixed" file at
   the largest batch size; peak RSS while the batch runs (the peak reset after loading) against the
   planner's total for that budget at that batch size, context (the longest request's capacity) and
   number of caches (budgets in play), without its safety margin.

The machine is shared: read the ratios (measured side by side), not the absolute rates. The last line is
one JSON object with every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
MIXES = {"short": (16, 48), "mixed": (16, 384), "long": (256, 384)}
THINK, ANSWER = 24, 24


def model_path(which: str) -> Path | None:
    """None: the embedded demo model; else the random nested model's directory (built once)."""
    demo = ROOT / "elastic_local" / "catalog" / "demo"
    if which == "demo" or (which == "auto" and (demo / "config.json").is_file()):
        return None
    from bench_generate import build

    return build()


def load(path: Path | None, dtype: torch.dtype):
    import elastic_local

    m = elastic_local.load(path, dtype=dtype) if path is not None else elastic_local.load(dtype=dtype)
    if path is not None:
        m.net.silence(m.tokenizer.think_ids[1])  # the random model never writes </think> itself
    return m


def demo_messages(mix: str, i: int, g: torch.Generator) -> list[dict]:
    """A chat of the demo's own held-out questions: "short" one question (~20 prompt tokens), "long" that
    question after earlier answered turns (~200-400 tokens of history), "mixed" either, drawn."""
    from elastic_local.evaluate.run import eval_items

    pool = eval_items(3, seed=4321)
    pick = lambda: pool[int(torch.randint(len(pool), (1,), generator=g))]  # noqa: E731
    turns = {"short": 0, "long": 8, "mixed": int(torch.randint(0, 9, (1,), generator=g))}[mix]
    messages = []
    for _ in range(turns):  # earlier turns as the chat template keeps them: question, answer
        item = pick()
        messages += [{"role": "user", "content": item.question}, {"role": "assistant", "content": item.answer}]
    return messages + [{"role": "user", "content": pick().question}]


def jobs_for(m, mix: str, n: int, cycled: bool, seed: int = 0) -> list:
    """`n` requests parsed by the batch reader: on the demo model, chat requests of its own held-out
    questions (demo_messages); on the random model, completions of random token ids of the mix's lengths.
    With `cycled` the think budget cycles through the model's budgets, else every phase runs on the
    largest. Every request thinks THINK and answers ANSWER tokens (eos ignored), so all runs do equal work."""
    from elastic_local.batch.requests import Checker, parse
    from elastic_local.engine.chat import ChatTemplate

    lo, hi = MIXES[mix]
    g = torch.Generator().manual_seed(seed)
    demo = m.path.name == "demo"
    think = m.tokenizer.think_ids[0]
    lines = []
    for i in range(n):
        if demo:
            text = ChatTemplate(None).render(demo_messages(mix, i, g))
            url, body = "/v1/completions", {"prompt": m.tokenizer.encode(text)}
        else:
            length = int(torch.randint(lo, hi + 1, (1,), generator=g))
            ids = torch.randint(100, m.config.vocab_size, (length,), generator=g).tolist() + [think]
            url, body = "/v1/completions", {"prompt": ids}
        body.update(max_think_tokens=THINK, max_tokens=ANSWER)
        if cycled:
            body["think_budget"] = m.budgets[i % len(m.budgets)]
        lines.append((i + 1, json.dumps({"custom_id": f"{mix}-{i}", "method": "POST", "url": url, "body": body})))
    jobs = parse(lines, Checker.for_model(m).job)
    for j in jobs:
        j.request.ignore_eos = True  # fixed lengths
        j.request.think_close = ""  # the think budget appends `</think>` alone: every token is the model's
    return jobs


def one_at_a_time(m, jobs) -> tuple[float, dict]:
    from elastic_local.engine import Generation

    t = time.perf_counter()
    out = {j.custom_id: Generation(m, [j.prompt], j.request).collect()[0] for j in jobs}
    return time.perf_counter() - t, out


def batched(m, jobs, max_batch: int, fixed: bool = True) -> tuple[float, dict]:
    """run_jobs at `max_batch` rows, or (`fixed` False, the CLI's way) up to it where batching is the faster."""
    from elastic_local.batch.scheduler import Admission, run_jobs

    t = time.perf_counter()
    out = {j.custom_id: r for j, r in run_jobs(m, jobs, max_batch=max_batch, admission=Admission(fixed))}
    return time.perf_counter() - t, out


@contextlib.contextmanager
def torch_layers(m):
    """Every decode step on the torch layers (the batched step before step.c's decode_rows)."""
    from unittest import mock

    from elastic_local.model import step

    m.net.c_steps.clear()
    with mock.patch.object(step, "build", lambda net, b: None):
        yield
    m.net.c_steps.clear()


@torch.inference_mode()
def step_seconds(m, rows: int, steps: int = 20) -> float:
    """Seconds of one decode step of `rows` rows on the largest budget, at positions 20-40 (rows prefilled
    alone, then stacked), the median of `steps` steps."""
    from elastic_local.model.nemotron_h import HybridCache

    g = torch.Generator().manual_seed(rows)
    caches = []
    for r in range(rows):
        c = m.new_cache(1)
        m.forward(torch.randint(10, m.config.vocab_size, (1, 20 + r % 20), generator=g), cache=c)
        caches.append(c)
    cache = caches[0] if rows == 1 else HybridCache.stack(caches)
    ids = torch.randint(10, m.config.vocab_size, (rows, 1), generator=g)
    times = []
    for _ in range(steps + 2):
        t = time.perf_counter()
        m.forward(ids, cache=cache)
        times.append(time.perf_counter() - t)
    return median(times[2:])


def bench_step(m, args) -> dict:
    """The batched decode step alone: step.c's rows (one product per weight for every row) against the
    torch layers, and against one row's C step, interleaved."""
    sizes = [1, *args.batches]
    times = {(b, way): [] for b in sizes for way in ("c", "torch")}
    for _ in range(args.reps):
        for b in sizes:
            times[(b, "c")].append(step_seconds(m, b))
            with torch_layers(m):
                times[(b, "torch")].append(step_seconds(m, b))
    one = median(times[(1, "c")])
    report = {}
    for b in sizes:
        c, t = median(times[(b, "c")]), median(times[(b, "torch")])
        report[b] = {"c_ms": 1e3 * c, "torch_ms": 1e3 * t, "c_tps": b / c, "vs_torch": t / c, "vs_one_row": b * one / c}
        print(f"step of {b:>2} rows: C {1e3 * c:6.3f} ms ({b / c:8.0f} tok/s) | torch layers {1e3 * t:6.3f} ms | "
              f"C x{t / c:.2f} torch's, x{b * one / c:.2f} one row's tok/s", file=sys.stderr)
    return report


@contextlib.contextmanager
def catch_ups_alone():
    """Every catch-up in a call of its own on a copy of its row, as before they joined the decoding rows'
    step (`CacheSet._joins` declining every row)."""
    from unittest import mock

    from elastic_local.engine.cacheset import CacheSet

    with mock.patch.object(CacheSet, "_joins", lambda self, *a: False):
        yield


def bench_throughput(m, args) -> dict:
    report = {}
    batched(m, jobs_for(m, "short", 2, True), 2)  # warm-up
    for mix in args.mixes:
        for budgets in ("largest", "cycled"):
            jobs = jobs_for(m, mix, args.requests, budgets == "cycled")
            sizes = [*args.batches, "adaptive"]  # adaptive: up to the largest, as the CLI runs (scheduler.Admission)
            if args.catch_ups_alone:
                sizes += [f"{b} alone" for b in args.batches]
            times: dict[str, list[float]] = {"alone": [], **{str(b): [] for b in sizes}}
            same = {}
            for _ in range(args.reps):  # interleaved: one run of each per rep, medians
                s, alone = one_at_a_time(m, jobs)
                times["alone"].append(s)
                for b in sizes:
                    if b == "adaptive":
                        s, out = batched(m, jobs, max(args.batches), False)
                    elif isinstance(b, str):
                        with catch_ups_alone():
                            s, out = batched(m, jobs, int(b.split()[0]))
                    else:
                        s, out = batched(m, jobs, b)
                    times[str(b)].append(s)
                    same[b] = sum(out[k].ids == alone[k].ids for k in alone)
            tokens = sum(len(r.ids) - r.prompt_len for r in alone.values())
            seconds = median(times["alone"])
            row = {"mix": mix, "budgets": budgets, "prompt_tokens": sum(len(j.prompt) for j in jobs),
                   "generated": tokens, "one_at_a_time_tps": tokens / seconds, "batched": {}}
            for b in sizes:
                t = median(times[str(b)])
                row["batched"][b] = {"tps": tokens / t, "ratio": seconds / t, "identical": same[b]}
            report[f"{mix}/{budgets}"] = row
            print(f"{mix:<6} {budgets:<8} {row['prompt_tokens']:>5} prompt tok, {tokens} generated: one at a time "
                  f"{row['one_at_a_time_tps']:6.1f} tok/s | " + " | ".join(
                      f"batch {b}: {v['tps']:6.1f} tok/s x{v['ratio']:.2f} ({v['identical']}/{len(jobs)} same)"
                      for b, v in row["batched"].items()), file=sys.stderr)
            if args.catch_ups_alone:
                row["catch_ups_together_over_alone"] = {
                    b: median(times[f"{b} alone"]) / median(times[str(b)]) for b in args.batches}
                print(f"{'':15} catch-ups in the decoding rows' step / alone: " + ", ".join(
                    f"batch {b} x{r:.3f}" for b, r in row["catch_ups_together_over_alone"].items()), file=sys.stderr)
    return report


# ---------------------------------------------------------------------------------------------- memory


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f)
                if k in ("VmRSS", "VmHWM")}


def memory_case(path: str, requests: int, max_batch: int) -> dict:
    """Runs in a fresh process (--memory-case)."""
    from elastic_local.batch.scheduler import Admission, Memory, run_jobs

    m = load(None if path == "demo" else Path(path), torch.bfloat16)
    jobs = jobs_for(m, "mixed", requests, True)
    loaded = _status()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on excludes loading
    cost = Memory.of(m, None)
    budgets = {j.request.think_budget or m.budgets[0] for j in jobs} | {m.budgets[0]}
    capacity = max(j.capacity for j in jobs)
    list(run_jobs(m, jobs, max_batch=max_batch, admission=Admission(fixed=True)))
    peak = _status()["VmHWM"]
    return {"rss_after_load": loaded["VmRSS"], "run_peak": peak, "budgets": sorted(budgets), "capacity": capacity,
            "caches_bytes": cost.bytes(min(max_batch, len(jobs)), capacity, budgets), "resident": m.budgets[0],
            "path": str(m.path)}


def bench_memory(path: Path | None, args) -> dict:
    from elastic_local.hardware import fit
    from elastic_local.hardware.profiles import GIB, Profile

    b = max(args.batches)
    cmd = [sys.executable, __file__, "--memory-case", str(path or "demo"), str(args.requests), str(b)]
    case = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    from elastic_local.model import gemv

    cpu = Profile(name="bench", description="this CPU", kind="cpu", memory_bytes=1024 * GIB, memory_bandwidth_gbps=None,
                  cpu_kernels=gemv.runs_here())  # where they run, a batch's rows step in place: no copies
    plan = fit.plan_checkpoint(case["path"], cpu, context=case["capacity"], caches=len(case["budgets"]),
                               batch=min(b, args.requests), margin_bytes=0)
    c = next(c for c in plan.candidates if (c.budget, c.precision) == (case["resident"], "bf16"))
    out = {**case, "batch": b, "planned_total": c.total_bytes, "planned_kv_state": c.kv_bytes + c.state_bytes,
           "ratio": case["run_peak"] / c.total_bytes}
    mib = 2**20
    print(f"memory (bf16, batch {b}, context {case['capacity']}, {len(case['budgets'])} caches): peak RSS "
          f"{case['run_peak'] / mib:.0f} MiB vs planned {c.total_bytes / mib:.0f} MiB (x{out['ratio']:.2f}); "
          f"caches {case['caches_bytes'] / mib:.1f} MiB measured from the model vs planned "
          f"{out['planned_kv_state'] / mib:.1f} MiB", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["auto", "demo", "random"], default="auto")
    ap.add_argument("--requests", type=int, default=16, help="requests per mix (default 16)")
    ap.add_argument("--batches", default="4,8,16", help="max batch sizes (default 4,8,16)")
    ap.add_argument("--mixes", default=",".join(MIXES), help=f"prompt-length mixes (default {','.join(MIXES)})")
    ap.add_argument("--reps", type=int, default=3, help="interleaved runs of each, medians (default 3)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true", help="the batched step alone")
    ap.add_argument("--catch-ups-alone", action="store_true",
                    help="also each fixed batch with every catch-up in a call of its own (before a9089b7)")
    ap.add_argument("--memory-case", nargs=3, metavar=("PATH", "REQUESTS", "BATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_case:
        path, n, b = args.memory_case
        print(json.dumps(memory_case(path, int(n), int(b))))
        return 0
    args.batches = [int(b) for b in args.batches.split(",")]
    args.mixes = args.mixes.split(",")
    path = model_path(args.model)
    m = load(path, torch.float32)
    print(f"model: {m.path} budgets {m.budgets}, {torch.get_num_threads()} threads", file=sys.stderr)
    report = {"model": str(m.path), "budgets": m.budgets, "requests": args.requests, "step": bench_step(m, args)}
    if not args.skip_throughput:
        report["throughput"] = bench_throughput(m, args)
    if not args.skip_memory:
        report["memory"] = bench_memory(path, args)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
