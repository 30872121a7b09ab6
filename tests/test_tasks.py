"""The task corpus: every stored answer and the checker agree with Python's own arithmetic and sorted(),
computed from the question text alone; the splits are deterministic and disjoint."""

from __future__ import annotations

import re

import pytest

from elastic_local.engine.chat import ChatTemplate
from elastic_local.tasks.corpus import (
    chat_text,
    check,
    conversation_text,
    conversations,
    extract,
    held_out,
    items,
    prompt_messages,
)
from elastic_local.tasks.families import ALL_LEVELS, FAMILIES, FOLLOW_UP, TRAIN_LEVELS
from elastic_local.tasks.tokenizer import CHAT_TEMPLATES


def ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def independent_answer(family: str, question: str) -> str:
    """The answer from the question's text, by Python, knowing nothing of the generators' traces."""
    if family == "addition":
        return str(sum(ints(question)))
    if family == "subtraction":
        a, b = ints(question)
        return str(a - b if "Subtract" not in question else b - a)
    if family == "word_problem":
        sentences = question.split(". ")
        total = ints(sentences[0])[0]
        for s in sentences[1:]:
            if "How many" in s:
                break
            n = ints(s)[0]
            total += n if "more" in s else -n
        return str(total)
    if family == "comparison":
        return str(max(ints(question)))
    if family == "sorting":
        return ", ".join(map(str, sorted(ints(question))))
    if family == "counting":
        want = 0 if "even" in question else 1
        return str(sum(1 for x in ints(question) if x % 2 == want))
    if family == "equation":
        m = re.search(r"(\d*)x \+ (\d+) = (\d+)", question)
        a, b, c = int(m.group(1) or 1), int(m.group(2)), int(m.group(3))
        assert (c - b) % a == 0
        return str((c - b) // a)
    raise AssertionError(family)


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_every_answer_matches_python_computed_from_the_question(split):
    for it in items(split, 700, seed=3):
        want = independent_answer(it.family, it.question)
        assert it.truth == want, it
        assert check(it, it.answer), it
        assert extract(it.family, it.answer) == want


def test_checker_rejects_wrong_and_missing_answers():
    for it in items("heldout", 70, seed=5):
        nums = ints(it.truth)
        wrong = ", ".join(str(x + 1) for x in nums)
        assert not check(it, wrong)
        assert not check(it, "I do not know.")
    sort_item = next(i for i in items("train", 50, 0) if i.family == "sorting")
    assert not check(sort_item, ", ".join(map(str, sorted(ints(sort_item.truth), reverse=True))))


def test_trace_computes_the_parts_the_answer_reads_back():
    """Addition writes the sum's digits from the right in the trace; the answer reads them in order."""
    for it in items("train", 200, seed=1, families=("addition", "subtraction")):
        digits = it.trace.strip().splitlines()[-1].removeprefix("digits from the right: ").split()
        assert ("".join(reversed(digits)).lstrip("0") or "0") == it.truth


def test_splits_are_deterministic_disjoint_and_heldout_is_harder():
    a = list(items("train", 300, seed=7))
    assert a == list(items("train", 300, seed=7))
    assert a != list(items("train", 300, seed=8))
    held = list(items("heldout", 300, seed=7))
    assert {i.level for i in a} == set(TRAIN_LEVELS)
    assert {i.level for i in held} == set(ALL_LEVELS)
    assert not any(held_out(i.question) for i in a)
    assert not {i.question for i in a} & {i.question for i in held}
    assert {i.family for i in held} == set(FAMILIES)
    # harder: level 4 conversations are longer than any level-1 one
    longest_l1 = max(len("".join(chat_text(i))) for i in held if i.level == 1)
    assert sum(len("".join(chat_text(i))) > longest_l1 for i in held if i.level == 4) > 20


def test_conversations_use_chatml_with_thinking():
    it = next(iter(items("train", 1, 0)))
    prompt, completion = chat_text(it)
    assert prompt == f"<|im_start|>user\n{it.question}<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert completion == f"{it.trace}</think>{it.answer}<|im_end|>"


def test_a_single_turn_corpus_is_the_items_one_conversation_each():
    """multi_turn 0 (the recipe's default) leaves the corpus the shipped builds were trained on unchanged."""
    convs = list(conversations("train", 200, seed=4))
    assert [c.item for c in convs] == list(items("train", 200, seed=4)) and not any(c.earlier for c in convs)


def test_multi_turn_conversations_follow_up_on_the_answer_before_and_render_as_the_template_does():
    convs = list(conversations("train", 3000, seed=4, multi_turn=0.3))
    assert convs == list(conversations("train", 3000, seed=4, multi_turn=0.3))
    earlier = [c for c in convs if c.earlier]
    assert 0.27 < len(earlier) / len(convs) < 0.33 and {len(c.earlier) for c in earlier} == {1, 2}
    chains = [(*c.earlier, c.item) for c in earlier]
    ups = [(before, it) for chain in chains for before, it in zip(chain, chain[1:]) if it.family == FOLLOW_UP]
    assert 0.35 < len(ups) / sum(len(chain) - 1 for chain in chains) < 0.5  # half, less those after a sorted list
    # a chat's history holds follow-ups, and plain questions come after them
    assert any(it.family == FOLLOW_UP for c in earlier for it in c.earlier)
    assert any(c.earlier[-1].family == FOLLOW_UP and c.item.family != FOLLOW_UP for c in earlier)
    template = ChatTemplate(CHAT_TEMPLATES["all"])
    for c in earlier[:200]:
        prompt, completion = chat_text(c.item, c.earlier)
        assert template.render(prompt_messages(c.item, c.earlier)) == prompt
        assert conversation_text(c) == prompt + completion and completion.endswith(f"{c.item.answer}<|im_end|>")
    for before, up in ups:
        a, b = int(before.truth), ints(up.question)[0]  # the answer before is never a list
        plus = "add" in up.question.lower() or "+" in up.question or "plus" in up.question
        assert up.truth == str(a + b if plus else a - b) and int(up.truth) >= 0
        assert up.trace.startswith(f"that is {a}\n") and check(up, up.answer)
        digits = up.trace.strip().splitlines()[-1].removeprefix("digits from the right: ").split()
        assert ("".join(reversed(digits)).lstrip("0") or "0") == up.truth


def test_the_latest_question_template_drops_earlier_turns_and_the_all_template_keeps_them():
    item, before = list(items("train", 2, seed=5))
    latest, every = ChatTemplate(CHAT_TEMPLATES["latest"]), ChatTemplate(CHAT_TEMPLATES["all"])
    assert latest.render(prompt_messages(item, [before])) == chat_text(item)[0]
    assert every.render(prompt_messages(item, [before])) == chat_text(item, [before])[0]
    assert every.keeps_history and not latest.keeps_history


def test_unknown_split_or_family_is_a_clear_error():
    with pytest.raises(ValueError, match="split"):
        next(items("test", 1, 0))
    with pytest.raises(ValueError, match="multiplication"):
        next(items("train", 1, 0, families=("multiplication",)))
