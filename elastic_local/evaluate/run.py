"""Score a model on the held-out task items: accuracy per budget and level, budget control (thinking on
one budget, answering on another), the same items asked second in a chat (what a chat's history costs) and
followed up ("Add 45 to that.": whether it reads a chat's history), precision recovery, and a comparison
with an independently trained model.

Items run as a batch file's requests do (greedy, continuous batching up to `batch_size` rows, or one at a
time where the first items' timing says that is faster: batch/scheduler.py's Admission), so the time per item
is the run's wall time over its items: comparable between configurations measured the same way, not a
batch-1 latency.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..batch.requests import COMPLETION, Job
from ..batch.scheduler import run_jobs
from ..engine.elastic_model import ElasticModel
from ..engine.phases import Request
from ..model.budget import count_params
from ..quant.scheme import read_quant_config
from ..tasks.corpus import check, items, prompt_messages
from ..tasks.families import ALL_LEVELS, FAMILIES, Item, follow_up

# (think, answer) roles of the budget-control table; roles map to the model's budgets, largest first
CONTROL = (("small", "small"), ("small", "full"), ("mid", "full"), ("full", "small"), ("full", "full"))
Progress = Callable[[str], None]


def eval_items(per_cell: int, seed: int = 1234, levels: tuple[int, ...] = ALL_LEVELS,
               families: tuple[str, ...] | None = None) -> list[Item]:
    """`per_cell` held-out items for every (family, level): a fixed set for a given seed."""
    out = []
    for fam in families or tuple(FAMILIES):
        for level in levels:
            out += list(items("heldout", per_cell, seed, levels=(level,), families=(fam,)))
    return out


def roles(budgets: list[str]) -> dict[str, str]:
    """full / mid / small -> the model's budget names (largest, middle, smallest)."""
    return {"full": budgets[0], "mid": budgets[len(budgets) // 2], "small": budgets[-1]}


@dataclass
class Score:
    """One configuration's results over the items."""

    think: str
    answer: str
    precision: str
    n: int = 0
    correct: int = 0
    think_tokens: int = 0
    answer_tokens: int = 0
    seconds: float = 0.0
    by_level: dict[int, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    by_family: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("think", "answer", "precision", "n", "correct", "think_tokens",
                                            "answer_tokens", "seconds")}
        d.update(accuracy=self.accuracy, think_tokens_per_item=self.think_tokens / max(1, self.n),
                 seconds_per_item=self.seconds / max(1, self.n),
                 by_level={str(k): c / t for k, (c, t) in sorted(self.by_level.items())},
                 by_family={k: c / t for k, (c, t) in sorted(self.by_family.items())})
        return d


def asked_second(its: list[Item]) -> list[list[dict]]:
    """Each item as a chat's second question: after the next item's question and its true answer, the answer
    alone as a chat keeps an answered turn. A model that loses track once a chat has history shows it here."""
    before = its[1:] + its[:1]
    return [prompt_messages(it, [b]) for b, it in zip(before, its)]


def follow_ups(its: list[Item], seed: int) -> tuple[list[Item], list[list[dict]]]:
    """A follow-up on each item whose answer is one number ("Add 45 to that.", after the item's question and
    its true answer): (the follow-ups, their chats). Fixed for a given seed. A model that sees a chat's
    latest question only cannot know what "that" is, so this measures whether it reads the history."""
    rng = random.Random(f"follow-ups:{seed}")
    pairs = [(it, f) for it in its if (f := follow_up(rng, it)) is not None]
    return [f for _, f in pairs], [prompt_messages(f, [it]) for it, f in pairs]


def score(model: ElasticModel, its: list[Item], think: str, answer: str, precision: str = "bf16",
          batch_size: int = 32, max_think_tokens: int = 512, max_answer_tokens: int = 64,
          chats: list[list[dict]] | None = None) -> Score:
    """Greedy generation of every item with thinking on `think` and the answer on `answer`; `chats`, one
    conversation per item ending in its question, replaces the item's question alone. (On a CPU the demo
    model's items ran 1.7-2.0x faster one at a time than in batches of 32, since its tokens take the C
    decode step: Admission finds that out.)"""
    s = Score(think, answer, precision)
    req = Request(think_budget=think, answer_budget=answer, max_think_tokens=max_think_tokens,
                  max_answer_tokens=max_answer_tokens)
    chats = chats or [prompt_messages(it) for it in its]
    # a Job's capacity is read only against a Memory (batch files), which eval does not set: 0
    jobs = [Job(i, str(i), COMPLETION, model.chat_prompt(chat), req, None, 0) for i, chat in enumerate(chats)]
    t0 = time.perf_counter()
    results = {job.line: r for job, r in run_jobs(model, jobs, max_batch=batch_size)}
    s.seconds += time.perf_counter() - t0
    for i, it in enumerate(its):
        r = results[i]
        ok = check(it, r.answer_text)
        s.n += 1
        s.correct += ok
        s.think_tokens += r.stats.think_tokens
        s.answer_tokens += r.stats.answer_tokens
        for key, table in ((it.level, s.by_level), (it.family, s.by_family)):
            table[key][0] += ok
            table[key][1] += 1
    return s


# Precisions that are a load's options beyond the weights' format: NVFP4 with its inputs rounded too (W4A4)
LOADS = {"nvfp4-a4": {"precision": "nvfp4", "activations": "nvfp4"}}


def evaluate(path: str | Path | None, per_cell: int = 5, levels: tuple[int, ...] = ALL_LEVELS,
             precisions: tuple[str, ...] = ("bf16", "fp8", "nvfp4"), compare: str | Path | None = None,
             batch_size: int = 32, seed: int = 1234, progress: Progress | None = None, device: str = "cpu",
             dtype: torch.dtype | None = None) -> dict:
    """The whole report as a dict (see report.py for the table and the plot). Every model loads with its
    whole table resident on `device` (`dtype` None: the loader's default for the device)."""
    from ..engine.load import load as load_model

    def load(where, **options) -> ElasticModel:
        return load_model(where, device=device, dtype=dtype, **options)

    its = eval_items(per_cell, seed, levels)
    say = progress or (lambda _m: None)
    model = load(path)
    base = read_quant_config(model.path)[0]  # what the file stores: the rows every other precision is held to
    names = model.budgets
    role = roles(names)
    cfg = model.config
    report: dict = {"model": str(model.path), "base": base, "items": len(its), "per_cell": per_cell,
                    "levels": list(levels), "seed": seed,
                    "budgets": {b: {"params": count_params(cfg, model.budget(b))[0],
                                    "active_params": count_params(cfg, model.budget(b))[1]} for b in names},
                    "roles": role, "scores": []}
    done: dict[tuple[str, str, str], Score] = {}

    def run(m: ElasticModel, think: str, answer: str, precision: str) -> Score:
        key = (think, answer, precision)
        if key not in done:
            say(f"{precision} think={think} answer={answer}: {len(its)} items")
            done[key] = score(m, its, think, answer, precision, batch_size)
            report["scores"].append(done[key].to_dict())
        return done[key]

    for b in names:
        run(model, b, b, base)
    for t, a in CONTROL:
        run(model, role[t], role[a], base)
    report["control"] = [{"think": t, "answer": a, "key": [role[t], role[a], base]} for t, a in CONTROL]
    largest = names[0]
    say(f"{base} think={largest} answer={largest}: {len(its)} items asked second in a chat")
    second = score(model, its, largest, largest, base, batch_size, chats=asked_second(its))
    report["asked_second"] = {"budget": largest, "first": done[(largest, largest, base)].accuracy,
                              "second": second.to_dict()}
    ups, chats = follow_ups(its, seed)
    say(f"{base} think={largest} answer={largest}: {len(ups)} follow-ups on those items")
    report["follow_ups"] = score(model, ups, largest, largest, base, batch_size, chats=chats).to_dict()
    del model

    report["precision"] = []
    for precision in precisions:
        if precision == base or base != "bf16":  # a quantized file loads as stored only
            continue
        qmodel = load(path, **LOADS.get(precision, {"precision": precision}))
        for b in names:
            q, ref = run(qmodel, b, b, precision), done[(b, b, base)]
            report["precision"].append({"budget": b, "precision": precision, "accuracy": q.accuracy,
                                        "bf16_accuracy": ref.accuracy,
                                        "recovery": q.accuracy / ref.accuracy if ref.accuracy else None})
        del qmodel

    if compare is not None:
        other = load(compare)
        o = score(other, its, other.budgets[0], other.budgets[0], read_quant_config(other.path)[0], batch_size)
        say(f"independent model {compare}: {o.accuracy:.3f}")
        nested = done[(role["small"], role["small"], base)]
        report["compare"] = {"path": str(compare), "params": count_params(other.config, other.budget())[0],
                             "independent": o.to_dict(), "nested_budget": role["small"],
                             "nested_params": report["budgets"][role["small"]]["params"],
                             "nested_accuracy": nested.accuracy}
    return report
