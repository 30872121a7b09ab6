"""Task families: a question in plain English, a step-by-step thinking trace, and a short answer.

Each family is designed so that both phases matter: the trace computes the intermediate results (the
digits of a sum from right to left, the running totals of a word problem, the picks of a selection
sort) and the answer has to finish the work (read the digits back in order, state the last total, list
the picks). A weak thinker's trace can so be repaired or completed by a stronger answerer, and harder
levels (more digits, more steps, longer lists) separate the budgets.

Levels 1-3 are trained on; level 4 appears only in the held-out split (longer than anything seen).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

TRAIN_LEVELS = (1, 2, 3)
ALL_LEVELS = (1, 2, 3, 4)


@dataclass(frozen=True)
class Item:
    family: str
    level: int
    question: str
    trace: str  # the thinking, newline-terminated lines
    answer: str  # what the assistant says after </think>
    truth: str  # the canonical answer the checker compares against (a number, or numbers joined by ", ")


def _digits(n: int) -> list[int]:
    return [int(c) for c in str(n)]


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def _operands(rng: random.Random, level: int) -> tuple[int, int]:
    """Two numbers of 1 to `level` + 1 digits each, drawn apart: either may be the shorter one, and both
    may have one digit. (The first version always gave the first two or more digits and the second no
    more: the shipped model then answered "What is 2 + 2?" with 26 and "What is 5 + 123?" with 767.)"""
    return (_number(rng, rng.randint(1, level + 1)), _number(rng, rng.randint(1, level + 1)))


def column_sum(a: int, b: int) -> str:
    """The trace of a + b: column addition right to left, the result's digits written from the last one
    (the answer reads them back in order)."""
    da, db = _digits(a)[::-1], _digits(b)[::-1]
    lines, carry, out = [], 0, []
    for i in range(max(len(da), len(db))):
        x, y = da[i] if i < len(da) else 0, db[i] if i < len(db) else 0
        s = x + y + carry
        lines.append(f"{x} + {y}" + (f" + {carry}" if carry else "") + f" = {s}, write {s % 10}"
                     + (", carry 1" if s >= 10 else ""))
        out.append(s % 10)
        carry = s // 10
    if carry:
        lines.append("write the carry 1")
        out.append(1)
    lines.append("digits from the right: " + " ".join(map(str, out)))
    return "\n".join(lines) + "\n"


def column_difference(a: int, b: int) -> str:
    """The trace of a - b (a >= b): column subtraction with borrows."""
    da, db = _digits(a)[::-1], _digits(b)[::-1]
    lines, borrow, out = [], 0, []
    for i in range(len(da)):
        x, y = da[i], db[i] if i < len(db) else 0
        top = x - borrow
        if top < y:
            lines.append(f"{x}" + (f" - {borrow}" if borrow else "") + f" < {y}, borrow: {top + 10} - {y} = "
                         f"{top + 10 - y}, write {top + 10 - y}")
            out.append(top + 10 - y)
            borrow = 1
        else:
            lines.append(f"{x}" + (f" - {borrow}" if borrow else "") + f" - {y} = {top - y}, write {top - y}")
            out.append(top - y)
            borrow = 0
    lines.append("digits from the right: " + " ".join(map(str, out)))
    return "\n".join(lines) + "\n"


def addition(rng: random.Random, level: int) -> Item:
    a, b = _operands(rng, level)
    q = rng.choice(["What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} + {b}.", "{a} + {b} = ?"])
    return Item("addition", level, q.format(a=a, b=b), column_sum(a, b), f"{a} + {b} = {a + b}", str(a + b))


def subtraction(rng: random.Random, level: int) -> Item:
    """The larger number first."""
    a, b = _operands(rng, level)
    a, b = max(a, b), min(a, b)
    q = rng.choice(["What is {a} - {b}?", "Subtract {b} from {a}.", "Compute {a} - {b}.", "{a} - {b} = ?"])
    return Item("subtraction", level, q.format(a=a, b=b), column_difference(a, b), f"{a} - {b} = {a - b}", str(a - b))


NAMES = ["Tom", "Anna", "Sam", "Maria", "Ben", "Lily", "Omar", "Zoe", "Max", "Nina"]
THINGS = ["apples", "books", "coins", "stickers", "marbles", "cards", "pens", "shells"]


def word_problem(rng: random.Random, level: int) -> Item:
    """A story of `level` + 1 changes to a count; the trace keeps the running total, the answer states it."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    top = (10, 20, 50, 100)[level - 1]
    total = rng.randint(2, top)
    sentences, lines = [f"{name} has {total} {thing}."], []
    for _ in range(level + 1):
        if rng.random() < 0.5 or total < 2:
            n = rng.randint(1, top)
            sentences.append(rng.choice([f"{name} gets {n} more.", f"A friend gives {name} {n} more.",
                                         f"{name} finds {n} more."]))
            lines.append(f"{total} + {n} = {total + n}")
            total += n
        else:
            n = rng.randint(1, total - 1)
            sentences.append(rng.choice([f"{name} gives away {n}.", f"{name} loses {n}.", f"{name} uses {n}."]))
            lines.append(f"{total} - {n} = {total - n}")
            total -= n
    q = " ".join(sentences) + f" How many {thing} does {name} have now?"
    return Item("word_problem", level, q, "\n".join(lines) + "\n", f"{name} has {total} {thing}.", str(total))


