"""The messages of one conversation, scrolled to the newest while a reply streams."""

from __future__ import annotations

from textual.containers import VerticalScroll

from ..reply import Reply
from ..store import Conversation
from .message import AssistantMessage, UserMessage


class ConversationView(VerticalScroll):
    async def show(self, c: Conversation) -> None:
        await self.remove_children()
        widgets = []
        for m in c.messages:
            if m.role == "user":
                widgets.append(UserMessage(m.content))
            else:
                widgets.append(AssistantMessage(Reply.from_history(m.content, m.reasoning, m.status, m.meta)))
        await self.mount_all(widgets)
        self.scroll_end(animate=False)

    async def add_turn(self, text: str, reply: Reply) -> AssistantMessage:
        message = AssistantMessage(reply)
        await self.mount_all([UserMessage(text), message])
        self.anchor()
        return message
