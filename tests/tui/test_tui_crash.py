"""kill -9 in the middle of a reply loses nothing that was shown, and the next start shows the partial
reply, marked incomplete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from elastic_local.tui.store import Store
from elastic_local.tui.widgets.message import AssistantMessage
from tui_util import QUESTION, make_app

CHILD = Path(__file__).with_name("chat_child.py")


@pytest.mark.anyio
async def test_a_reply_killed_with_sigkill_is_there_on_restart(model, model_dir, home):
    child = subprocess.Popen([sys.executable, str(CHILD), str(model_dir)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "ELASTIC_LOCAL_HOME": str(home)})
    try:
        line = child.stdout.readline()
        assert line, "the child app exited before it showed any thinking"
        shown = json.loads(line)["shown"]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    store = Store()  # opening the history marks the reply the dead process left "streaming" as incomplete
    [conversation] = store.conversations()
    user, reply = store.conversation(conversation.id).messages
    assert user.content == QUESTION
    assert reply.status == "incomplete" and reply.reasoning.startswith(shown)
    app = make_app(model)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        message = app.screen.query_one(AssistantMessage)
        assert message.reply.think == reply.reasoning
        assert "incomplete" in str(message.query_one(".reply-footer").render())
