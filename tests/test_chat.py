"""Multi-turn chat: templates, thinking left out of the context, and cache reuse that changes nothing.

The oracle for reuse: a turn run on reused caches gives exactly the tokens of a fresh generation over
the same rendered conversation (and each token is its budget's argmax from scratch)."""

import pytest
from gen_util import assert_argmax, at_a_real_models_pace, elastic_model, sampled_tokens
from tiny import CHAT_TEMPLATE

from elastic_local.engine.chat import ChatTemplate, TemplateError
from elastic_local.engine.events import CatchUp, Token

OPTIONS = dict(think_budget="small", answer_budget="full", max_think_tokens=6, max_answer_tokens=5,
               ignore_eos=True, think_close="ok.")


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    return elastic_model(tmp_path_factory.mktemp("chat"), seed=5)


def fresh(m, chat, text, **options):
    """A fresh generation (no session) over the conversation as the chat renders its next turn, `text`."""
    return m.generate(chat.prompt(chat.messages + [{"role": "user", "content": text}])[0], **{**OPTIONS, **options})


@pytest.mark.parametrize("think", [True, False])
def test_turns_on_reused_caches_equal_fresh_runs(m, think):
    chat = m.chat(system="be brief", think=think, **OPTIONS)
    marks = []
    for i, text in enumerate(["hi there", "what is the answer", "and then?"]):
        prompt, mark = chat.prompt(chat.messages + [{"role": "user", "content": text}])
        expected = fresh(m, chat, text)
        s = chat.stream(text)
        events = list(s)
        r = s.result
        assert r.ids == expected.ids and r.ids[: len(prompt)] == prompt
        tokens = sampled_tokens(events, len(prompt))
        assert assert_argmax(m, r.ids, tokens) >= len(tokens) - 1 and len(tokens) == (11 if think else 5)
        if i > 0:
            # the think budget reused its cache up to the previous turn's stable prefix: only the rest ran
            assert r.stats.prefill_tokens == len(prompt) - marks[-1] < len(prompt)
            prefill = [e for e in events if isinstance(e, CatchUp)][0]
            assert prefill.prefill and prefill.tokens == r.stats.prefill_tokens
        marks.append(mark)
        assert chat.messages[-1] == {"role": "assistant", "content": r.answer_text, "reasoning": r.think_text}


def test_earlier_thinking_is_left_out_of_the_context(m):
    chat = m.chat(**OPTIONS)
    r1 = chat.send("first question")
    assert r1.think_text and chat.messages[-1]["reasoning"] == r1.think_text
    prompt, _ = chat.prompt(chat.messages + [{"role": "user", "content": "second"}])
    text = m.tokenizer.decode(prompt)
    assert r1.think_text not in text
    answer = m.tokenizer.decode(m.tokenizer.encode(r1.answer_text))  # as the template's text re-encodes
    assert f"<|im_start|>assistant\n<think></think>{answer}<|im_end|>" in text
    assert text.endswith("<|im_start|>user\nsecond<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_budgets_can_change_between_turns(m):
    chat = m.chat(**OPTIONS)
    chat.send("one")
    chat.send("two", think_budget="full", answer_budget="small")
    expected = fresh(m, chat, "three", think_budget="small", answer_budget="small")
    r = chat.send("three", think_budget="small", answer_budget="small")
    assert r.ids == expected.ids


def test_a_cancelled_turn_leaves_the_chat_as_it_was(m, monkeypatch):
    chat = m.chat(**OPTIONS)
    chat.send("keep this")
    before = list(chat.messages)
    with monkeypatch.context() as slow:
        at_a_real_models_pace(m, slow)
        s = chat.stream("cancel this one", max_think_tokens=30)
        for ev in s:
            if isinstance(ev, Token) and ev.phase == "think":
                s.cancel()
    assert s.result.finish_reason == "cancelled" and chat.messages == before
    expected_prompt = chat.prompt(chat.messages + [{"role": "user", "content": "instead"}])[0]
    r = chat.send("instead")
    assert r.ids == m.generate(expected_prompt, **OPTIONS).ids
    assert r.stats.prefill_tokens < len(expected_prompt)  # still reused the first turn's snapshot


def test_one_turn_at_a_time(m):
    chat = m.chat(**OPTIONS)
    s = chat.stream("slow", max_think_tokens=200)
    with pytest.raises(RuntimeError):
        chat.send("too early")
    s.cancel()
    s.results()
    chat.send("now")


def test_fallback_template_matches_the_checkpoint_template():
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    ours, theirs = ChatTemplate(None), ChatTemplate(CHAT_TEMPLATE)
    for think in (True, False):
        assert ours.render(messages, True, think) == theirs.render(messages, True, think)
    assert ours.render(messages, True, False).endswith("<|im_start|>assistant\n<think></think>")
    assert ours.render(messages[:2], False) == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nq1<|im_end|>\n"


def test_template_helpers_and_errors():
    t = ChatTemplate("{{ messages[0] | tojson }}{% generation %}[{{ bos_token }}]{% endgeneration %}", bos_token="<s>")
    assert t.render([{"role": "user", "content": "é"}]) == '{"role": "user", "content": "é"}[<s>]'
    with pytest.raises(TemplateError, match="no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render([])
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages[5].content.x.y }}").render([])


def test_a_template_says_whether_earlier_turns_reach_the_model():
    from elastic_local.tasks.tokenizer import CHAT_TEMPLATES

    assert ChatTemplate(None).keeps_history and ChatTemplate(CHAT_TEMPLATE).keeps_history
    assert not ChatTemplate(CHAT_TEMPLATES["latest"]).keeps_history  # a single-turn corpus's: the latest question
    strict = "{% if messages | length > 1 %}{{ raise_exception('one message') }}{% endif %}{{ messages[0].content }}"
    assert ChatTemplate(strict).keeps_history  # rules of its own: assumed to keep them


def test_chat_needs_a_tokenizer(m):
    from elastic_local.engine import ElasticModel

    with pytest.raises(ValueError, match="tokenizer"):
        ElasticModel(m.net, {"full": m.budget("full")}).chat()


@pytest.mark.parametrize("think", [True, False])
def test_prompts_render_and_tokenize_as_transformers_does(think):
    """The shipped demo tokenizer and template through our renderer and through transformers'
    apply_chat_template (its own Jinja environment and tokenizer wrapper): the same ids."""
    from transformers import PreTrainedTokenizerFast

    from elastic_local.engine.chat import render_prompt
    from elastic_local.engine.tokenizer import Tokenizer
    from elastic_local.paths import DEMO_MODEL

    conversation = [{"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": "What is 347 + 589?"},
                    {"role": "assistant", "content": "347 + 589 = 936"},
                    {"role": "user", "content": "Sort 5, 2, 9, 1."}]
    hf = PreTrainedTokenizerFast.from_pretrained(DEMO_MODEL)
    ours = Tokenizer.from_dir(DEMO_MODEL)
    for messages in (conversation[1:2], conversation):
        ref = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, enable_thinking=think,
                                     return_dict=False)
        assert render_prompt(ours, messages, think) == list(ref)
