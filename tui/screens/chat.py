"""The chat screen: conversations on the left, the open one in the middle, the input, the status bar and
the keys in the footer. Key bindings map to actions; the actions call the session (the engine) and the
store (the history); the widgets only show what they are given.

Generation runs as a thread worker that pumps the engine's events (tui/reply.py): it saves the reply to
the history as it grows and posts the events to this screen in batches, so the input and the keys
answer while a reply streams, and Esc (Stream.cancel) stops it before its next token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Input
from textual.worker import Worker, WorkerState

from elastic_local import paths
from elastic_local.engine.events import Event

from ..commands import Command, CommandError, parse
from ..export import export, to_markdown
from ..reply import Pace, Reply, pump
from ..session import ChatSession, Turn
from ..store import Store
from ..widgets.conversation import ConversationView
from ..widgets.message import AssistantMessage
from ..widgets.prompt import KEYS, PromptInput
from ..widgets.sidebar import Sidebar
from ..widgets.status import StatusBar
from .help import HelpScreen
from .rename import RenameScreen


@dataclass
class ReplyEvents(Message):
    """A batch of the engine's events for the reply being shown (posted from the generation thread)."""

    message: AssistantMessage
    events: list[Event]


class ChatScreen(Screen):
    BINDINGS = [  # ids: the names keys.toml moves them by (tui/keys.py)
        Binding("escape", "cancel", "Stop", tooltip="stop the reply before its next token; the prompt comes back",
                id="stop"),
        Binding("f2", "cycle('think')", "Think", tooltip="next think budget (smaller, wrapping), live mid-reply",
                id="think_budget"),
        Binding("f3", "cycle('answer')", "Answer", tooltip="next answer budget (smaller, wrapping), live mid-reply",
                id="answer_budget"),
        Binding("f4", "toggle_thinking", "Thinking", tooltip="thinking on/off for the next message", id="thinking"),
        # Export and Copy are not in the footer, so that F1 Help fits in 80 columns; the help screen has them
        Binding("f5", "copy", "Copy", show=False, tooltip="the last answer to the clipboard (/copy: more)",
                id="copy"),
        Binding("ctrl+n", "new", "New", tooltip="a new conversation", id="new"),
        Binding("ctrl+s", "export", "Export", show=False,
                tooltip="this conversation as Markdown and JSON (data dir/exports)", id="export"),
        Binding("ctrl+l", "chats", "Chats", tooltip="to the conversation list and back", id="chats"),
        Binding("f1", "help", "Help", tooltip="this help", id="help"),
    ]

    def __init__(self, session: ChatSession, store: Store, context: int = 0):
        super().__init__()
        self.session, self.store, self.context = session, store, context
        self.conversation_id: int | None = None
        self.turn: Turn | None = None
        self.reply: Reply | None = None  # the reply the status bar is about: the streaming or the last one
        self.pace = Pace()  # how often the generation worker posts a batch (tui/reply.py)
        self._ui_cpu: float | None = None
        self.said_follow_ups_alone = False

    def compose(self) -> ComposeResult:
        with Horizontal():
            yield Sidebar(id="sidebar")
            with Vertical(id="main"):
                yield ConversationView(id="conversation")
                yield PromptInput(id="prompt")
        yield StatusBar(id="status")
        yield Footer()

    async def on_mount(self) -> None:
        latest = self.store.conversations()
        await self.open(latest[0].id if latest else self.store.new_conversation())
        self.query_one(PromptInput).focus()

    # ------------------------------------------------------------------------------------ showing

    def refresh_status(self) -> None:
        s = self.session
        self.query_one(StatusBar).show(s.budgets, s.thinking, s.max_think_tokens, s.precision, self.reply,
                                       self.context)

    async def refresh_sidebar(self) -> None:
        sidebar = self.query_one(Sidebar)
        await sidebar.show(self.store.conversations(sidebar.search), self.conversation_id)

    async def open(self, conversation_id: int) -> None:
        self.conversation_id, self.turn = conversation_id, None
        view = self.query_one(ConversationView)
        await view.show(self.store.conversation(conversation_id))
        replies = view.query(AssistantMessage)
        self.reply = replies.last().reply if replies else None
        await self.refresh_sidebar()
        self.refresh_status()

    def busy(self) -> bool:
        """A reply is streaming: say so (the conversation cannot change under it)."""
        if self.session.streaming:
            self.notify("A reply is streaming; Esc stops it.", severity="warning")
            return True
        return False

    # ------------------------------------------------------------------------------------ sending

    @on(PromptInput.Submitted)
    async def submitted(self, event: PromptInput.Submitted) -> None:
        if event.text.startswith("/"):
            try:
                await self.run_command(parse(event.text))
            except (CommandError, KeyError) as e:
                self.notify(str(e.args[0] if isinstance(e, KeyError) else e), severity="error")
            return
        await self.send(event.text)

    async def send(self, text: str) -> None:
        if self.busy():
            self.query_one(PromptInput).restore(text)
            return
        try:
            self.turn = self.session.start(self.conversation_id, text, self.context or None)
        except ValueError as e:  # bad input (a message past the context): say so, keep the text to edit
            self.query_one(PromptInput).restore(text)
            self.notify(str(e), severity="error")
            return
        self.reply = self.turn.reply
        if self.session.follow_ups_alone and not self.said_follow_ups_alone:
            self.said_follow_ups_alone = True
            self.notify("This model sees your latest message only (its chat template): earlier turns stay "
                        "on screen, not in what it reads.", timeout=10)
        message = await self.query_one(ConversationView).add_turn(text, self.turn.reply)
        await self.refresh_sidebar()
        self.refresh_status()
        self.call_after_refresh(self.begin, self.turn, message)

    def begin(self, turn: Turn, message: AssistantMessage) -> None:
        """The new messages are drawn: start generating (the pace measures from here)."""
        self._ui_cpu = time.thread_time()
        self.generate(turn, message)

    def ui_time(self) -> None:
        """Tell the pace this (the UI) thread's CPU time since the last call."""
        cpu = time.thread_time()
        if self._ui_cpu is not None:
            self.pace.measured(cpu - self._ui_cpu)
        self._ui_cpu = cpu

    @work(thread=True, exclusive=True, group="generate", exit_on_error=False)  # a failed reply, not a crash
    def generate(self, turn: Turn, message: AssistantMessage) -> None:
        self.session.begin(turn)
        pump(turn.stream, turn.reply, self.session.save, lambda batch: self.post_message(ReplyEvents(message, batch)),
             self.pace)

    async def on_reply_events(self, event: ReplyEvents) -> None:
        self.ui_time()
        if event.message.is_attached:
            await event.message.feed(event.events)
        self.refresh_status()

    async def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group != "generate" or event.state not in (WorkerState.SUCCESS, WorkerState.ERROR):
            return
        turn = self.turn
        if event.state == WorkerState.ERROR:  # the reply is saved as "error"; show it so, whole
            self.notify(f"generation failed: {event.worker.error}", severity="error")
            messages = self.query(AssistantMessage)
            if messages and messages.last().reply is getattr(turn, "reply", None):
                await messages.last().finish()
        if turn is not None and turn.reply.status in ("stopped", "error"):
            self.query_one(PromptInput).restore(turn.prompt)
        self.refresh_status()

    # ------------------------------------------------------------------------------------ actions

    def action_cancel(self) -> None:
        if self.session.cancel():
            self.notify("Stopped.")

    def action_cycle(self, phase: str) -> None:
        name = self.session.cycle_budget(phase)
        when = "from the next token" if self.session.streaming else "for the next message"
        self.notify(f"{phase} -> {name} {when}")
        self.refresh_status()

    def action_toggle_thinking(self) -> None:
        self.session.thinking = not self.session.thinking
        self.notify(f"thinking {'on' if self.session.thinking else 'off'} for the next message")
        self.refresh_status()

    async def action_new(self) -> None:
        if not self.busy():
            await self.open(self.store.new_conversation())
            self.query_one(PromptInput).focus()

    def action_export(self) -> None:
        md, js = export(self.store.conversation(self.conversation_id), paths.data_dir() / "exports")
        self.notify(f"Exported to {md} and {js.name}", timeout=8)

    def action_copy(self, what: str = "answer") -> None:
        """To the system clipboard (the terminal's, through OSC 52): the last reply's answer or thinking, the
        last message written, or the whole conversation as Markdown."""
        conversation = self.store.conversation(self.conversation_id)
        if what == "all":
            text = to_markdown(conversation)
        elif what == "prompt":
            text = next((m.content for m in reversed(conversation.messages) if m.role == "user"), "")
        else:
            text = getattr(self.reply, what, "") if self.reply is not None else ""
        if not text:
            self.notify(f"Nothing to copy: no {'message' if what == 'prompt' else what} yet.", severity="warning")
            return
        self.app.copy_to_clipboard(text)
        label = {"answer": "the answer", "think": "the thinking", "prompt": "your message", "all": "the conversation"}
        self.notify(f"Copied {label[what]} ({len(text)} characters).")

    def action_chats(self) -> None:
        lv = self.query_one("#conversations")
        if lv.has_focus:
            self.query_one(PromptInput).focus()
        else:
            lv.focus()

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(self.app.BINDINGS + self.BINDINGS + Sidebar.BINDINGS + KEYS, self.app.keys))

    async def run_command(self, c: Command) -> None:
        if c.name == "budget":
            for phase, name in c.budgets.items():
                self.session.set_budget(phase, name)
            self.notify(", ".join(f"{p} -> {n}" for p, n in c.budgets.items()))
        elif c.name == "think":
            if c.thinking is not None:
                self.session.thinking = c.thinking
            if c.think_tokens is not None:
                self.session.max_think_tokens = c.think_tokens
            self.notify(f"thinking {'on' if self.session.thinking else 'off'}, "
                        f"at most {self.session.max_think_tokens} tokens")
        elif c.name == "system":
            self.store.set_system(self.conversation_id, c.text)
            self.notify(f"system prompt: {c.text}" if c.text else "no system prompt")
        elif c.name == "sample":
            try:
                s = self.session.set_sampling(**c.sampling)
            except ValueError as e:
                raise CommandError(f"/sample: {e}") from None
            self.notify("greedy" if s.greedy else
                        f"sampling: temperature {s.temperature}, top_p {s.top_p}, top_k {s.top_k}, min_p {s.min_p}, "
                        f"seed {'new each reply' if s.seed is None else s.seed}")
        elif c.name == "new":
            await self.action_new()
        elif c.name == "export":
            self.action_export()
        elif c.name == "copy":
            self.action_copy(c.text)
        elif c.name == "help":
            self.action_help()
        self.refresh_status()

    # ------------------------------------------------------------------------------------ the sidebar

    @on(Input.Changed, "#search")
    async def searched(self) -> None:
        await self.refresh_sidebar()

    @on(Sidebar.Opened)
    async def opened(self, event: Sidebar.Opened) -> None:
        if event.conversation_id != self.conversation_id and not self.busy():
            await self.open(event.conversation_id)
            self.query_one(PromptInput).focus()

    @on(Sidebar.Action)
    async def sidebar_action(self, event: Sidebar.Action) -> None:
        cid = event.conversation_id
        if event.what == "new":
            await self.action_new()
        elif event.what == "rename":
            title = self.store.conversation(cid).title

            async def renamed(new: str | None) -> None:
                if new:
                    self.store.rename(cid, new)
                    await self.refresh_sidebar()

            self.app.push_screen(RenameScreen(title), renamed)
        elif event.what == "delete":
            if cid == self.conversation_id and self.busy():
                return
            self.store.delete(cid)
            if cid == self.conversation_id:
                rest = self.store.conversations()
                await self.open(rest[0].id if rest else self.store.new_conversation())
            else:
                await self.refresh_sidebar()
