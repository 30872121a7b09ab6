"""`elastic-chat [DIR]`: the command line. Nothing here imports torch: `--help` and a mistyped flag answer at
once, and the app shows its loading screen before torch's seconds of import, which its worker takes (the
device, the sampling flags and the rest of the start are checked there: start.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .keys import ACTIONS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastic-chat", description="Chat with an elastic reasoning model in the "
                                "terminal: budgets of thinking and answering switched live, history kept.",
                                epilog="F1 in the app lists every key and slash command. keys.toml in the config "
                                "dir (`elastic-local paths`) moves keys, one line per action: answer_budget = "
                                f"\"f8\" (the actions: {', '.join(ACTIONS)}).")
    p.add_argument("dir", nargs="?", help="checkpoint directory (default: the embedded demo model)")
    p.add_argument("--profile", default="auto", help="hardware profile the fit planner plans for (auto: this machine)")
    p.add_argument("--context", type=int, default=4096, help="tokens of context to plan for (default 4096)")
    p.add_argument("--budget", help="resident budget (default: the planner's pick)")
    p.add_argument("--precision", choices=["bf16", "fp8", "nvfp4"], help="weights' precision (default: the pick)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or cuda:N (default auto: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--activations", choices=["float", "nvfp4"], default="float",
                   help="nvfp4: NVFP4 weights round their inputs to NVFP4 too (W4A4, as Blackwell computes them; "
                        "on a CPU faster integer products); needs --precision nvfp4")
    p.add_argument("--think-budget", help="budget that thinks (default: the largest resident one)")
    p.add_argument("--answer-budget", help="budget that answers (default: the largest resident one)")
    p.add_argument("--max-think-tokens", type=int, default=1024, help="think token budget (default 1024)")
    p.add_argument("--max-tokens", type=int, default=1024, help="answer token limit (default 1024)")
    p.add_argument("--no-think", action="store_true", help="start with thinking off")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the top-p nucleus (1: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens under min_p x the most likely one")
    p.add_argument("--seed", type=int, help="seed of the sampling (default: a new one each run)")
    p.add_argument("--history", help="history file (default: chat.sqlite3 in `elastic-local paths`' data dir)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)  # --help and a mistyped flag answer before the imports below
    from . import keys
    from .app import ElasticChat
    from .start import Options, model_dir
    from .store import Store

    try:
        keymap = keys.load()
        options = Options(model_dir(args.dir), args.profile, args.context, args.budget, args.precision, args.device,
                          args.activations)
        sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        seed=args.seed)
        store = Store(Path(args.history) if args.history else None)
    except Exception as e:  # one line; a bug's traceback goes to a file (elastic_local.errors)
        from elastic_local.errors import report

        return report("elastic-chat", e)
    app = ElasticChat(options, store=store, keys=keymap, think_budget=args.think_budget,
                      answer_budget=args.answer_budget, thinking=not args.no_think,
                      max_think_tokens=args.max_think_tokens, max_answer_tokens=args.max_tokens, **sampling)
    outcome = app.run()
    if isinstance(outcome, Exception):  # the loading screen's: a flag out of range, no GPU, no fit, a bad file
        from elastic_local.errors import report

        return report("elastic-chat", outcome)
    return app.return_code or 0


if __name__ == "__main__":
    sys.exit(main())
