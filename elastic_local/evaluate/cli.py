"""`elastic-local eval [DIR]`: the held-out task suite on every budget, budget pairing and precision."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def cmd_eval(args: argparse.Namespace) -> int:
    """Score a nested checkpoint (default: the embedded demo model) on held-out items of the task corpus:
    accuracy per budget and level, and per budget and task family; budget control (small/small,
    small/full, mid/full, full/small, full/full) with thinking tokens and time per item; the largest budget
    on the same items asked second in a chat and on follow-ups to them ("Add 45 to that."); FP8 and NVFP4
    recovery (load-time quantization).

    elastic-local eval --items 3 --precisions ''           (the embedded model, bf16 only: ~1 min)
    elastic-local eval ./ckpt --json report.json --plot frontier.png --compare ./independent-small"""
    import torch

    from ..cli import resolve_device
    from .report import plot, tables
    from .run import evaluate

    levels = tuple(int(x) for x in args.levels.split(","))
    precisions = tuple(args.precisions.split(",")) if args.precisions else ()
    report = evaluate(args.dir, per_cell=args.items, levels=levels, precisions=precisions, compare=args.compare,
                      batch_size=args.batch_size, seed=args.seed, device=resolve_device(args.device),
                      dtype=None if args.dtype == "auto" else getattr(torch, args.dtype),
                      progress=lambda m: print(f"eval: {m}", file=sys.stderr, flush=True))
    print(tables(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    if args.plot:
        print(f"wrote {plot(report, args.plot)}")
    return 0


def register(sub) -> None:
    from ..cli import DTYPES, add_command

    p = add_command(sub, "eval", cmd_eval, "accuracy per budget, think/answer pairing and precision on held-out tasks")
    p.add_argument("dir", nargs="?", default=None, help="checkpoint directory (default: the embedded demo model)")
    p.add_argument("--items", type=int, default=5, help="items per task family and level (default 5)")
    p.add_argument("--levels", default="1,2,3,4", help="difficulty levels, comma-separated (4 is held out)")
    p.add_argument("--precisions", default="bf16,fp8,nvfp4",
                   help="precisions to compare, comma-separated (nvfp4-a4: NVFP4 with its inputs rounded to "
                        "NVFP4 too, W4A4); '' for bf16 only")
    p.add_argument("--compare", metavar="DIR", help="an independently trained model of the small budget's size")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=1234, help="seed of the held-out item set")
    p.add_argument("--json", metavar="FILE", help="write the whole report as JSON")
    p.add_argument("--plot", metavar="PNG", help="draw accuracy against time per item (needs matplotlib)")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default auto: cuda when torch sees a GPU)")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="compute dtype (default auto: bfloat16 on a GPU, else float32)")
