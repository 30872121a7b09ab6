"""Which text should close thinking that a think token budget cuts short? Accuracy of the two on one model.

    .venv/bin/python benchmarks/bench_think_close.py [DIR] [--items 3] [--limits 8,24,48] [--threads 2]

The engine appends a closing text and `</think>` when `max_think_tokens` runs out: NVIDIA's sentence
(phases.THINK_CLOSE) unless the request or the checkpoint's generation_config.json ("think_close") names
another. A model trained without that sentence may answer better after `</think>` alone. This scores both
on held-out items of the task corpus (`eval_items(--items, levels 1-3)`: every family and level, greedy,
128 answer tokens) for each think limit, and prints right answers and answer tokens an item. DIR: a
checkpoint whose tokenizer speaks the task corpus (default: the embedded demo model, which ships "").
The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--items", type=int, default=3, help="held-out items per family and level")
    ap.add_argument("--limits", default="8,24,48", help="think token limits, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import elastic_local
    from elastic_local.engine.phases import THINK_CLOSE
    from elastic_local.evaluate.run import eval_items
    from elastic_local.tasks.corpus import check, prompt_messages

    m = elastic_local.load(args.dir, dtype=torch.float32)
    items = eval_items(args.items, levels=(1, 2, 3))
    closes = {"bare </think>": "", "NVIDIA's sentence": THINK_CLOSE}
    rows = []
    print(f"{len(items)} held-out items, greedy; the checkpoint names {m.specials.think_close!r}")
    print(f"{'think limit':>11} | {'close':18} | {'right':>7} | {'answer tok/item':>15}")
    for limit in (int(x) for x in args.limits.split(",")):
        for name, close in closes.items():
            right = answer_tokens = 0
            for it in items:
                r = m.generate(m.chat_prompt(prompt_messages(it)), max_think_tokens=limit, max_answer_tokens=128,
                               think_close=close)
                right += check(it, r.answer_text)
                answer_tokens += r.stats.answer_tokens
            rows.append({"limit": limit, "close": name, "right": right, "items": len(items),
                         "answer_tokens_per_item": answer_tokens / len(items)})
            print(f"{limit:>11} | {name:18} | {right:>3}/{len(items):<3} | {answer_tokens / len(items):>15.1f}",
                  flush=True)
    print(json.dumps({"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
