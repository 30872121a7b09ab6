"""Time to a first token from a fresh process, cold (the first run after an install) and warm.

    .venv/bin/python benchmarks/bench_cold_start.py [DIR] [--rounds 5] [--budget auto] [--precision fp8]

What a one-time cost spoils is the first reply after a launch, so each side runs in fresh processes,
alternated: `cold` with an empty ELASTIC_LOCAL_HOME (the CPU kernels built from their source, as on the
first launch after an install), `warm` with a home whose kernels one untimed process built. The OS page
cache holds the checkpoint on both sides (dropping it needs root), so `cold` is the kernels' build, not the
disk. A process records, from its own start (the parent's clock before it spawns the process):
`import` (`import elastic_local`), `load` (`elastic_local.load(DIR)`: the weights read, repacked into the
CPU layout, the kernels waited for), `first` (a chat question streamed to its first Token: what the chat
app's first reply waits for after its load) and `second` (a second reply's first token in the same
process: warm in every way). With `--app` (tmux needed), also the chat app: `elastic-chat [DIR]` started in
a tmux pane until its first screen and its chat screen show (bench_chat.py's launch times), cold and warm
alternated the same way. DIR defaults to the embedded demo model. It prints each side's medians and the last line is one
JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

PHASES = ("import", "load", "first", "second")


def worker(path: str | None, budget: str | None, precision: str | None, started: float) -> dict:
    marks = {}
    import elastic_local
    from elastic_local.engine.events import Token

    marks["import"] = time.time() - started
    m = elastic_local.load(path, budget=budget, precision=precision)
    marks["load"] = time.time() - started
    ids = m.chat_prompt("What is 347 + 589?")
    for name in ("first", "second"):
        begun = time.time()
        with m.stream(ids, max_answer_tokens=4) as s:
            next(ev for ev in s if isinstance(ev, Token))
        marks[name] = time.time() - (started if name == "first" else begun)
    return marks


def spawn(args: argparse.Namespace, home: str) -> dict:
    cmd = [sys.executable, __file__, *([args.dir] if args.dir else []), "--worker", repr(time.time())]
    cmd += [f"--budget={args.budget}"] if args.budget else []
    cmd += [f"--precision={args.precision}"] if args.precision else []
    env = {**os.environ, "ELASTIC_LOCAL_HOME": home}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"the worker failed (rc {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--rounds", type=int, default=5, help="processes a side, alternated (default 5)")
    ap.add_argument("--budget")
    ap.add_argument("--precision")
    ap.add_argument("--app", action="store_true", help="also elastic-chat's launch to ready, cold and warm (tmux)")
    ap.add_argument("--worker", type=float, help=argparse.SUPPRESS)  # the parent's clock at the spawn
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.dir, args.budget, args.precision, args.worker)))
        return
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="elastic-cold-") as root:
        warm_home = os.path.join(root, "warm")
        spawn(args, warm_home)  # builds the warm side's kernels, untimed
        for r in range(args.rounds):
            runs["cold"].append(spawn(args, os.path.join(root, f"cold{r}")))
            runs["warm"].append(spawn(args, warm_home))
            print(f"round {r + 1}/{args.rounds}: cold first token {runs['cold'][-1]['first']:.2f} s, "
                  f"warm {runs['warm'][-1]['first']:.2f} s", file=sys.stderr)
        app: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}  # (first screen, chat ready) s
        if args.app:
            from bench_chat import launch_times

            for r in range(args.rounds):
                app["cold"] += launch_times(args.dir, Path(root) / f"app-cold{r}", 1)
                app["warm"] += launch_times(args.dir, Path(warm_home), 1)
    print(f"seconds from the process's start (medians of {args.rounds} processes a side, alternated; "
          "`second`: a second reply's own first token)")
    print(f"{'':6}" + "".join(f"{p:>20}" for p in PHASES))
    summary = {}
    for side, rs in runs.items():
        summary[side] = {p: median(r[p] for r in rs) for p in PHASES}
        cells = [f"{summary[side][p]:.3f} ({min(r[p] for r in rs):.2f}-{max(r[p] for r in rs):.2f})"
                 for p in PHASES]
        print(f"{side:6}" + "".join(f"{c:>20}" for c in cells))
    cost = summary["cold"]["first"] - summary["warm"]["first"]
    print(f"a cold launch's first token waits {cost:.2f} s more than a warm one's "
          f"({summary['cold']['first'] / summary['warm']['first']:.2f}x)")
    if args.app:
        for i, what in enumerate(("its first screen", "its chat screen")):
            print(f"elastic-chat, launch to {what} (tmux): " + ", ".join(
                f"{side} {median(t[i] for t in v):.2f} s ({min(t[i] for t in v):.2f}-{max(t[i] for t in v):.2f})"
                for side, v in app.items()))
    print(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "runs": runs,
                      "summary": summary, "app_launch_s": app}))


if __name__ == "__main__":
    main()
