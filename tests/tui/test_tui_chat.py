"""The chat app driven with Pilot on the embedded demo model: replies, live switches, Esc, history."""

from __future__ import annotations

import pytest
from elastic_local.tui.store import Store
from elastic_local.tui.widgets.message import AssistantMessage, SwitchMark
from elastic_local.tui.widgets.prompt import PromptInput
from textual.widgets import Collapsible, Markdown
from tui_util import QUESTION, footer, make_app, wait_until

pytestmark = pytest.mark.anyio


async def send(pilot, text: str) -> None:
    prompt = pilot.app.screen.query_one(PromptInput)
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")


def session(pilot):
    return pilot.app.session


async def test_a_message_gets_folded_thinking_and_a_markdown_answer(model):
    app = make_app(model)
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, QUESTION)
        await wait_until(pilot, lambda: session(pilot).turn and session(pilot).turn.reply.status == "done")
        await wait_until(pilot, lambda: "answer [full]" in footer(app))  # the reply re-rendered whole
        reply = session(pilot).turn.reply
        assert "carry" in reply.think  # the demo model adds digit by digit while it thinks
        assert reply.answer.startswith("237 + 682 = ")
        message = app.screen.query_one(AssistantMessage)
        assert message.query_one(Collapsible).collapsed  # folded once the answer started
        answer = "".join(m.source for m in message.query(Markdown))
        assert answer == reply.answer
        stored = Store().conversation(app.screen.conversation_id).messages
        assert [(m.role, m.status) for m in stored] == [("user", "done"), ("assistant", "done")]
        assert stored[1].content == reply.answer and stored[1].reasoning == reply.think
        assert app.screen.query_one(PromptInput).text == ""


async def test_a_seeded_sampled_chat_replies_as_the_library_does(model):
    """elastic-chat's --temperature / --top-p / --seed reach the engine: the app's reply is the library
    chat's with the same sampling (run ahead in the C step there and here), not the greedy one."""
    opts = dict(temperature=1.0, top_p=0.95, seed=8)  # a seed whose draw leaves the greedy path
    app = make_app(model, **opts)
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, QUESTION)
        await wait_until(pilot, lambda: session(pilot).turn and session(pilot).turn.reply.status == "done")
        reply = session(pilot).turn.reply
    limits = dict(max_think_tokens=200, max_answer_tokens=40)
    want = model.chat(**opts).send(QUESTION, **limits)
    greedy = model.chat().send(QUESTION, **limits)
    assert reply.answer == want.answer_text != greedy.answer_text


async def test_sample_switches_the_next_replies_between_sampling_and_greedy(model):
    """/sample temperature=1 top_p=0.95 seed=8: the next reply is the library chat's with that sampling;
    a value out of range is an error that changes nothing; /sample off: greedy again."""
    limits = dict(max_think_tokens=200, max_answer_tokens=40)
    sampled = model.chat(temperature=1.0, top_p=0.95, seed=8).send(QUESTION, **limits).answer_text
    greedy = model.chat().send(QUESTION, **limits).answer_text
    assert sampled != greedy
    app = make_app(model)
    async with app.run_test(size=(80, 24)) as pilot:
        replies = []
        for command in ("/sample temperature=1 top_p=0.95 seed=8", "/sample top_p=2", "/sample off"):
            await send(pilot, command)
            await pilot.pause()
            await send(pilot, QUESTION)
            await wait_until(pilot, lambda: session(pilot).turn and session(pilot).turn.reply.status == "done")
            replies.append(session(pilot).turn.reply.answer)
            await send(pilot, "/new")
            await pilot.pause()
        assert session(pilot).sampling == {"temperature": 0.0, "top_p": 0.95, "seed": 8}
    assert replies == [sampled, sampled, greedy]


async def test_the_app_shortens_the_switch_interval_while_it_runs_and_gives_it_back(model):
    """The generation thread waits for the interpreter between C calls; at the default 5 ms a frame the UI
    thread rendered cost it that much each time (README, "The chat app")."""
    import sys

    from elastic_local.tui.app import SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    async with make_app(model).run_test(size=(80, 24)):
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S) != pytest.approx(before)
    assert sys.getswitchinterval() == before


async def test_a_key_switches_the_answer_budget_mid_reply(model):
    # a short think budget closes thinking early; no limit and no eos can end the answer before the switch
    # (a limit of 4000 tokens did, on a machine that decodes them before the UI shows the first one)
    app = make_app(model, max_think_tokens=16, max_answer_tokens=100000, ignore_eos=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, QUESTION)
        await wait_until(pilot, lambda: session(pilot).turn.reply.rates["answer"].tokens > 0)
        await pilot.press("f3")  # full -> mid, from the next token
        await wait_until(pilot, lambda: any(m.phase == "answer" for m in session(pilot).turn.reply.marks))
        await wait_until(pilot, lambda: session(pilot).turn.reply.marks[-1].tokens is not None)
        await pilot.press("escape")
        await wait_until(pilot, lambda: session(pilot).turn.reply.status == "stopped")
        await pilot.pause()
        reply = session(pilot).turn.reply
        assert reply.stats["answer_budgets"] == ["full", "mid"]
        mark = reply.marks[-1]
        assert (mark.phase, mark.budget) == ("answer", "mid") and mark.tokens >= 1
        await wait_until(pilot, lambda: "answer [full->mid]" in footer(app))  # the reply re-rendered whole
        shown = app.screen.query_one(SwitchMark)
        assert "answer -> mid, caught up" in str(shown.render())
        assert session(pilot).budgets["answer"] == "mid"  # the next message answers on mid too


