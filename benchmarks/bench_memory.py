"""Predicted vs measured peak memory: the fit planner against the process's resident set on this CPU.

    .venv/bin/python benchmarks/bench_memory.py [--contexts 2048,8192] [--precisions bf16,fp8,nvfp4]

A nested model big enough that its weights dominate (~290M parameters, ~0.55 GiB in BF16: hidden 1024,
vocab 32000, 12 layers `MEMEM*EMEM*E`, 32 experts, 8 KV heads x 128 so that the KV cache grows visibly) is
written once under benchmarks/_work/mem/: random weights in the hub layout, nested by `elastic_local.nest`
into budgets full / p60 / p35 (60% and 35% of the parameters), stored as a BF16 release stores them (bf16;
router, A_log, D, dt_bias fp32).

Each case (budget x precision x context) runs in a fresh Python process:
    import torch and elastic_local                          -> RSS after imports (the process baseline)
    load(dir, budget, precision, dtype=torch.bfloat16)      -> peak RSS while loading
    reset the peak (/proc/self/clear_refs 5), new cache, prefill context - 8 tokens with
    forward(ids, cache, last_only=True) (the engine chunks it by 1024), decode 8 tokens greedily
                                                            -> peak RSS while running
The prediction is the planner's total for that candidate with one cache (batch 1) and no safety margin:
weights + KV + Mamba state + workspace + the CPU runtime constant (planner.CPU_RUNTIME_BYTES). Loading is
in bf16 because the planner plans bf16 compute (weight_bytes are bf16 sizes; a float32 load would double
weights, cache and activations). fp8 / nvfp4 are quantized from the BF16 file while loading; a runtime
without that prints "not available".

Contexts are powers of two and the run stops exactly at them: the engine's KV cache grows by doubling
(model/attention.py `KVCache.grow`), so a context just past a power of two holds up to twice the KV the
planner counts for it (see the README's notes).

The loader reads the safetensors files memory-mapped and keeps zero-copy views where a tensor needs no
slicing or conversion (embeddings, lm_head, router, shared experts of the full budget), so the mapping
stays open after loading and every page of the file read while loading stays in the RSS as file-backed,
clean page cache, though most of it backs no tensor (experts, Mamba and attention weights were copied out of
it). Such pages are reclaimable and counted as available by the planner's own RAM probe (psutil), so
"run peak" is the peak RSS while running less the file's resident pages plus the bytes of the tensors
that are views of it (from /proc/self/smaps and the tensors' addresses); "rss peak" is the raw figure. A
GPU run copies every weight to the device, where this does not arise. Peak RSS while loading is printed
for completeness. The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / "_work" / "mem"
SEED = 0
DECODE = 8
BUDGETS = {"p60": 0.6, "p35": 0.35}
CONFIG = dict(
    model_type="nemotron_h", architectures=["NemotronHForCausalLM"], vocab_size=32000, hidden_size=1024,
    hybrid_override_pattern="MEMEM*EMEM*E", mamba_num_heads=32, mamba_head_dim=64, n_groups=4,
    ssm_state_size=64, conv_kernel=4, chunk_size=128, use_conv_bias=True, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, intermediate_size=1024, n_routed_experts=32, num_experts_per_tok=4,
    moe_intermediate_size=512, moe_shared_expert_intermediate_size=1024, n_shared_experts=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1, layer_norm_epsilon=1e-5,
    tie_word_embeddings=False, mamba_hidden_act="silu", mlp_hidden_act="relu2", bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)


# ------------------------------------------------------------------------------------------ memory readings

def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in bytes (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _checkpoint_mappings() -> tuple[int, list[tuple[int, int]]]:
    """(resident bytes of memory-mapped *.safetensors files, their address ranges), from /proc/self/smaps."""
    rss, ranges, current = 0, [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
                current = line.rstrip().endswith(".safetensors")
                if current:
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    ranges.append((lo, hi))
            elif current and line.startswith("Rss:"):
                rss += int(line.split()[1]) * 1024
    return rss, ranges


def _views_of_the_file(m, ranges: list[tuple[int, int]]) -> int:
    """Bytes of the model's tensors that are views into a mapped weight file (zero-copy loads)."""
    return sum(t.nbytes for t in m.net.tensors() if any(lo <= t.data_ptr() < hi for lo, hi in ranges))


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0): the running peak then excludes loading."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------ the checkpoint

