"""What the chat app costs: tokens/s of a reply in elastic-chat against `elastic-local generate` on the same
model and prompt, and the time from launching `elastic-chat` to a ready input; writes a screenshot of a
reply with folded thinking and a live answer-budget switch.

    .venv/bin/python benchmarks/bench_chat.py [DIR] [--reps 3] [--think 96] [--answer 96]

DIR defaults to the embedded demo model. Both sides run the same greedy generation (same prompt through the
same chat template, same budgets and token limits), in one process, interleaved, median of --reps:
- generate: `elastic-local generate DIR --prompt ... --json` (the command, in-process);
- app: elastic-chat on the loaded model, headless (`App.run_test`), the prompt typed and sent with Enter.
Tokens/s is the engine's own account of the reply (tokens generated / seconds of the think and answer
steps, Result.stats), so what the app costs shows as the generation thread slowed by the UI next to it;
the app's reply wall time runs from Enter to the reply rendered whole.
Launch to ready: `elastic-chat [DIR]` started in a tmux pane (80x24) until the footer shows, which the chat
screen draws once the model is loaded (python start, imports, fit plan, load, first frame).
The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext, redirect_stderr, redirect_stdout
from pathlib import Path
from statistics import median

import torch
from elastic_local.tui.app import ElasticChat
from elastic_local.tui.start import model_dir
from elastic_local.tui.store import Store
from elastic_local.tui.widgets.prompt import PromptInput

import elastic_local
from elastic_local.cli import main as cli
from elastic_local.engine.events import Token
from elastic_local.engine.stream import Handover

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "What is 237 + 682?"  # one of the embedded demo model's task families


def rate(stats: dict) -> float:
    n = stats["think_tokens"] - stats["think_inserted"] + stats["answer_tokens"]
    return n / (stats["think_s"] + stats["answer_s"])


def generate_run(path: Path, args) -> dict:
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        cli(["generate", str(path), "--prompt", PROMPT, "--json", "--max-think-tokens", str(args.think),
             "--max-tokens", str(args.answer)])
    return json.loads(out.getvalue())["stats"]


async def wait_until(pilot, predicate, every: float = 0.2, timeout: float = 600) -> None:
    """Poll sparingly: a Pilot pause runs the app's whole message loop, which would cost the reply time."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError("the reply did not finish")
        await pilot.pause(every)


@contextmanager
def switch_after_first_answer_token(app: ElasticChat):
    """F3's action taken by the generation's own thread as it hands over the reply's first answer token, and
    waited for (`call_from_thread`), so the switch lands after exactly one answer token. Pressed from the
    app's side it raced the demo's whole answer (14 tokens, about 17 ms) and often came too late."""
    put, done = Handover.put, []

    def put_then_switch(self, ev) -> None:
        put(self, ev)
        if not done and isinstance(ev, Token) and ev.phase == "answer":
            done.append(True)
            app.call_from_thread(app.screen.action_cycle, "answer")

    Handover.put = put_then_switch
    try:
        yield
    finally:
        Handover.put = put


async def app_run(model, args, screenshot: Path | None = None) -> tuple[dict, float]:
    """One reply in the app: (its stats, seconds from Enter to the reply rendered whole). With `screenshot`,
    the reply answers on the smallest budget, F3 switches the answer up to the largest after its first
    answer token (the catch-up shows), and the screen is saved at the end."""
    budgets = {} if screenshot is None else {"answer_budget": model.budgets[-1]}
    store = Store(tempfile.mkdtemp(dir=os.environ["ELASTIC_LOCAL_HOME"]) + "/chat.sqlite3")  # a new conversation
    app = ElasticChat(model=model, store=store, precision="fp32", max_think_tokens=args.think,
                      max_answer_tokens=args.answer, **budgets)
    switching = nullcontext() if screenshot is None else switch_after_first_answer_token(app)
    with switching:
        async with app.run_test(size=(80, 24 if screenshot is None else 30)) as pilot:
            prompt = app.screen.query_one(PromptInput)
            prompt.text = PROMPT
            t0 = time.perf_counter()
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.session.turn is not None, 0.005)
            reply = app.session.turn.reply
            await app.workers.wait_for_complete()
            await pilot.pause()
            seconds = time.perf_counter() - t0
            if screenshot is not None:
                app.save_screenshot(screenshot.name, str(screenshot.parent))
            return reply.stats, seconds