async def test_escape_stops_the_reply_keeps_it_and_restores_the_prompt(model):
    # no limit and no eos can end the reply before Escape does (a fast machine otherwise wins the race)
    app = make_app(model, max_think_tokens=100000, max_answer_tokens=100000, ignore_eos=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, QUESTION)
        await wait_until(pilot, lambda: session(pilot).turn.reply.rates["think"].tokens > 2)
        await pilot.press("escape")
        await wait_until(pilot, lambda: session(pilot).turn.reply.status == "stopped")
        await wait_until(pilot, lambda: app.screen.query_one(PromptInput).text == QUESTION)
        reply = session(pilot).turn.reply
        stored = Store().conversation(app.screen.conversation_id).messages[-1]
        assert stored.status == "stopped" and stored.reasoning == reply.think and reply.think
        await wait_until(pilot, lambda: "stopped" in footer(app))


async def test_a_new_app_finds_the_conversation_in_the_history(model):
    app = make_app(model)
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, QUESTION)
        await wait_until(pilot, lambda: session(pilot).turn and session(pilot).turn.reply.status == "done")
        answer = session(pilot).turn.reply.answer
    again = make_app(model)
    async with again.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        shown = again.screen.query(AssistantMessage)
        assert len(shown) == 1 and shown.first().reply.answer == answer
        titles = [str(item.query_one("Label").render()) for item in again.screen.query("ConversationItem")]
        assert titles == [QUESTION]
        await send(pilot, "What is 12 + 30?")  # the conversation goes on where it was
        await wait_until(pilot, lambda: session(pilot).turn and session(pilot).turn.reply.status == "done")
        assert len(Store().conversation(again.screen.conversation_id).messages) == 4


async def test_a_message_past_the_context_is_an_error_that_keeps_the_text_and_saves_nothing(model, monkeypatch):
    monkeypatch.setitem(model.config.raw, "max_position_embeddings", 64)
    app = make_app(model)
    notes, notify = [], app.notify
    monkeypatch.setattr(app, "notify", lambda message, **kw: (notes.append(message), notify(message, **kw)))
    async with app.run_test(size=(80, 24)) as pilot:
        long = "word " * 200
        await send(pilot, long)
        await wait_until(pilot, lambda: app.screen.query_one(PromptInput).text.strip() == long.strip())
        assert session(pilot).turn is None and not session(pilot).streaming
        assert any("past the context of 64" in n and "Ctrl+N" in n for n in notes), notes
        assert Store().conversation(app.screen.conversation_id).messages == []
        await send(pilot, QUESTION)  # the app still works
        await wait_until(pilot, lambda: session(pilot).turn and session(pilot).turn.reply.status == "done")


@pytest.fixture(scope="module")
def latest_only(tmp_path_factory):
    """The demo's weights behind a chat template that renders a chat's latest question only (the one a
    model trained on single-turn conversations ships: tasks/tokenizer.py)."""
    import json
    import shutil

    import elastic_local
    from elastic_local.paths import DEMO_MODEL
    from elastic_local.tasks.tokenizer import CHAT_TEMPLATES

    where = tmp_path_factory.mktemp("latest") / "demo"
    shutil.copytree(DEMO_MODEL, where)
    config = json.loads((where / "tokenizer_config.json").read_text())
    (where / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATES["latest"]}))
    return elastic_local.load(where)


async def test_a_follow_up_says_once_that_a_model_sees_the_latest_message_only(latest_only, monkeypatch):
    app = make_app(latest_only)
    notes, notify = [], app.notify
    monkeypatch.setattr(app, "notify", lambda message, **kw: (notes.append(message), notify(message, **kw)))
    async with app.run_test(size=(80, 24)) as pilot:
        for n in range(3):
            await send(pilot, QUESTION)
            await wait_until(pilot, lambda: len(Store().conversation(app.screen.conversation_id).messages)
                             == 2 * (n + 1) and session(pilot).turn.reply.status == "done")  # noqa: B023
            said = [m for m in notes if "latest message only" in m]
            assert len(said) == (0 if n == 0 else 1), notes


async def test_an_engine_failure_shows_on_the_reply_keeps_the_app_and_is_saved(model, monkeypatch):
    app = make_app(model)
    async with app.run_test(size=(80, 24)) as pilot:
        def broken(*args, **kwargs):
            raise RuntimeError("CUDA out of memory (simulated)")

        monkeypatch.setattr(session(pilot).chat, "stream", broken)
        await send(pilot, QUESTION)
        await wait_until(pilot, lambda: session(pilot).turn and session(pilot).turn.reply.status == "error")
        await wait_until(pilot, lambda: "out of memory" in footer(app))
        assert app.is_running and app.screen.query_one(PromptInput).text == QUESTION  # the prompt is back
        stored = Store().conversation(app.screen.conversation_id).messages[-1]
        assert stored.status == "error" and "out of memory" in stored.meta["error"]
