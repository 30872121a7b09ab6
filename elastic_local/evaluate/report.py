"""The eval report as text tables, and the accuracy-against-latency frontier as a PNG."""

from __future__ import annotations

from pathlib import Path


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:5.1f}%"


def _scores(report: dict) -> dict[tuple[str, str, str], dict]:
    return {(s["think"], s["answer"], s["precision"]): s for s in report["scores"]}


def tables(report: dict) -> str:
    scores = _scores(report)
    base = report.get("base", "bf16")  # the precision the file stores
    levels = [str(x) for x in report["levels"]]
    lines = [f"{report['model']}: {report['items']} held-out items ({report['per_cell']} per family and level; "
             f"levels {', '.join(levels)}; level 4 is harder than anything trained on)", ""]
    lines.append(f"accuracy per budget and level ({base}, greedy)")
    lines.append(f"  {'budget':<8} {'params':>9} " + " ".join(f"{'L' + x:>6}" for x in levels) + f" {'all':>6}")
    for b, info in report["budgets"].items():
        s = scores[(b, b, base)]
        lines.append(f"  {b:<8} {info['params']:>9,} " + " ".join(_pct(s["by_level"].get(x)).rjust(6) for x in levels)
                     + " " + _pct(s["accuracy"]).rjust(6))
    families = sorted({f for b in report["budgets"] for f in scores[(b, b, base)]["by_family"]})
    lines += ["", f"accuracy per budget and family ({base}, all levels): what the model is good at"]
    lines.append(f"  {'budget':<8} " + " ".join(f"{f.replace('_', ' '):>12}" for f in families))
    for b in report["budgets"]:
        by = scores[(b, b, base)]["by_family"]
        lines.append(f"  {b:<8} " + " ".join(_pct(by.get(f)).rjust(12) for f in families))
    lines += ["", f"budget control: thinking on one budget, answering on another ({base})"]
    lines.append(f"  {'think':<8} {'answer':<8} {'accuracy':>8} {'think tok':>9} {'s/item':>7}  "
                 + " ".join(f"{'L' + x:>6}" for x in levels))
    for c in report["control"]:
        s = scores[tuple(c["key"])]
        lines.append(f"  {c['key'][0]:<8} {c['key'][1]:<8} {_pct(s['accuracy']):>8} "
                     f"{s['think_tokens_per_item']:>9.1f} {s['seconds_per_item']:>7.3f}  "
                     + " ".join(_pct(s["by_level"].get(x)).rjust(6) for x in levels))
    if report.get("asked_second"):
        a = report["asked_second"]
        lines += ["", f"the same items asked second in a chat, after another question and its answer ({base})",
                  f"  {a['budget']:<8} asked first {_pct(a['first'])}, asked second {_pct(a['second']['accuracy'])}"]
    if report.get("follow_ups"):
        f = report["follow_ups"]
        lines += ["", f"follow-ups on those items' answers (\"Add 45 to that.\", after an item and its answer; {base})",
                  f"  {f['think']:<8} {_pct(f['accuracy'])} of {f['n']}"]
    if report.get("precision"):
        lines += ["", "load-time quantization: accuracy and recovery of BF16 accuracy"]
        lines.append(f"  {'budget':<8} {'precision':<9} {'accuracy':>8} {'bf16':>7} {'recovery':>8}")
        for p in report["precision"]:
            lines.append(f"  {p['budget']:<8} {p['precision']:<9} {_pct(p['accuracy']):>8} "
                         f"{_pct(p['bf16_accuracy']):>7} {_pct(p['recovery']):>8}")
    if report.get("compare"):
        c = report["compare"]
        lines += ["", "nested budget against an independently trained model of its size",
                  f"  nested {c['nested_budget']:<8} {c['nested_params']:>9,} params  {_pct(c['nested_accuracy'])}",
                  f"  independent     {c['params']:>9,} params  {_pct(c['independent']['accuracy'])}  ({c['path']})"]
    return "\n".join(lines)


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both time (lower) and accuracy (higher), by time."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -1.0
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def plot(report: dict, out: str | Path) -> Path:
    """Accuracy against seconds per item for every configuration at the stored precision, the frontier drawn
    through them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("the plot needs matplotlib: pip install 'elastic-local[plot]'") from None
    rows = [s for s in report["scores"] if s["precision"] == report.get("base", "bf16")]
    pts = [(s["seconds_per_item"], s["accuracy"]) for s in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for s, (x, y) in zip(rows, pts):
        static = s["think"] == s["answer"]
        ax.scatter(x, y, marker="o" if static else "s", color="tab:blue" if static else "tab:orange")
        ax.annotate(f"{s['think']}->{s['answer']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front = pareto(pts)
    ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "--", color="gray", label="frontier")
    ax.set_xlabel("seconds per item (batched generation)")
    ax.set_ylabel("accuracy (held-out items)")
    ax.set_title("think->answer budgets: accuracy against latency")
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
