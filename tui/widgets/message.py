"""One message in the conversation. A reply is a dimmed, collapsible thinking block and a Markdown answer;
a live budget switch splits the phase's text where it happened, with a mark saying what it cost.

While a reply streams, thinking text is appended to its current part and answer text goes through
`Markdown.get_stream` (appended, never re-rendered per token); at the end the whole reply is rendered
once from its final account (`Reply`), the same way a reply from the history is.
"""

from __future__ import annotations

from dataclasses import replace

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Markdown, Static

from elastic_local.engine.events import CatchUp, Done, Event, Stats, Switch, Token

from ..reply import Mark, Reply

STATUS_NOTE = {"stopped": "stopped (Esc)", "incomplete": "incomplete: the app stopped in the middle of this reply",
               "error": "error"}


def split(text: str, marks: list[Mark], phase: str) -> list[tuple[Mark | None, str]]:
    """The phase's text cut at its switch marks: (the mark before the part, or None first; the part)."""
    out: list[tuple[Mark | None, str]] = []
    start, before = 0, None
    for m in (m for m in marks if m.phase == phase):
        out.append((before, text[start:m.at]))
        start, before = m.at, m
    out.append((before, text[start:]))
    return out


class UserMessage(Static):
    """What the person wrote, as plain text."""

    def __init__(self, text: str):
        super().__init__(text, markup=False, classes="user")


class SwitchMark(Static):
    def __init__(self, mark: Mark):
        super().__init__(f"⇄ {mark.label()}", markup=False, classes="switch")
        self.mark = mark

    def refresh_label(self) -> None:
        self.update(f"⇄ {self.mark.label()}")


class AssistantMessage(Vertical):
    """A reply, from the history or streaming (`feed` it the engine's events in batches)."""

    def __init__(self, reply: Reply):
        super().__init__(classes="assistant")
        self.reply = reply
        self._think_part: Static | None = None
        self._think_buffer = ""
        self._answer_stream = None
        self._marks: list[SwitchMark] = []

    def compose(self) -> ComposeResult:
        r = self.reply
        folded = bool(r.answer) or r.status != "streaming"
        thinking = []
        for mark, part in split(r.think, r.marks, "think"):
            if mark is not None:
                thinking.append(self._mark(mark))
            thinking.append(Static(part, markup=False, classes="think-text"))
        c = Collapsible(*thinking, title=self._think_title(), collapsed=folded, classes="thinking")
        c.display = r.thinking
        yield c
        for mark, part in split(r.answer, r.marks, "answer"):
            if mark is not None:
                yield self._mark(mark)
            yield Markdown(part, classes="answer")
        yield Static(self._footer(), markup=False, classes="reply-footer")

    def _mark(self, mark: Mark) -> SwitchMark:
        w = SwitchMark(mark)
        self._marks.append(w)
        return w

    def _think_title(self) -> str:
        n = self.reply.rates["think"].tokens or (self.reply.stats or {}).get("think_tokens", 0)
        return f"Thinking ({self.reply.think_budget}{f', {n} tokens' if n else ''})"

    def _footer(self) -> str:
        r = self.reply
        lines = [f"⚠ {STATUS_NOTE[r.status]}" + (f": {r.error}" if r.error else "")] if r.status in STATUS_NOTE else []
        if r.stats is not None:
            lines.append(Stats(**r.stats).line())
        elif r.status == "streaming":
            lines.append(f"think on {r.think_budget}, answer on {r.answer_budget} …")
        return "\n".join(lines)

    # ------------------------------------------------------------------------------------ streaming

    async def feed(self, events: list[Event]) -> None:
        """Show a batch of the engine's events (already folded into `self.reply` by the pump)."""
        for ev in _merge_tokens(events):
            if isinstance(ev, Token) and ev.text:
                if ev.phase == "think":
                    await self._think_text(ev.text)
                else:
                    await self._answer_text(ev.text)
            elif isinstance(ev, Switch):
                mark = next(m for m in reversed(self.reply.marks) if m.phase == ev.phase and m.budget == ev.budget)
                await self._switch(mark)
            elif isinstance(ev, CatchUp):
                for w in self._marks:
                    w.refresh_label()
            elif isinstance(ev, Done):
                await self.finish()
                return
        self.query_one(Collapsible).title = self._think_title()

    async def _think_text(self, text: str) -> None:
        if self._think_part is None:
            self._think_part = self.query(".think-text").last()
        self._think_buffer += text
        self._think_part.update(self._think_buffer)

    async def _answer_text(self, text: str) -> None:
        if self._answer_stream is None:
            self.query_one(Collapsible).collapsed = True  # the answer starts: thinking folds
            self._answer_stream = Markdown.get_stream(self.query(Markdown).last())
        await self._answer_stream.write(text)

    async def _switch(self, mark: Mark) -> None:
        if mark.phase == "think":
            c = self.query_one(Collapsible).query_one(Collapsible.Contents)
            self._think_part, self._think_buffer = Static("", markup=False, classes="think-text"), ""
            await c.mount_all([self._mark(mark), self._think_part])
        else:
            await self._stop_stream()
            footer = self.query_one(".reply-footer")
            await self.mount_all([self._mark(mark), Markdown("", classes="answer")], before=footer)

    async def _stop_stream(self) -> None:
        if self._answer_stream is not None:
            await self._answer_stream.stop()
            self._answer_stream = None

    async def finish(self) -> None:
        """The reply ended (done, stopped, failed): render it once, whole, from its final account."""
        await self._stop_stream()
        self._think_part, self._think_buffer, self._marks = None, "", []
        await self.recompose()


def _merge_tokens(events: list[Event]) -> list[Event]:
    """Consecutive tokens of one phase as one: the widgets update once per batch (tui/reply.py's pace), not
    once per token, so the UI thread takes the interpreter from the generation thread less."""
    out: list[Event] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, Token) and isinstance(last, Token) and last.phase == ev.phase:
            out[-1] = replace(last, text=last.text + ev.text)
        else:
            out.append(ev)
    return out
