"""Rename a conversation: one input, Enter keeps it, Esc leaves the title as it was."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label


class RenameScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "dismiss", "Cancel")]

    def __init__(self, title: str):
        super().__init__()
        self.title_now = title

    def compose(self) -> ComposeResult:
        with Vertical(id="rename"):
            yield Label("Rename conversation")
            yield Input(self.title_now, id="title")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)
