"""The corpus: deterministic splits of task items, rendered as ChatML conversations, and the checker.

Train and held-out never share a question: a question belongs to the held-out split when its hash falls
in a fixed tenth, whatever the seed or the counts. The held-out split also has level 4, which training
never sees. Everything is a pure function of (split, seed, count), so a recipe rebuilds the same corpus.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator

from .families import ALL_LEVELS, FAMILIES, TRAIN_LEVELS, Item

THINK_START, THINK_END = "<think>", "</think>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
HELD_OUT_SHARE = 10  # one question in ten belongs to the held-out split


def held_out(question: str) -> bool:
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:4], "little") % HELD_OUT_SHARE == 0


def items(split: str, n: int, seed: int, levels: tuple[int, ...] | None = None,
          families: tuple[str, ...] | None = None) -> Iterator[Item]:
    """`n` items of `split` ("train" or "heldout"), cycling over families and levels in a fixed order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}; choose 'train' or 'heldout'")
    levels = levels or (TRAIN_LEVELS if split == "train" else ALL_LEVELS)
    names = families or tuple(FAMILIES)
    unknown = [f for f in names if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown task families {unknown}; known: {list(FAMILIES)}")
    rng = random.Random(f"{split}:{seed}")
    k = 0
    while k < n:
        fam, level = names[k % len(names)], levels[(k // len(names)) % len(levels)]
        item = FAMILIES[fam](rng, level)
        if split == "train" and held_out(item.question):
            continue
        if split == "heldout" and level in TRAIN_LEVELS and not held_out(item.question):
            continue
        yield item
        k += 1


def prompt_messages(item: Item) -> list[dict]:
    return [{"role": "user", "content": item.question}]


def assistant_text(item: Item) -> str:
    """The assistant turn as the model produces it after the generation prompt's `<think>\\n`."""
    return f"{item.trace}{THINK_END}{item.answer}"


def chat_text(item: Item) -> tuple[str, str]:
    """(prompt, completion) of one training conversation: the prompt ends in the generation prompt
    `<|im_start|>assistant\\n<think>\\n` (what the chat template renders), the completion is the
    assistant's thinking and answer and the end of turn."""
    prompt = f"{IM_START}user\n{item.question}{IM_END}\n{IM_START}assistant\n{THINK_START}\n"
    return prompt, f"{assistant_text(item)}{IM_END}"


_INT = re.compile(r"\d+")


def extract(family: str, answer: str) -> str | None:
    """The canonical answer in a model's answer text: the list of numbers for sorting, else the last number."""
    nums = _INT.findall(answer)
    if not nums:
        return None
    if family == "sorting":
        return ", ".join(str(int(x)) for x in nums)
    return str(int(nums[-1]))


def check(item: Item, answer: str) -> bool:
    """Whether `answer` (the text after </think>) states the item's true answer."""
    return extract(item.family, answer) == item.truth