def comparison(rng: random.Random, level: int) -> Item:
    """The larger of two numbers of the same length, compared digit by digit from the left."""
    digits = level + 1
    a = _number(rng, digits)
    shared = rng.randint(0, digits - 1)  # leading digits both numbers share: the trace walks past them
    b = a
    while b == a:
        rest = "".join(str(rng.randint(0, 9)) for _ in range(digits - shared))
        b = int(str(a)[:shared] + rest) if shared or rest[0] != "0" else a
    q = rng.choice(["Which is larger, {a} or {b}?", "Which number is bigger: {a} or {b}?"]).format(a=a, b=b)
    lines = []
    for i, (x, y) in enumerate(zip(str(a), str(b))):
        if x == y:
            lines.append(f"digit {i + 1}: {x} = {y}")
        else:
            big = a if x > y else b
            lines.append(f"digit {i + 1}: {x} {'>' if x > y else '<'} {y}, so {big} is larger")
            break
    big = max(a, b)
    return Item("comparison", level, q, "\n".join(lines) + "\n", f"{big} is larger.", str(big))


def sorting(rng: random.Random, level: int) -> Item:
    """Selection sort: the trace picks the smallest of what is left each line, the answer lists the picks."""
    n = level + 2
    nums = [rng.randint(0, (20, 50, 100, 100)[level - 1]) for _ in range(n)]
    q = rng.choice(["Sort {l}.", "Sort these numbers from smallest to largest: {l}.", "Put {l} in order."])
    left, lines = list(nums), []
    for _ in range(n - 1):
        m = min(left)
        lines.append(f"smallest of {', '.join(map(str, left))} is {m}")
        left.remove(m)
    lines.append(f"last is {left[0]}")
    out = ", ".join(map(str, sorted(nums)))
    return Item("sorting", level, q.format(l=", ".join(map(str, nums))), "\n".join(lines) + "\n", out, out)


def counting(rng: random.Random, level: int) -> Item:
    """Count the even (or odd) numbers in a list; the trace keeps a running count."""
    n = level + 3
    nums = [rng.randint(1, 50) for _ in range(n)]
    kind = rng.choice(["even", "odd"])
    q = f"How many {kind} numbers are in {', '.join(map(str, nums))}?"
    count, lines = 0, []
    for x in nums:
        is_kind = (x % 2 == 0) == (kind == "even")
        count += is_kind
        lines.append(f"{x} is {'even' if x % 2 == 0 else 'odd'}" + (f", count {count}" if is_kind else ""))
    answer = f"There is 1 {kind} number." if count == 1 else f"There are {count} {kind} numbers."
    return Item("counting", level, q, "\n".join(lines) + "\n", answer, str(count))


def equation(rng: random.Random, level: int) -> Item:
    """Solve a*x + b = c (a = 1 at level 1): undo the addition, then the multiplication."""
    x = rng.randint(1, (9, 20, 30, 50)[level - 1])
    a = 1 if level == 1 else rng.randint(2, (2, 5, 9, 12)[level - 1])
    b = rng.randint(1, (10, 20, 50, 100)[level - 1])
    c = a * x + b
    lhs = "x" if a == 1 else f"{a}x"
    q = rng.choice(["Solve for x: {e}.", "Find x if {e}.", "What is x when {e}?"]).format(e=f"{lhs} + {b} = {c}")
    lines = [f"{lhs} = {c} - {b} = {c - b}"]
    if a != 1:
        lines.append(f"x = {c - b} / {a} = {x}")
    return Item("equation", level, q, "\n".join(lines) + "\n", f"x = {x}", str(x))


FAMILIES: dict[str, Callable[[random.Random, int], Item]] = {
    f.__name__: f for f in (addition, subtraction, word_problem, comparison, sorting, counting, equation)
}

FOLLOW_UP = "follow_up"
ADD_TO_THAT = ["Add {b} to that.", "Now add {b}.", "And plus {b}?", "What is that + {b}?"]
TAKE_FROM_THAT = ["Subtract {b} from that.", "Now take away {b}.", "And minus {b}?", "What is that - {b}?"]


def follow_up(rng: random.Random, before: Item) -> Item | None:
    """A question that refers back to the answer before it ("Add 45 to that."): the trace first reads that
    answer's number out of the chat (`that is 919`), then adds or subtracts in columns as the families do.
    None where the answer before is no single number (a sorted list). Operands of `before`'s level."""
    if "," in before.truth:
        return None
    a, level = int(before.truth), before.level
    b = _number(rng, rng.randint(1, level + 1))
    if a >= 1 and rng.random() < 0.5:
        b = min(b, rng.randint(0, a))
        q, trace, answer, truth = rng.choice(TAKE_FROM_THAT), column_difference(a, b), f"{a} - {b} = {a - b}", a - b
    else:
        q, trace, answer, truth = rng.choice(ADD_TO_THAT), column_sum(a, b), f"{a} + {b} = {a + b}", a + b
    return Item(FOLLOW_UP, level, q.format(b=b), f"that is {a}\n" + trace, answer, str(truth))
