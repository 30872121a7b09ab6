"""`elastic-local train` (elastic distillation with a budget router) and `elastic-local budget` (an
unseen budget from the stored router)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..cli import _budgets, add_offline_device, offline_device

if TYPE_CHECKING:
    from .recipe import Recipe

# teacher and student in float32, the student's gradients, Adam's two moments
TRAIN_BYTES_PER_PARAM = 4 + 4 + 4 + 8
TRAIN_HOLDS = "teacher, student, gradients and Adam state (20 bytes per parameter)"
# --dtype: the forwards' compute dtype, as the recipe's `autocast` names it (weights stay float32 masters)
AUTOCAST_OF_DTYPE = {"auto": "auto", "bfloat16": "bf16", "float32": "off"}


def cmd_train(args: argparse.Namespace) -> int:
    """Train a nested checkpoint from SRC: every budget distilled from SRC in one run, with a router.

    The same command resumes an interrupted run (state in OUT.train/). Under torchrun each process takes
    a slice of every batch (PyTorch DDP): torchrun --nproc-per-node 2 -m elastic_local.cli train ...
    """
    from .loop import train
    from .recipe import Recipe

    recipe = Recipe.load(args.recipe, steps=args.steps, seq_len=args.seq_len, seed=args.seed,
                         batch_size=args.batch_size,
                         autocast=AUTOCAST_OF_DTYPE[args.dtype] if args.dtype else None)
    out = train(args.src, args.out, args.data, _budgets(args.budget), recipe, qad=args.qad,
                full_name=args.full_name, overwrite=args.overwrite,
                device=offline_device(args.device, args.src, TRAIN_BYTES_PER_PARAM, TRAIN_HOLDS))
    if out is not None:
        print(f"wrote {out}")
        lines, warnings = trained_report(Path(out), recipe)
        print("\n".join(lines))
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
    return 0


def trained_report(out: Path, recipe: Recipe) -> tuple[list[str], list[str]]:
    """Per budget: parameters, distance from its target and held-out KD; a warning for each budget that
    landed outside the recipe's dead zone (a "40%" budget that is really 42% compares unfairly with anything
    sized at 40%). The router sizes each layer in steps of one candidate, which on the demo move a budget
    1.5-9% at a time: a zone narrower than one step is met only where several layers' steps add up to it
    (README, "Why the size penalty changed")."""
    elastic = json.loads((out / "config.json").read_text())["elastic"]
    params = {b["name"]: b["params"] for b in elastic["budgets"]}
    full, targets = max(params.values()), elastic["training"]["targets"]
    lines, warnings = [], []
    for name, kd in elastic["training"]["heldout_kd"].items():
        line = f"  {name}: {params[name]:,} parameters"
        if name in targets:
            target = targets[name] * full
            off = params[name] / target - 1
            line += f" ({off:+.2%} from its target {targets[name]:g} = {round(target):,})"
            if abs(off) > recipe.dead_zone:
                warnings.append(f"{name} landed {off:+.2%} from its target, outside the dead zone "
                                f"({recipe.dead_zone:.0%}): train longer, widen the recipe's dead_zone, or give the "
                                f"router finer sizes (max_choices {recipe.max_choices}) or a heavier size penalty "
                                f"(cost_lambda {recipe.cost_lambda:g})")
        lines.append(f"{line}, held-out KD {kd:.4f}")
    return lines, warnings


def cmd_budget(args: argparse.Namespace) -> int:
    """Add an unseen budget to a checkpoint trained with `elastic-local train`: its router turns the
    parameter fraction into per-layer sizes, written to the budget table (no weights change).

    elastic-local budget ./trained 0.6 --name 60pct"""
    from ..elastic.table import budget_entry
    from ..model.config import NemotronHConfig
    from .export import add_budget

    name = args.name or f"{args.fraction:g}"
    b = add_budget(args.dir, name, args.fraction)
    entry = budget_entry(NemotronHConfig.from_dir(args.dir), b)
    print(f"added budget {name!r} to {args.dir}: {entry['params']:,} parameters ({entry['active_params']:,} active)")
    print(json.dumps(entry["sizes"]))
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="train a nested checkpoint: elastic distillation with a budget router",
                       description=cmd_train.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="a Nemotron-H checkpoint directory (teacher and starting point)")
    p.add_argument("out", help="the nested checkpoint to write")
    p.add_argument("--data", action="append", required=True, help=".txt text or .jsonl chats; repeatable")
    p.add_argument("--budget", action="append", default=[], help="NAME=FRACTION of the parameters; repeatable")
    p.add_argument("--steps", type=int, help="optimizer steps (recipe: 200)")
    p.add_argument("--seq-len", type=int, help="stage-2 sequence length (recipe: 256)")
    p.add_argument("--batch-size", type=int, help="sequences per step, all processes together (recipe: 8)")
    p.add_argument("--recipe", help="a TOML recipe; these options override it")
    p.add_argument("--qad", choices=("fp8", "nvfp4"), help="quantization-aware distillation; OUT is quantized")
    p.add_argument("--seed", type=int, help="seed of data order, budgets, Gumbel noise and router init")
    p.add_argument("--full-name", default="full", help="name of the full budget (default: full)")
    add_offline_device(p, "training runs", TRAIN_HOLDS)
    p.add_argument("--dtype", choices=tuple(AUTOCAST_OF_DTYPE),
                   help="the forwards' compute dtype; float32 master weights either way (recipe autocast, "
                        "default auto: bfloat16 autocast on a GPU, float32 on the CPU)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("budget", help="add an unseen budget to a trained checkpoint, from its router",
                       description=cmd_budget.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="a checkpoint written by `elastic-local train`")
    p.add_argument("fraction", type=float, help="fraction of the full model's parameters, e.g. 0.6")
    p.add_argument("--name", help="the budget's name (default: the fraction)")
    p.set_defaults(func=cmd_budget)
