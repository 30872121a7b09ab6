"""The conversations: a search field over a list, newest first. Enter opens, n new, r rename, d delete."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, ListItem, ListView

from ..store import Conversation


class ConversationItem(ListItem):
    def __init__(self, c: Conversation):
        super().__init__(Label(c.title, markup=False))
        self.conversation_id = c.id


class Sidebar(Vertical):
    BINDINGS = [
        Binding("n", "new", "New"),
        Binding("r", "rename", "Rename"),
        Binding("d,delete", "delete", "Delete"),
    ]

    @dataclass
    class Opened(Message):
        conversation_id: int

    @dataclass
    class Action(Message):
        """The person asked for `what` ("new" | "rename" | "delete") on a conversation (None for new)."""

        what: str
        conversation_id: int | None

    def compose(self) -> ComposeResult:
        yield Input(placeholder="search", id="search")
        yield ListView(id="conversations")

    @property
    def search(self) -> str:
        return self.query_one("#search", Input).value

    async def show(self, conversations: list[Conversation], current: int | None) -> None:
        lv = self.query_one(ListView)
        await lv.clear()
        await lv.extend(ConversationItem(c) for c in conversations)
        ids = [c.id for c in conversations]
        if current in ids:
            lv.index = ids.index(current)

    @property
    def highlighted(self) -> int | None:
        item = self.query_one(ListView).highlighted_child
        return item.conversation_id if isinstance(item, ConversationItem) else None

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, ConversationItem):
            self.post_message(self.Opened(event.item.conversation_id))

    def action_new(self) -> None:
        self.post_message(self.Action("new", None))

    def action_rename(self) -> None:
        if self.highlighted is not None:
            self.post_message(self.Action("rename", self.highlighted))

    def action_delete(self) -> None:
        if self.highlighted is not None:
            self.post_message(self.Action("delete", self.highlighted))
