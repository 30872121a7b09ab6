"""On a CUDA GPU: decode and prefill speed per precision and step kind, and the fit planner's memory
prediction against what loading and running allocates.

    python benchmarks/bench_gpu.py [--config 100m] [--reps 3] [--contexts 4096,16384]

The model: bench_decode's preset (random weights, random_model.py), stored in BF16 as a release stores it,
nested into full and half. Everything loads on cuda:0 in bfloat16, the dtype a GPU user gets.

1. memory (first, in a process that has allocated nothing else: models dropped after the compiled and
   graphed steps ran left ~400 MiB allocated): per budget and context (powers of two: the KV cache grows by
   doubling), a fresh load, a prefill to context - 8 tokens and 8 decode steps (the default step, CUDA
   graphs, whose pool holds the experts it gathers); `max_memory_allocated`
   against the planner's weights + KV + Mamba state + workspace for that candidate (`fit.plan_checkpoint`,
   one cache, no margin),
   and the CUDA context and cuBLAS workspace (after one cuBLAS product) against the planner's
   CUDA_CONTEXT_BYTES. Exits 1 when a measured peak exceeds its prediction.
2. speed: per budget, prefill (--prompt-len tokens, one forward) and decode (--new-tokens greedy steps) of
   BF16 with the eager step, the CUDA-graph step (`cuda_graphs=True`) and the compiled step
   (`compile=True`), and of FP8 and NVFP4 quantized while loading, eager and CUDA-graph (the compiled step
   covers float weights). Engines alternate rep by rep; medians; ratios against BF16 eager in the same run. The
   compiled step's first decode step (its compilation, once per budget and process) and the graph's
   recording step are reported as one-time costs.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import CONFIGS  # noqa: E402
from random_model import write_random_parent  # noqa: E402

MIB = 2**20


def build(root: Path, config: dict) -> Path:
    """A random parent, nested into full / half, stored in BF16 (router, A_log, D, dt_bias in float32)."""
    from safetensors.torch import load_file, save_file

    from elastic_local.elastic.nest import nest
    from elastic_local.model.schema import keeps_fp32

    write_random_parent(root / "parent", dict(config, model_type="nemotron_h"), seed=0)
    nested = nest(root / "parent", root / "nested", {"half": 0.5}, max_tokens=1024)
    for f in nested.glob("model*.safetensors"):
        t = load_file(f)
        save_file({k: v if keeps_fp32(k) else v.to(torch.bfloat16) for k, v in t.items()}, f,
                  metadata={"format": "pt"})
    return nested


def timed(fn) -> tuple[object, float]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def run(net, budget, prompt: torch.Tensor, n: int) -> tuple[float, list[float], list[int]]:
    """Prefill seconds, each decode step's seconds, the greedy tokens."""
    cache = net.new_cache(1, budget=budget, capacity=prompt.shape[1] + n + 1)
    logits, prefill = timed(lambda: net.forward(prompt, cache=cache, last_only=True))
    tok = logits[:, -1:].argmax(-1)
    steps, toks = [], [int(tok)]
    for _ in range(n):
        logits, s = timed(lambda tok=tok: net.forward(tok, cache=cache))
        tok = logits[:, -1:].argmax(-1)
        steps.append(s)
        toks.append(int(tok))
    return prefill, steps, toks


