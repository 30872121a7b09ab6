"""Snapshots of the main screens at 80x24 (pytest-textual-snapshot; `--snapshot-update` rewrites them).
The conversation comes from the history, so the text is fixed; memory in use is pinned."""

from __future__ import annotations

import pytest
from elastic_local.tui.reply import Mark, Reply
from elastic_local.tui.store import Store
from tui_util import make_app

SIZE = (80, 24)
ANSWER = """Two steps:

1. **Split** the list in half.
2. Merge the halves.

```python
def merge(a, b):
    return sorted(a + b)
```"""
STATS = dict(prompt_tokens=41, prefill_tokens=41, prefill_s=0.05, think_tokens=12, think_inserted=0, think_s=0.1,
             answer_tokens=60, answer_s=0.9, catch_up_tokens=130, catch_up_s=0.21, transplants=0,
             think_budgets=["small"], answer_budgets=["full", "small"])


@pytest.fixture
def history(home):
    """One conversation: a reply with thinking, an answer switched to the small budget in the middle."""
    store = Store()
    store.new_conversation("An older chat")
    cid = store.new_conversation("Merge sort in two steps")
    store.add(cid, "user", "How does merge sort work? Be brief.")
    reply = Reply("small", "small", think="The user wants a short answer. Split, sort, merge.",
                  answer=ANSWER, status="done", prompt_tokens=41, stats=STATS)
    reply.marks = [Mark("answer", "small", ANSWER.index("2. Merge"), tokens=130, seconds=0.21)]
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