def launch_times(dir: str | None, home: Path, reps: int, script: Path | None = None) -> list[tuple[float, float]]:
    """Seconds from starting `elastic-chat [DIR]` (`script`, default this install's) in a tmux pane to its
    first screen (any of its text: the loading screen, shown before torch imports) and to its chat footer."""
    command = f"{script or Path(sys.executable).with_name('elastic-chat')} {dir or ''}"
    # a session that outlives the timed ones: killing the server's last session stops the server, and a
    # new-session right after could reach the one shutting down and fail (it did, on the 5th of 5 reps)
    keeper = f"bench-chat-{os.getpid()}-keeper"
    subprocess.run(["tmux", "new-session", "-d", "-s", keeper, "sleep 3600"], check=True)
    try:
        return _launches(command, home, reps)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", keeper], check=False)


def _launches(command: str, home: Path, reps: int) -> list[tuple[float, float]]:
    out = []
    for i in range(reps):
        name = f"bench-chat-{os.getpid()}-{i}"
        t0 = time.perf_counter()
        subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "80", "-y", "24",
                        f"env ELASTIC_LOCAL_HOME={home} {command}"], check=True)
        first = None
        try:
            while True:
                screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", name], capture_output=True,
                                        text=True).stdout
                if first is None and screen.strip():
                    first = time.perf_counter() - t0
                if "esc Stop" in screen:
                    break
                if time.perf_counter() - t0 > 600:
                    raise TimeoutError("elastic-chat did not come up in 10 minutes")
                time.sleep(0.02)
            out.append((first, time.perf_counter() - t0))
        finally:
            subprocess.run(["tmux", "kill-session", "-t", name], check=False)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir", nargs="?", help="checkpoint directory (default: the embedded demo model)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--think", type=int, default=96, help="think token budget")
    p.add_argument("--answer", type=int, default=96, help="answer token limit")
    p.add_argument("--screenshot", type=Path, default=ROOT / "docs" / "elastic-chat.svg")
    args = p.parse_args()
    path = model_dir(args.dir)
    home = Path(tempfile.mkdtemp(prefix="bench-chat-"))
    os.environ["ELASTIC_LOCAL_HOME"] = str(home)  # the benchmark's history, not the user's
    model = elastic_local.load(path)
    print(f"model {path}: budgets {model.budgets}; prompt {PROMPT!r}; think <= {args.think}, answer <= {args.answer}")
    generate_run(path, args)  # warm-up: first-shape kernels, imports
    asyncio.run(app_run(model, args))
    gen, app, wall = [], [], []
    for _ in range(args.reps):
        gen.append(rate(generate_run(path, args)))
        stats, seconds = asyncio.run(app_run(model, args))
        app.append(rate(stats))
        wall.append(seconds)
    g, a = median(gen), median(app)
    print(f"decode tokens/s   generate {g:7.1f}   app {a:7.1f}   app/generate {a / g:.3f} (cost {1 - a / g:+.1%})")
    print(f"app reply wall    {median(wall):.2f} s (Enter to the reply rendered whole)")
    launches = launch_times(args.dir, home, args.reps) if shutil.which("tmux") else []
    first, ready = [f for f, _ in launches], [r for _, r in launches]
    if launches:
        print(f"launch to screen  {median(first):.2f} s (elastic-chat in tmux until its first screen shows)")
        print(f"launch to ready   {median(ready):.2f} s (until the chat screen shows)")
    asyncio.run(app_run(model, args, screenshot=args.screenshot))
    print(f"screenshot        {args.screenshot}")
    shutil.rmtree(home, ignore_errors=True)
    print(json.dumps({"model": str(path), "generate_tps": gen, "app_tps": app, "app_over_generate": a / g,
                      "app_reply_wall_s": wall, "launch_to_screen_s": first, "launch_to_ready_s": ready,
                      "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