def build(rebuild: bool = False) -> Path:
    """benchmarks/_work/mem/nested: random weights, nested into full / p60 / p35, stored in BF16."""
    import shutil

    import torch
    from random_model import write_random_parent
    from safetensors.torch import load_file, save_file

    from elastic_local.elastic.nest import nest
    from elastic_local.model.schema import keeps_fp32

    out = WORK / "nested"
    stamp = WORK / "config.stamp.json"
    key = json.dumps({"config": CONFIG, "budgets": BUDGETS, "seed": SEED}, sort_keys=True)
    if out.is_dir() and stamp.is_file() and stamp.read_text() == key and not rebuild:
        return out
    shutil.rmtree(WORK, ignore_errors=True)
    parent = WORK / "parent"
    write_random_parent(parent, CONFIG, SEED)
    print(f"nesting {parent} (random weights) ...", file=sys.stderr)
    nest(parent, WORK / "f32", BUDGETS, max_tokens=2048)
    shutil.copytree(WORK / "f32", out)
    for f in out.glob("model*.safetensors"):
        t = load_file(f)
        save_file({k: v if keeps_fp32(k) else v.to(torch.bfloat16) for k, v in t.items()}, f,
                  metadata={"format": "pt"})
    shutil.rmtree(WORK / "f32")
    shutil.rmtree(parent)
    stamp.write_text(key)
    return out


# ------------------------------------------------------------------------------------------ one case

def run_case(path: str, budget: str, precision: str, context: int) -> dict:
    """Runs in a fresh process: load, then prefill and decode to exactly `context` tokens."""
    t0 = time.perf_counter()
    import torch

    import elastic_local

    base = _status()
    try:
        m = elastic_local.load(path, budget=budget, precision=None if precision == "bf16" else precision,
                               dtype=torch.bfloat16)
    except NotImplementedError as e:
        return {"available": False, "why": str(e)}
    loaded = _status()
    reset = _reset_peak()
    cache = m.new_cache(1, budget)
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(3, m.config.vocab_size, (1, context - DECODE), generator=g)
    t1 = time.perf_counter()
    with torch.inference_mode():
        logits = m.forward(ids, cache, last_only=True)
        for _ in range(DECODE):
            logits = m.forward(logits[:, -1].argmax(-1, keepdim=True), cache, last_only=True)
    assert cache.lengths == [context]
    run = _status()
    mapped, ranges = _checkpoint_mappings()
    views = _views_of_the_file(m, ranges)
    peak = run["VmHWM"] if reset else max(run["VmHWM"], loaded["VmHWM"])
    return {"available": True, "rss_after_imports": base["VmRSS"], "file_after_imports": base["RssFile"],
            # the process itself: RSS after imports plus shared-library pages first touched while running
            "process": base["VmRSS"] + run["RssFile"] - mapped - base["RssFile"],
            "load_peak": loaded["VmHWM"],
            "rss_after_load": loaded["VmRSS"], "anon_after_load": loaded["RssAnon"],
            "file_after_load": loaded["RssFile"], "run_peak_rss": peak, "peak_reset": reset,
            "checkpoint_pages": mapped, "views_of_checkpoint": views,
            # the peak less the weight file's page cache that no tensor uses (clean, reclaimable)
            "run_peak": peak - mapped + views, "cache_bytes": cache.nbytes(),
            "seconds_load": t1 - t0, "seconds_run": time.perf_counter() - t1}


# ------------------------------------------------------------------------------------------ the table

