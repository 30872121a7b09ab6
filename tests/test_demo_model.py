"""The embedded demo model as a user gets it: `elastic_local.load()` with no path loads it from the
installed package, its tokenizer and chat template work, and every budget solves easy held-out items."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import elastic_local
from elastic_local.engine.chat import ChatTemplate
from elastic_local.evaluate.run import eval_items, score
from elastic_local.paths import DEMO_MODEL
from elastic_local.tasks.corpus import chat_text, items
from elastic_local.tasks.tokenizer import CHAT_TEMPLATES

# measured on the shipped model with this item set (3 per family at level 1, greedy): full, mid and small
# 0.95 / 0.90 / 0.95 (budgets trained by elastic distillation; nest's zero-shot slices gave 1.00 / 1.00 / 0.05);
# the thresholds sit below, with margin
THRESHOLDS = {"full": 0.8, "mid": 0.8, "small": 0.8}


@pytest.fixture(scope="module")
def model():
    return elastic_local.load()


def test_demo_model_ships_inside_the_package(model):
    assert Path(elastic_local.__file__).parent / "catalog" / "demo" == DEMO_MODEL
    assert model.path == DEMO_MODEL
    assert model.budgets == ["full", "mid", "small"]
    assert sum(f.stat().st_size for f in DEMO_MODEL.iterdir()) < 40 * 2**20
    pattern = json.loads((DEMO_MODEL / "config.json").read_text())["hybrid_override_pattern"]
    assert set(pattern) == set("M*E-")


def test_tokenizer_round_trips_and_splits_digits(model):
    tok = model.tokenizer
    for it in items("heldout", 40, seed=2):
        text = "".join(chat_text(it))
        assert tok.decode(tok.encode(text)) == text
    for text in ["What is 347 + 589?", "Ünïcode ✓ and emoji 🙂, tabs\tand\n\nnewlines", "  leading spaces"]:
        assert tok.decode(tok.encode(text)) == text
    pieces = [tok.decode([i]) for i in tok.encode("12345 + 67890")]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("1234567890")
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert len(tok.encode(special)) == 1


def test_chat_template_renders_what_the_model_was_trained_on(model):
    tok = model.tokenizer
    template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    it = next(iter(items("heldout", 1, seed=0)))
    prompt, completion = chat_text(it)
    assert template.render([{"role": "user", "content": it.question}]) == prompt
    assert model.chat_prompt(it.question) == tok.encode(prompt)
    off = template.render([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think></think>")
    assert completion.endswith("<|im_end|>") and tok.eos_token == "<|im_end|>"


def test_the_demo_sees_a_chat_s_latest_question_only_as_it_was_trained(model):
    """One question per training conversation: the template drops earlier turns (a system message stays),
    and the file ships the template the build writes (tasks/tokenizer.py)."""
    tok = model.tokenizer
    assert tok.chat_template == CHAT_TEMPLATES["latest"]
    template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    latest = [{"role": "user", "content": "Sort 3, 1."}]
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert template.render(earlier + latest) == template.render(latest)
    system = [{"role": "system", "content": "Be brief."}]
    assert template.render(system + earlier + latest) == template.render(system + latest)
    answered = template.render(latest + [{"role": "assistant", "content": "1, 3"}], add_generation_prompt=False)
    assert answered.endswith("<|im_start|>assistant\n<think></think>1, 3<|im_end|>\n")


def test_a_follow_up_question_is_answered_as_if_asked_first(model):
    """The chat app's second turn: the same tokens as the question in a fresh chat (with the history
    rendered, the demo answered far fewer of the eval's items asked second than asked first: README)."""
    first, second = list(items("heldout", 2, seed=3))
    chat = model.chat()
    chat.send(first.question, max_think_tokens=200, max_answer_tokens=30)
    followed = chat.send(second.question, max_think_tokens=200, max_answer_tokens=30)
    fresh = model.chat().send(second.question, max_think_tokens=200, max_answer_tokens=30)
    assert followed.ids[followed.prompt_len:] == fresh.ids[fresh.prompt_len:] and followed.answer_text
    assert followed.prompt_ids == fresh.prompt_ids


@pytest.mark.parametrize("budget", ["full", "mid", "small"])
def test_each_budget_solves_easy_heldout_items(model, budget):
    its = eval_items(3, levels=(1,))
    s = score(model, its, budget, budget)
    assert s.n == 21
    assert s.accuracy >= THRESHOLDS[budget], (budget, s.to_dict())


def test_generate_answers_a_plain_question(model):
    r = model.generate(model.chat_prompt("What is 237 + 682?"), max_think_tokens=200, max_answer_tokens=30)
    assert r.think_end == "model" and r.finish_reason == "eos"
    assert re.findall(r"\d+", r.answer_text)[-1] == "919"


def test_the_demo_answers_the_one_digit_sums_a_person_types_first(model):
    """Every a + b and a - b (a >= b) of one digit, as "What is a + b?": the shipped model answers all 155
    (the one before it 153); the first corpus's model 8 (its sums always had a first number of two or more
    digits, and it answered 2 + 2 with 26, 9 - 4 with 95)."""
    questions = {f"What is {a} + {b}?": a + b for a in range(10) for b in range(10)}
    questions |= {f"What is {a} - {b}?": a - b for a in range(10) for b in range(a + 1)}
    right = 0
    for question, want in questions.items():
        r = model.chat().send(question, max_think_tokens=200, max_answer_tokens=30)
        right += re.findall(r"\d+", r.answer_text)[-1:] == [str(want)]
    assert right >= 145, f"{right} of {len(questions)}"


def test_transformers_runs_the_shipped_file_as_we_do(model):
    """The shipped demo is a plain Nemotron-H checkpoint to any loader: transformers' own network on it gives
    our full budget's logits."""
    import torch
    from transformers import NemotronHForCausalLM

    hf = NemotronHForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    ids = torch.tensor([model.tokenizer.encode("What is 347 + 589?")])
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits.float()
    torch.testing.assert_close(model.logits(ids), ref, atol=1e-4, rtol=0)
