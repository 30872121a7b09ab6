"""The corpus: deterministic splits of task items, rendered as ChatML conversations, and the checker.

Train and held-out never share a question: a question belongs to the held-out split when its hash falls
in a fixed tenth, whatever the seed or the counts. The held-out split also has level 4, which training
never sees. Everything is a pure function of (split, seed, count), so a recipe rebuilds the same corpus.

A share of the conversations can have turns before the one the model learns (`conversations`): one or two
earlier turns answered as a chat keeps them (the answer alone), each turn a new question or a follow-up on
the answer before it ("Add 45 to that."), so that a model trained on it answers the latest question of a
chat with its history in view.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .families import ALL_LEVELS, FAMILIES, TRAIN_LEVELS, Item, follow_up

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


@dataclass(frozen=True)
class Conversation:
    earlier: tuple[Item, ...]  # turns before, shown as a chat keeps them: the question and the answer alone
    item: Item  # the question the model answers, with its thinking: what the loss and the checker see


def conversations(split: str, n: int, seed: int, multi_turn: float = 0.0) -> Iterator[Conversation]:
    """`n` conversations of `split`: items() one per conversation, and where `multi_turn` > 0 that share of
    them after one or two earlier turns. Every turn after the first is, as often as not, a follow-up on the
    answer before it (where that is one number), else the stream's next item; so a chat's history holds
    follow-ups too (a model that only ever saw plain questions before the last turn answered every question
    after a follow-up as if it were one: 0 of 30). multi_turn 0 gives exactly items()'s conversations."""
    stream = items(split, n * 3 if multi_turn else n, seed)
    turns = random.Random(f"{split}:{seed}:turns")
    for _ in range(n):
        chat = [next(stream)]
        if multi_turn and turns.random() < multi_turn:
            for _ in range(turns.randint(1, 2)):
                up = follow_up(turns, chat[-1]) if turns.random() < 0.5 else None
                chat.append(up or next(stream))
        yield Conversation(tuple(chat[:-1]), chat[-1])


def prompt_messages(item: Item, earlier: Sequence[Item] = ()) -> list[dict]:
    """The chat that asks `item`, after `earlier` turns as a chat keeps them (the answer alone)."""
    before = [m for it in earlier for m in ({"role": "user", "content": it.question},
                                              {"role": "assistant", "content": it.answer})]
    return [*before, {"role": "user", "content": item.question}]


def assistant_text(item: Item) -> str:
    """The assistant turn as the model produces it after the generation prompt's `<think>\\n`."""
    return f"{item.trace}{THINK_END}{item.answer}"


def chat_text(item: Item, earlier: Sequence[Item] = ()) -> tuple[str, str]:
    """(prompt, completion) of one training conversation: the prompt ends in the generation prompt
    `<|im_start|>assistant\\n<think>\\n` (what the chat template renders, earlier turns as
    `<think></think>answer`), the completion is the assistant's thinking and answer and the end of turn."""
    before = "".join(f"{IM_START}user\n{it.question}{IM_END}\n{IM_START}assistant\n{THINK_START}{THINK_END}"
                     f"{it.answer}{IM_END}\n" for it in earlier)
    prompt = f"{before}{IM_START}user\n{item.question}{IM_END}\n{IM_START}assistant\n{THINK_START}\n"
    return prompt, f"{assistant_text(item)}{IM_END}"


def conversation_text(c: Conversation) -> str:
    """A conversation as one text (a tokenizer's, a calibration's or a distillation's corpus line)."""
    return "".join(chat_text(c.item, c.earlier))


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
