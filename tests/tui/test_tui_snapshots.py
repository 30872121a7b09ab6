"""Snapshots of the main screens at 80x24 (pytest-textual-snapshot; `--snapshot-update` rewrites them).
The conversation comes from the history, so the text is fixed; memory in use is pinned."""

from __future__ import annotations

import pytest
from elastic_local.tui.reply import Mark, Reply
from elastic_local.tui.store import Store
from tui_util import QUESTION, make_app

SIZE = (80, 24)
THINK = """7 + 2 = 9, write 9
3 + 8 = 11, write 1, carry 1
2 + 6 + 1 = 9, write 9
digits from the right: 9 1 9"""
ANSWER = "237 + 682 = 919"  # the demo model's reply to the question, greedy on the full budget
STATS = dict(prompt_tokens=22, prefill_tokens=22, prefill_s=0.05, think_tokens=57, think_inserted=0, think_s=1.5,
             answer_tokens=14, answer_s=0.25, catch_up_tokens=87, catch_up_s=0.21, transplants=0,
             think_budgets=["full"], answer_budgets=["full", "mid"])


@pytest.fixture
def history(home):
    """One conversation with the demo model: a reply with thinking, its answer switched to mid in the middle.
    Timings are pinned here, so the screens do not move with the machine."""
    store = Store()
    store.new_conversation("An older chat")
    cid = store.new_conversation(QUESTION)
    store.add(cid, "user", QUESTION)
    reply = Reply("full", "full", think=THINK, answer=ANSWER, status="done", prompt_tokens=22, stats=STATS)
    reply.marks = [Mark("answer", "mid", ANSWER.index("= 919"), tokens=87, seconds=0.21)]
    mid = store.add(cid, "assistant", "", status="streaming")
    store.save_reply(mid, reply.answer, reply.think, reply.status, reply.meta())
    store.close()


@pytest.fixture(autouse=True)
def fixed_memory(monkeypatch):
    monkeypatch.setattr("elastic_local.tui.widgets.status.memory", lambda: (3 * 2**29, 16 * 2**30))


def test_chat_screen_with_folded_thinking_and_a_switch(snap_compare, model, history):
    assert snap_compare(make_app(model), terminal_size=SIZE)


def test_chat_screen_with_thinking_expanded(snap_compare, model, history):
    async def expand(pilot):
        pilot.app.screen.query_one("CollapsibleTitle").focus()
        await pilot.press("enter")
        await pilot.pause()

    assert snap_compare(make_app(model), terminal_size=SIZE, run_before=expand)


def test_help_screen(snap_compare, model, history):
    assert snap_compare(make_app(model), terminal_size=SIZE, press=["f1"])