def predicted(path: Path, budget: str, precision: str, context: int):
    from elastic_local.hardware import fit
    from elastic_local.hardware.profiles import GIB, Profile

    cpu = Profile(name="bench", description="this CPU", kind="cpu", memory_bytes=1024 * GIB,
                  memory_bandwidth_gbps=None)
    p = fit.plan_checkpoint(path, cpu, context=context, caches=1, margin_bytes=0)
    return next(c for c in p.candidates if (c.budget, c.precision) == (budget, precision))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="2048,8192", help="tokens per case, powers of two >= 1024")
    ap.add_argument("--precisions", default="bf16,fp8,nvfp4")
    ap.add_argument("--budgets", default="full,p60,p35")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the checkpoint")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment of the case processes, e.g. ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 (repeatable)")
    ap.add_argument("--case", nargs=4, metavar=("DIR", "BUDGET", "PRECISION", "CONTEXT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:
        path, budget, precision, context = args.case
        print(json.dumps(run_case(path, budget, precision, int(context))))
        return 0

    sys.path.insert(0, str(ROOT))
    from elastic_local.hardware.planner import CPU_RUNTIME_BYTES

    path = build(args.rebuild)
    contexts = [int(c) for c in args.contexts.split(",")]
    if any(c < 1024 or c & (c - 1) for c in contexts):
        ap.error("--contexts: powers of two >= 1024 (the KV cache grows by doubling)")
    env = {**os.environ, **dict(e.split("=", 1) for e in args.env)}
    mib = 2**20
    print(f"environment: {' '.join(args.env) or 'as inherited'}")
    print(f"checkpoint {path}; torch threads: {os.cpu_count()} cores; planner CPU runtime constant "
          f"{CPU_RUNTIME_BYTES / mib:.0f} MiB; sizes in MiB")
    cols = ("budget", "prec", "ctx", "weights", "kv", "state", "work", "pred", "run peak", "ratio",
            "rss peak", "base", "run-base", "pred-rt", "load peak", "s")
    print(" ".join(f"{c:>9}" for c in cols))
    rows = []
    for budget in args.budgets.split(","):
        for precision in args.precisions.split(","):
            for context in contexts:
                proc = subprocess.run([sys.executable, __file__, "--case", str(path), budget, precision,
                                       str(context)], capture_output=True, text=True, cwd=ROOT, env=env)
                if proc.returncode:
                    print(f"{budget:>9} {precision:>9} {context:>9} failed: {proc.stderr.strip()[-400:]}")
                    rows.append({"budget": budget, "precision": precision, "context": context, "failed":
                                 proc.stderr.strip()[-2000:]})
                    continue
                m = json.loads(proc.stdout.strip().splitlines()[-1])
                if not m["available"]:
                    print(f"{budget:>9} {precision:>9} {context:>9} not available ({m['why']})")
                    rows.append({"budget": budget, "precision": precision, "context": context, **m})
                    continue
                c = predicted(path, budget, precision, context)
                measured = m["run_peak"]
                row = {"budget": budget, "precision": precision, "context": context, "predicted": c.total_bytes,
                       "weights": c.weights_bytes, "kv": c.kv_bytes, "state": c.state_bytes,
                       "workspace": c.workspace_bytes, "runtime": c.overhead_bytes, "measured": measured,
                       "ratio": measured / c.total_bytes, "runtime_measured": m["process"], **m}
                rows.append(row)
                vals = (c.weights_bytes, c.kv_bytes, c.state_bytes, c.workspace_bytes, c.total_bytes, measured)
                print(f"{budget:>9} {precision:>9} {context:>9} " + " ".join(f"{v / mib:9.1f}" for v in vals)
                      + f" {row['ratio']:9.3f} {m['run_peak_rss'] / mib:9.1f} {m['rss_after_imports'] / mib:9.1f}"
                      f" {(measured - m['rss_after_imports']) / mib:9.1f}"
                      f" {(c.total_bytes - c.overhead_bytes) / mib:9.1f} {m['load_peak'] / mib:9.1f}"
                      f" {m['seconds_load'] + m['seconds_run']:9.1f}")
    ok = [r for r in rows if "ratio" in r]
    if ok:
        worst = max(ok, key=lambda r: abs(r["ratio"] - 1))
        extra = sorted(r["measured"] - (r["predicted"] - r["runtime"]) for r in ok)
        proc = sorted(r["runtime_measured"] for r in ok)
        print(f"worst ratio {worst['ratio']:.3f} ({worst['budget']} {worst['precision']} {worst['context']}); "
              f"the process (RSS after imports + library pages touched while running): median "
              f"{proc[len(proc) // 2] / mib:.0f} MiB (planner constant {CPU_RUNTIME_BYTES / mib:.0f}); "
              f"measured - (weights + kv + state + workspace): {extra[0] / mib:.0f}..{extra[-1] / mib:.0f} MiB")
    print(json.dumps({"checkpoint": str(path), "cpu_runtime_bytes": CPU_RUNTIME_BYTES, "env": args.env,
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