def speed(nested: Path, args) -> None:
    import elastic_local

    engines = {
        "bf16 eager": elastic_local.load(nested, device="cuda", dtype=torch.bfloat16, cuda_graphs=False),
        "bf16 graphs": elastic_local.load(nested, device="cuda", dtype=torch.bfloat16, cuda_graphs=True),
        "bf16 compiled": elastic_local.load(nested, device="cuda", dtype=torch.bfloat16, compile=True),
    }
    for precision in ("fp8", "nvfp4"):
        for graphs in (False, True):
            engines[f"{precision} {'graphs' if graphs else 'eager'}"] = elastic_local.load(
                nested, device="cuda", dtype=torch.bfloat16, precision=precision, cuda_graphs=graphs)
    vocab = engines["bf16 eager"].config.vocab_size
    prompt = torch.randint(3, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(1)).cuda()
    print(f"\n2. speed: {args.prompt_len}-token prefill, {args.new_tokens} decode steps (steps after the second), "
          f"medians of {args.reps} reps")
    print(f"{'budget':6} {'engine':14} {'prefill tok/s':>13} {'decode tok/s':>12} {'vs bf16 eager':>13} "
          f"{'first steps ms':>15}  tokens vs bf16 eager")
    with torch.inference_mode():
        for budget in engines["bf16 eager"].budgets:
            pre: dict[str, list[float]] = {e: [] for e in engines}
            dec: dict[str, list[float]] = {e: [] for e in engines}
            first: dict[str, list[float]] = {}
            toks: dict[str, list[int]] = {}
            for rep in range(args.reps):
                order = list(engines.items())
                for e, m in order[rep % len(order):] + order[:rep % len(order)]:
                    p, steps, toks[e] = run(m.net, m.budget(budget), prompt, args.new_tokens)
                    pre[e].append(args.prompt_len / p)
                    dec[e].append(len(steps[2:]) / sum(steps[2:]))
                    first.setdefault(e, steps[:2])  # the first rep's: compilation, graph recording
            base = statistics.median(dec["bf16 eager"])
            for e in engines:
                d = statistics.median(dec[e])
                same = "equal" if toks[e] == toks["bf16 eager"] else (
                    f"{sum(a == b for a, b in zip(toks[e], toks['bf16 eager']))}/{len(toks[e])} equal")
                print(f"{budget:6} {e:14} {statistics.median(pre[e]):13.0f} {d:12.1f} {d / base:12.2f}x "
                      f"{' / '.join(f'{s * 1e3:.0f}' for s in first[e]):>15}  {same}")
    del engines
    gc.collect()  # a model whose steps were compiled or recorded is in reference cycles: freed by the collector
    torch.cuda.empty_cache()


def runtime_bytes() -> tuple[int, int]:
    """(CUDA context, cuBLAS workspace) after one cuBLAS product with no tensor left: device memory in use
    outside torch's allocator, and what the allocator still holds for cuBLAS (its workspace lives there).
    Measured first, in a process that has run nothing else."""
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    del a
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved(), torch.cuda.memory_allocated()


def memory(nested: Path, args) -> bool:
    import elastic_local
    from elastic_local.hardware import fit, planner

    profile = fit.live_profile("cuda")
    ctx, cublas = runtime_bytes()
    print(f"\n1. memory on {profile.description}: CUDA context {ctx / MIB:.0f} MiB and cuBLAS workspace "
          f"{cublas / MIB:.1f} MiB measured, {planner.CUDA_CONTEXT_BYTES / MIB:.0f} MiB planned for both")
    print(f"{'budget':6} {'context':>7} {'weights MiB':>11} {'predicted MiB':>13} {'peak MiB':>9} "
          f"{'peak/pred':>9} {'reserved MiB':>12}   (peak and weights: allocated beyond the cuBLAS workspace)")
    ok = True
    for budget in ("full", "half"):
        for context in (int(c) for c in args.contexts.split(",")):
            plan = fit.plan_checkpoint(nested, profile, context=context, caches=1, margin_bytes=0)
            c = next(c for c in plan.candidates if (c.budget, c.precision) == (budget, "bf16"))
            want = c.weights_bytes + c.kv_bytes + c.state_bytes + c.workspace_bytes
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            m = elastic_local.load(nested, budget=budget, device="cuda", dtype=torch.bfloat16)
            loaded = torch.cuda.memory_allocated() - cublas
            ids = torch.randint(3, m.config.vocab_size, (1, context - 8), generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                cache = m.new_cache(1, budget)
                logits = m.forward(ids.cuda(), cache, last_only=True)
                for _ in range(8):
                    logits = m.forward(logits[:, -1].argmax(-1, keepdim=True), cache, last_only=True)
            torch.cuda.synchronize()
            peak, reserved = torch.cuda.max_memory_allocated() - cublas, torch.cuda.max_memory_reserved()
            ok &= peak <= want
            print(f"{budget:6} {context:7} {loaded / MIB:11.1f} {want / MIB:13.1f} {peak / MIB:9.1f} "
                  f"{peak / want:8.2f}x {reserved / MIB:12.1f}")
            del m, cache, logits
            gc.collect()  # the graph step's closures hold the model in a cycle
    torch.cuda.empty_cache()
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="100m", choices=sorted(CONFIGS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--contexts", default="4096,16384")
    p.add_argument("--sections", default="speed,memory")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, config {args.config}")
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        nested = build(Path(tmp), CONFIGS[args.config])
        print(f"built and nested in {time.perf_counter() - t:.1f} s")
        sections = args.sections.split(",")
        ok = memory(nested, args) if "memory" in sections else True  # first: nothing else allocated yet
        if "speed" in sections:
            speed(nested, args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
