"""CUDA-graph decode against eager decode on a GPU, side by side in one run (issue #15's CUDA half).

    .venv/bin/python benchmarks/bench_cuda_graphs.py [--configs 30m,100m] [--new-tokens 128] [--reps 3]

Per config (bench_decode's presets, random weights written by random_model.py, on cuda:0, float32 by
default so that the tokens can be compared exactly; --dtype bfloat16 for the speed a user gets), per
budget of a nested checkpoint (full and half): the same prompt decoded greedily by the eager step and by
the graph-replayed step (`load(..., cuda_graphs=True)`), alternated rep by rep. It prints decode tok/s of
each over the steps after the second, their ratio, whether the tokens are equal, and the one-time cost of
the graph: its recording step (the first rep's second step; a cache's first runs eagerly) against a
replayed one. Exits 1
when the tokens differ, so it doubles as the device check.
Needs a CUDA GPU; there is nothing to measure on a CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import CONFIGS  # noqa: E402
from bench_gpu import run  # noqa: E402
from random_model import write_random_parent  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="30m,100m")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda_graphs needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 2
    import elastic_local
    from elastic_local.elastic.nest import nest

    same, dtype = True, getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, {args.new_tokens} new tokens")
    print(f"{'config':8} {'budget':6} {'eager tok/s':>12} {'graphs tok/s':>13} {'ratio':>6} "
          f"{'record ms':>10} {'replay ms':>10} tokens")
    for name in args.configs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            write_random_parent(Path(tmp) / "parent", dict(CONFIGS[name], model_type="nemotron_h"), seed=0)
            nested = nest(Path(tmp) / "parent", Path(tmp) / "nested", {"half": 0.5})
            eager = elastic_local.load(nested, device="cuda", dtype=dtype, cuda_graphs=False)
            graphed = elastic_local.load(nested, device="cuda", dtype=dtype, cuda_graphs=True)
            prompt = torch.randint(0, CONFIGS[name]["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(1))
            prompt = prompt.cuda()
            with torch.inference_mode():
                for budget in eager.budgets:
                    rates: dict[str, list[float]] = {"eager": [], "graphs": []}
                    record = None
                    for _ in range(args.reps):
                        _, t_eager, want = run(eager.net, eager.budget(budget), prompt, args.new_tokens)
                        _, t_graph, got = run(graphed.net, graphed.budget(budget), prompt, args.new_tokens)
                        rates["eager"].append(len(t_eager[2:]) / sum(t_eager[2:]))
                        rates["graphs"].append(len(t_graph[2:]) / sum(t_graph[2:]))
                        # the first rep's second step records; a later rep's new cache may get the freed one's
                        # addresses back from the allocator, and then replays the graph without recording
                        record = t_graph[1] if record is None else record
                        replay = statistics.median(t_graph[2:])
                        same &= got == want
                    e, g = statistics.median(rates["eager"]), statistics.median(rates["graphs"])
                    print(f"{name:8} {budget:6} {e:12.1f} {g:13.1f} {g / e:5.2f}x {record * 1e3:10.1f} "
                          f"{replay * 1e3:10.2f} {'equal' if got == want else 'DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
