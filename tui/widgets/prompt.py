"""The multi-line input: Enter sends, Shift+Enter or Ctrl+J starts a new line (pasting keeps newlines).

Enter is handled in the widget's own key handler, not by a priority binding: a priority binding runs
when the key reaches the app, before the keys typed just ahead of it have reached the text, so typing
fast (or tmux send-keys) would send a half-typed prompt."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

KEYS = [Binding("enter", "submit", "Send"), Binding("shift+enter,ctrl+j", "newline", "New line in the message")]


class PromptInput(TextArea):
    @dataclass
    class Submitted(Message):
        text: str

    def __init__(self, **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)

    async def on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            self.action_submit()
        elif event.key in ("shift+enter", "ctrl+j"):
            self.insert("\n")
        else:
            return
        event.prevent_default()
        event.stop()

    def action_submit(self) -> None:
        text = self.text.strip()
        if text:
            self.post_message(self.Submitted(text))
            self.clear()

    def restore(self, text: str) -> None:
        """Put a prompt back (the reply to it was stopped): edit and send again."""
        if not self.text.strip():
            self.text = text
            self.move_cursor(self.document.end)
