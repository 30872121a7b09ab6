"""Startup: seconds from starting a fresh process to its end (the commands that need no model) or to the
chat app's first screen and its chat, for this install and, side by side, another checkout's.

    .venv/bin/python benchmarks/bench_startup.py [--against OTHER_CHECKOUT] [--rounds 10] [--app]

A one-word command a user types (`elastic-local --help`, `paths`, `profiles`, `elastic-chat --help`) should
not wait for torch's seconds of import, nor should importing the engine pay for what only a compiled step
needs (torch's symbolic shapes, which import sympy). OTHER_CHECKOUT is a checkout with its own `.venv` (an
older commit, installed with the README's command; bench_revs.py's worktrees have no console scripts, nor
the chat app's package mapping): every round runs each command once on each side,
alternated, so the two see the same machine. With `--app` (tmux needed), also `elastic-chat` until its
first screen and its chat screen show (bench_chat.py's launch times) on each side. It prints each side's
medians and other / this; the last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

COMMANDS = {
    "import the engine": ["python", "-c", "import elastic_local.engine"],  # what a load and a chat import
    "elastic-local --help": ["elastic-local", "--help"],
    "elastic-local paths": ["elastic-local", "paths"],
    "elastic-local profiles": ["elastic-local", "profiles"],
    "elastic-chat --help": ["elastic-chat", "--help"],
}


def seconds(bin_dir: Path, argv: list[str], env: dict, cwd: Path) -> float:
    """`cwd` away from any checkout: `python -c` imports from its working directory first."""
    t0 = time.perf_counter()
    subprocess.run([str(bin_dir / argv[0]), *argv[1:]], env=env, cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", type=Path, help="another checkout with its own .venv, timed side by side")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--app", action="store_true", help="also elastic-chat's first screen and chat (tmux)")
    args = p.parse_args()
    sides = {"this": Path(sys.executable).parent}
    if args.against:
        sides["other"] = (args.against / ".venv" / "bin").resolve()
        if not (sides["other"] / "elastic-local").exists():
            raise SystemExit(f"{args.against}: no .venv/bin/elastic-local (install it with the README's command)")
    home = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    env = {**os.environ, "ELASTIC_LOCAL_HOME": str(home)}
    times = {side: {name: [] for name in COMMANDS} for side in sides}
    launches: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    if args.app:
        from bench_chat import launch_times

        if not shutil.which("tmux"):
            raise SystemExit("--app needs tmux")
        for bin_dir in sides.values():  # each side's kernels built once, untimed (their libraries differ)
            subprocess.run([str(bin_dir / "python"), "-c", "from elastic_local.model import gemv; gemv.library()"],
                           env=env, cwd=home, check=True)
    for r in range(args.rounds):
        for side, bin_dir in sides.items():
            for name, argv in COMMANDS.items():
                times[side][name].append(seconds(bin_dir, argv, env, home))
            if args.app:
                launches[side] += launch_times(None, home, 1, bin_dir / "elastic-chat")
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    shutil.rmtree(home, ignore_errors=True)
    rows = [(name, [times[s][name] for s in sides]) for name in COMMANDS]
    if args.app:
        rows += [(f"elastic-chat, {what}", [[t[i] for t in launches[s]] for s in sides])
                 for i, what in enumerate(("first screen", "chat ready"))]
    print(f"seconds, medians of {args.rounds} fresh processes a side" + (", alternated" if len(sides) > 1 else ""))
    print(f"{'':28}" + "".join(f"{s:>10}" for s in sides) + ("  other / this" if len(sides) > 1 else ""))
    for name, cols in rows:
        meds = [median(c) for c in cols]
        print(f"{name:28}" + "".join(f"{m:10.2f}" for m in meds)
              + (f"  {meds[1] / meds[0]:8.2f}x" if len(meds) > 1 else ""))
    print(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "times": times, "app": launches}))


if __name__ == "__main__":
    main()
