"""Which score ranks Mamba heads better: ours (the norm of each head's gated output, what `nest` uses) or the
paper's (the norm of each head's slice of the x projection, as the paper and ModelOpt score it), with the
reverse of ours (least important first) as the floor.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_importance.py [PARENT] [--items 3]

PARENT defaults to the embedded demo model (its full budget is the parent). Every other axis keeps its full
size and its order, so the difference between rows is the Mamba head ranking alone: for each score, `nest`
(Python API, `importance=` the scores) writes PARENT with budgets that keep 3/4, 1/2 and 1/4 of the Mamba
heads in every layer (axes: mamba_heads only), and each budget is measured against PARENT by held-out KD
(mean forward KL per token on held-out task conversations) and zero-shot accuracy on the held-out items
of `elastic-local eval --items N`. Calibration is the demo build's (600 training conversations).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from elastic_local.checkpoint.load import load_network
from elastic_local.elastic.importance import Importance, _file_heads, _order, calibration_ids, score
from elastic_local.elastic.nest import nest
from elastic_local.elastic.table import read_budgets
from elastic_local.engine.load import load
from elastic_local.engine.tokenizer import Tokenizer
from elastic_local.evaluate.run import eval_items
from elastic_local.evaluate.run import score as accuracy
from elastic_local.model.budget import Budget, count_params
from elastic_local.model.config import NemotronHConfig
from elastic_local.tasks.corpus import chat_text, items
from elastic_local.train.data import pack, read_stream
from elastic_local.train.loop import heldout_kd

DEMO = Path(__file__).resolve().parents[1] / "elastic_local" / "catalog" / "demo"
KEEP = {"mamba75": 0.75, "mamba50": 0.5, "mamba25": 0.25}  # budget name: share of Mamba heads kept


def paper_scores(net, ids: list[int], seq_len: int) -> dict[int, torch.Tensor]:
    """Per Mamba layer, the sum over tokens of each head's x-projection output norm, in file head order."""
    cfg = net.cfg
    n, p = cfg.mamba_num_heads, cfg.mamba_head_dim
    out: dict[int, torch.Tensor] = {}

    def observe(i: int, what: str, x: torch.Tensor) -> None:
        if what != "input" or cfg.pattern[i] != "M":
            return
        flat = x.reshape(-1, x.shape[-1])
        xp = F.linear(flat, net.layers[i].mixer.in_proj[n * p:2 * n * p])  # z | x | B | C | dt: the x rows
        heads = xp.view(flat.shape[0], n, p).norm(dim=-1).sum(0).double()
        heads = heads[_order(_file_heads(n, cfg.n_groups))]  # resident rank-major -> file order
        out[i] = out.get(i, 0) + heads

    net.observer = observe
    try:
        with torch.inference_mode():
            for s in range(0, len(ids) - 1, seq_len):
                net.forward(torch.tensor([ids[s:s + seq_len]]))
    finally:
        net.observer = None
    return {i: v.float() for i, v in out.items()}


def with_mamba(imp: Importance, heads: dict[int, torch.Tensor]) -> Importance:
    return replace(imp, layers={i: {**axes, **({"mamba_heads": heads[i]} if i in heads else {})}
                                for i, axes in imp.layers.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parent", nargs="?", default=str(DEMO))
    ap.add_argument("--items", type=int, default=3, help="held-out items per task family and level")
    ap.add_argument("--heldout", type=int, default=400, help="held-out conversations for the KD")
    ap.add_argument("--json", help="write every number here")
    args = ap.parse_args()
    torch.manual_seed(0)
    parent = Path(args.parent)
    cfg = NemotronHConfig.from_dir(parent)
    work = Path(tempfile.mkdtemp(prefix="bench-importance-"))

    calib = work / "calib.txt"
    calib.write_text("".join("".join(chat_text(it)) + "\n" for it in items("train", 600, 1)))
    ids, source = calibration_ids(calib, parent, cfg.vocab_size, 16384)
    net = load_network(parent, dtype=torch.float32)
    ours = score(net, ids)
    ours.source = source
    ours_heads = {i: a["mamba_heads"] for i, a in ours.layers.items() if "mamba_heads" in a}
    rankings = {"ours (gated output)": ours,
                "paper (x projection)": with_mamba(ours, paper_scores(net, ids, 512)),
                "reverse of ours (floor)": with_mamba(ours, {i: -v for i, v in ours_heads.items()})}

    full = Budget.full(cfg)
    total = count_params(cfg, full)[0]
    fractions = {}
    for name, keep in KEEP.items():
        heads = max(cfg.n_groups, round(cfg.mamba_num_heads * keep / cfg.n_groups) * cfg.n_groups)
        b = replace(full, layers=tuple(replace(s, mamba_heads=heads) if s.kind == "M" else s for s in full.layers))
        fractions[name] = count_params(cfg, b)[0] / total

    held = work / "heldout.txt"
    held.write_text("".join("".join(chat_text(it)) + "\n" for it in items("heldout", args.heldout, 7)))
    seqs, trained = pack(read_stream([held], Tokenizer.from_dir(parent)), 256)
    its = eval_items(args.items)
    rows = []
    for label, imp in rankings.items():
        out = nest(parent, work / label.split()[0], fractions, axes=("mamba_heads",), importance=imp)
        table = read_budgets(NemotronHConfig.from_dir(out), where=str(out))
        kd = heldout_kd(load_network(out, dtype=torch.float32), net, seqs, trained.float(),
                        [table[n] for n in KEEP], batch=16)
        model = load(out)
        for name in KEEP:
            heads = [s.mamba_heads for s in table[name].layers if s.kind == "M"]
            acc = accuracy(model, its, name, name, "bf16").accuracy
            rows.append({"ranking": label, "budget": name, "mamba_heads": heads, "kd": kd[name], "accuracy": acc})
            print(f"{label:25s} {name:9s} heads {heads}  held-out KD {kd[name]:.4f}  accuracy {acc:6.1%}",
                  flush=True)
    full_acc = accuracy(load(parent), its, "full", "full", "bf16").accuracy
    print(f"\nparent {parent} (full budget, {cfg.mamba_num_heads} heads per Mamba layer): accuracy "
          f"{full_acc:.1%} on {len(its)} held-out items; KD over {int(trained.sum())} held-out tokens")
    print(f"{'budget':9s} " + " ".join(f"{k:>25s}" for k in rankings))
    for name in KEEP:
        cells = [next(r for r in rows if r["ranking"] == k and r["budget"] == name) for k in rankings]
        print(f"{name:9s} " + " ".join(f"{c['kd']:>11.4f} KD {c['accuracy']:>8.1%}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"parent": str(parent), "full_accuracy": full_acc, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
