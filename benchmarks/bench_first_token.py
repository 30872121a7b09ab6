"""How soon a stream's first token comes: the engine's one thread against a thread per stream.

    .venv/bin/python benchmarks/bench_first_token.py [DIR] [--processes 6] [--streams 18]

Each side runs in its own processes, alternated (the cost measured is a process's OpenMP teams, which one
process cannot undo for the other): `engine` is the shipped Stream (every generation on `stream.ENGINE`'s
thread), `thread` the same Stream with each generation on a new thread of its own, as streams ran before
a9a1b5f. A process loads the model (DIR, default the embedded demo), then times --streams streams of the
same chat prompt from `m.stream` to the first Token event (greedy, 4 answer tokens; the first two are
left out as warm-up), and the same from `Generation.run()` on the calling thread (no stream: what the
prompt itself costs). It prints each side's median over its processes' medians and the ratio; the last
line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from statistics import median


def worker(path: str | None, side: str, streams: int) -> dict:
    import elastic_local
    from elastic_local.engine import stream
    from elastic_local.engine.events import Token
    from elastic_local.engine.generate import Generation, Request

    class ThreadPerStream:
        thread = None  # no engine thread to refuse waits on

        def run(self, job, cancel) -> None:
            threading.Thread(target=job, name="elastic-generate", daemon=True).start()

    if side == "thread":
        stream.ENGINE = ThreadPerStream()
    m = elastic_local.load(path)
    ids = m.chat_prompt("What is 347 + 589?")

    def through_stream() -> float:
        start = time.perf_counter()
        with m.stream(ids, max_answer_tokens=4) as s:
            for ev in s:
                if isinstance(ev, Token):
                    return time.perf_counter() - start
        raise RuntimeError("no token")

    def on_this_thread() -> float:
        start = time.perf_counter()
        for ev in Generation(m, [ids], Request(max_answer_tokens=4)).run():
            if isinstance(ev, Token):
                return time.perf_counter() - start
        raise RuntimeError("no token")

    streamed = [through_stream() for _ in range(streams)][2:]
    here = [on_this_thread() for _ in range(streams)][2:]
    return {"side": side, "stream_ms": median(streamed) * 1e3, "here_ms": median(here) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--streams", type=int, default=18)
    ap.add_argument("--worker", choices=("engine", "thread"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.dir, args.worker, args.streams)))
        return
    runs: dict[str, list[dict]] = {"engine": [], "thread": []}
    for _ in range(args.processes):
        for side in runs:
            cmd = [sys.executable, __file__, *([args.dir] if args.dir else []), "--worker", side,
                   "--streams", str(args.streams)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[side].append(json.loads(out.strip().splitlines()[-1]))
    print(f"first token, ms (medians of {args.streams - 2} a process, {args.processes} processes a side, alternated)")
    summary = {}
    for side, rs in runs.items():
        s, h = [r["stream_ms"] for r in rs], [r["here_ms"] for r in rs]
        summary[side] = {"stream_ms": median(s), "here_ms": median(h)}
        print(f"{side:7} stream {median(s):6.2f} (processes {min(s):.2f}-{max(s):.2f})   "
              f"on the calling thread {median(h):6.2f}")
    ratio = summary["thread"]["stream_ms"] / summary["engine"]["stream_ms"]
    print(f"a stream's first token, thread per stream / engine thread: {ratio:.2f}x")
    print(json.dumps({"args": vars(args), "runs": runs, "summary": summary, "ratio": ratio}))


if __name__ == "__main__":
    main()
