"""Elastic training against `nest`'s zero-shot budgets, the router's choices, QAD against PTQ, throughput.

    .venv/bin/python benchmarks/bench_train.py --parent DIR --data FILE [--steps 60] [--qad-steps 20]
                                               [--budgets p77=0.77,p40=0.4] [--seq-len 128] [--batch-size 8]

DIR is a Nemotron-H checkpoint with a tokenizer (default: the embedded demo model when it is installed),
FILE its training text (.txt) or chats (.jsonl). Work goes to benchmarks/_work/train/ (removed first).

  a. zero-shot  `nest(DIR, budgets, calib=FILE)`: importance ranking and the greedy search.
  b. trained    `train(nested, budgets, --steps)`: router + elastic distillation from a's file (same
                importance order; its full budget is DIR).
     Both: held-out forward KL from DIR's logits per budget (the split `train` holds out), parameters.
  c. configurations: the router's per-layer sizes beside nest's; an unseen budget (0.6) from the router.
  d. quantization: NVFP4 and FP8 PTQ (`quantize`) of the trained file against NVFP4 QAD (`train --qad`
     from the trained file, its budgets kept); held-out KD from DIR per budget.
  e. training throughput (tokens/s, all budgets mixed) and this process's peak RSS.

The last line of output is one JSON object with every number. Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from pathlib import Path

from elastic_local.quant.quantize import quantize_checkpoint

from elastic_local.elastic.nest import nest
from elastic_local.elastic.table import LAYER_AXES, read_budgets
from elastic_local.model.budget import count_params
from elastic_local.model.config import NemotronHConfig
from elastic_local.train.export import add_budget
from elastic_local.train.loop import heldout_kd_of, train
from elastic_local.train.recipe import Recipe

WORK = Path(__file__).resolve().parent / "_work" / "train"


def sizes(path: Path) -> dict:
    cfg = NemotronHConfig.from_dir(path)
    out = {}
    for name, b in read_budgets(cfg).items():
        per_axis = {a: [getattr(s, a) for s in b.layers if s.kind == k] for a, k in LAYER_AXES.items()
                    if k in cfg.pattern}
        out[name] = {"params": count_params(cfg, b)[0], "hidden": b.hidden, **per_axis}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parent")
    ap.add_argument("--data", required=True)
    ap.add_argument("--budgets", default="p77=0.77,p40=0.4")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--qad-steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--calib-tokens", type=int, default=4096, help="tokens nest scores importance on")
    args = ap.parse_args()
    parent = Path(args.parent) if args.parent else Path(__file__).resolve().parents[1] / "elastic_local/catalog/demo"
    budgets = {k: float(v) for k, v in (x.split("=") for x in args.budgets.split(","))}
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    recipe = Recipe.load(steps=args.steps, seq_len=args.seq_len, stage1_seq_len=args.seq_len // 2,
                         batch_size=args.batch_size, lr=args.lr, checkpoint_every=10 ** 6)
    res: dict = {"parent": str(parent), "data": args.data, "recipe": recipe.to_dict()}

    t = time.perf_counter()
    nest(parent, WORK / "nest", budgets, calib=args.data, max_tokens=args.calib_tokens)
    res["nest_seconds"] = time.perf_counter() - t
    t = time.perf_counter()
    # from the nested file: both start from the same importance order, and its full budget is the parent
    trained = train(WORK / "nest", WORK / "trained", [args.data], budgets, recipe)
    res["train_seconds"] = time.perf_counter() - t
    s1 = recipe.stage1_steps()
    res["train_tokens"] = args.batch_size * (recipe.stage1_seq_len * s1 + args.seq_len * (args.steps - s1))
    res["train_tokens_per_s"] = res["train_tokens"] / res["train_seconds"]  # end to end: nesting, eval, export
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    kd_nest = heldout_kd_of(WORK / "nest", parent, [args.data], recipe)
    kd_trained = heldout_kd_of(trained, parent, [args.data], recipe)
    res["kd"] = {"nest": kd_nest, "trained": kd_trained}
    res["sizes"] = {"nest": sizes(WORK / "nest"), "trained": sizes(trained)}

    unseen = WORK / "unseen"
    shutil.copytree(trained, unseen)
    add_budget(unseen, "p60", 0.6)
    res["unseen"] = sizes(unseen)["p60"]

    quant = {}
    for precision in ("fp8", "nvfp4"):
        q = quantize_checkpoint(trained, WORK / f"ptq-{precision}", precision, calib=args.data)
        quant[f"ptq-{precision}"] = heldout_kd_of(q, parent, [args.data], recipe)
    qad_recipe = Recipe.load(steps=args.qad_steps, seq_len=args.seq_len, stage1_seq_len=args.seq_len // 2,
                             batch_size=args.batch_size, lr=args.lr / 5, checkpoint_every=10 ** 6)
    qad = train(trained, WORK / "qad-nvfp4", [args.data], budgets, qad_recipe, qad="nvfp4")
    quant["qad-nvfp4"] = heldout_kd_of(qad, parent, [args.data], recipe)
    quant["bf16"] = kd_trained
    res["quant"] = quant

    print(f"\nheld-out KL from the parent (nats/token), {args.steps} steps of elastic distillation")
    print(f"{'budget':8} {'nest params':>12} {'nest KD':>9} {'trained params':>15} {'trained KD':>11}")
    for name in kd_trained:
        print(f"{name:8} {res['sizes']['nest'][name]['params']:>12,} {kd_nest[name]:>9.4f} "
              f"{res['sizes']['trained'][name]['params']:>15,} {kd_trained[name]:>11.4f}")
    print("\nconfigurations (per layer of each kind)")
    for name in kd_trained:
        if name == "full":
            continue
        for who in ("nest", "trained"):
            s = res["sizes"][who][name]
            print(f"  {name:5} {who:8} " + " ".join(f"{a}={v}" for a, v in s.items() if a != "params"))
    print(f"  unseen p60 (router, {res['unseen']['params']:,} params): "
          + " ".join(f"{a}={v}" for a, v in res["unseen"].items() if a != "params"))
    print("\nquantized, held-out KL from the parent")
    for name in kd_trained:
        print(f"  {name:6} " + " ".join(f"{k} {v[name]:.4f}" for k, v in quant.items()))
    print(f"\ntraining: {res['train_tokens_per_s']:,.0f} tok/s end to end (teacher + student, budgets mixed), "
          f"peak RSS {res['peak_rss_mib']:,.0f} MiB")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
