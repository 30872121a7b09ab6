"""The app's one link to the engine: which budgets run, thinking on/off, the system prompt, and the
turn that is streaming. Everything here is the library's API (`ElasticModel.chat`, `Stream.switch`,
`Stream.cancel`); the TUI holds no model logic.

The history file is the conversation's source of truth: before each turn the engine's Chat is given the
conversation as stored (earlier replies as their answers; a stopped or incomplete reply with what it
had written), and the Chat's session reuses every cache whose tokens are a prefix of it, so resuming a
conversation, or going on after a stopped reply, costs only the new tokens' prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_local.engine import ElasticModel, Stream
from elastic_local.engine.sampling import Sampling

from .reply import Reply
from .store import Conversation, Store

SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed")  # Request's sampling options


@dataclass
class Turn:
    """A reply being generated: the engine's stream, the reply's account and its row in the history."""

    reply: Reply
    message_id: int
    prompt: str
    stream: Stream | None = None  # None until `ChatSession.begin`
    cancelled: bool = False  # Esc before it began


class ChatSession:
    def __init__(self, model: ElasticModel, store: Store, think_budget: str | None = None,
                 answer_budget: str | None = None, thinking: bool = True, max_think_tokens: int | None = 1024,
                 max_answer_tokens: int | None = 1024, precision: str = "", **options):
        self.model, self.store = model, store
        self.budget_names = model.budgets  # largest first
        self.budgets = {"think": think_budget or self.budget_names[0], "answer": answer_budget or self.budget_names[0]}
        for name in self.budgets.values():
            model.budget(name)  # an unknown name fails here, naming the ones there are
        self.thinking = thinking
        self.max_think_tokens, self.max_answer_tokens = max_think_tokens, max_answer_tokens
        self.precision = precision
        self.sampling = {k: options.pop(k) for k in SAMPLING if k in options}  # the next replies', /sample
        Sampling(**self.sampling)  # out of range: say so now, not at the first reply
        self.options = options
        self.chat = model.chat(**options)
        self.turn: Turn | None = None

    @property
    def follow_ups_alone(self) -> bool:
        """Whether the model sees a chat's latest message only (its template drops earlier turns, as the
        demo's does): with earlier turns on screen, the chat says so."""
        return any(m["role"] == "user" for m in self.chat.messages) and not self.chat.template.keeps_history

    @property
    def streaming(self) -> bool:
        return self.turn is not None and self.turn.reply.status == "streaming"

    # ------------------------------------------------------------------------------------ sampling

    def set_sampling(self, **changes) -> Sampling:
        """Sample the next replies with `changes` over the settings so far (temperature 0: greedy); a value
        out of range raises ValueError and changes nothing."""
        sampling = Sampling(**{**self.sampling, **changes})
        self.sampling.update(changes)
        return sampling

    # ------------------------------------------------------------------------------------ budgets

    def set_budget(self, phase: str, name: str) -> None:
        """Run `phase` on budget `name`: from the next token if a reply is streaming, and for later turns."""
        self.model.budget(name)
        self.budgets[phase] = name
        if self.streaming and self.turn.stream is not None:
            self.turn.stream.switch(**{phase: name})
        elif self.streaming:  # saved, not begun: it starts on this budget
            setattr(self.turn.reply, f"{phase}_budget", name)

    def cycle_budget(self, phase: str) -> str:
        """The next budget for `phase`, smaller first, wrapping from the smallest to the largest."""
        names = self.budget_names
        name = names[(names.index(self.budgets[phase]) + 1) % len(names)]
        self.set_budget(phase, name)
        return name

    # ------------------------------------------------------------------------------------ turns

    @staticmethod
    def context(conversation: Conversation) -> list[dict]:
        """The messages the model sees: the system prompt, the user messages and every reply's answer."""
        out = [{"role": "system", "content": conversation.system}] if conversation.system else []
        for m in conversation.messages:
            if m.role == "user" or m.content:
                out.append({"role": m.role, "content": m.content})
        return out

    def start(self, conversation_id: int, text: str, context: int | None = None) -> Turn:
        """Save the user's message and an empty reply; `begin` starts generating it. (The screen draws the
        new messages in between, so that layout does not compete with the first tokens for the
        interpreter.) A conversation that no longer fits the model's context (or the planned `context`)
        is a ValueError, raised before anything is saved."""
        if self.streaming:
            raise RuntimeError("a reply is still streaming; press Esc to stop it first")
        conversation = self.store.conversation(conversation_id)
        self.chat.messages = self.context(conversation)
        messages = self.chat.messages + [{"role": "user", "content": text}]
        prompt_ids, _ = self.chat.prompt(messages, think=self.thinking)
        limits = [n for n in (self.chat.model.context_limit, context) if n]
        if limits and len(prompt_ids) >= min(limits):
            raise ValueError(f"this message makes the conversation {len(prompt_ids)} tokens, past the context of "
                             f"{min(limits)}; shorten it or start a new chat (Ctrl+N)")
        reply = Reply(self.budgets["think"], self.budgets["answer"], self.thinking, prompt_tokens=len(prompt_ids))
        self.store.add(conversation_id, "user", text)
        if not conversation.messages and conversation.title == "New chat":
            self.store.rename(conversation_id, title_of(text))
        mid = self.store.add(conversation_id, "assistant", "", status="streaming", meta=reply.meta())
        self.turn = Turn(reply, mid, text)
        return self.turn

    def begin(self, turn: Turn) -> Stream:
        """Start generating `turn`'s reply on the engine's thread (the chat's caches reused)."""
        r = turn.reply
        try:
            turn.stream = self.chat.stream(turn.prompt, think=r.thinking, think_budget=r.think_budget,
                                           answer_budget=r.answer_budget, max_think_tokens=self.max_think_tokens,
                                           max_answer_tokens=self.max_answer_tokens, **self.sampling)
        except Exception as e:  # the history says so too, as for a failure mid-reply
            r.status, r.error = "error", f"{type(e).__name__}: {e}"
            self.save(r)
            raise
        if turn.cancelled:
            turn.stream.cancel()
        return turn.stream

    def save(self, reply: Reply) -> None:
        """Write the streaming reply to the history (called from the generation thread)."""
        self.store.save_reply(self.turn.message_id, reply.answer, reply.think, reply.status, reply.meta())

    def cancel(self) -> bool:
        """Stop the streaming reply before its next token; False when nothing streams."""
        if not self.streaming:
            return False
        self.turn.cancelled = True
        if self.turn.stream is not None:
            self.turn.stream.cancel()
        return True


def title_of(text: str, width: int = 40) -> str:
    """A conversation's title from its first message: the first line, cut at a word."""
    line = text.strip().splitlines()[0] if text.strip() else "New chat"
    if len(line) <= width:
        return line
    return line[:width].rsplit(" ", 1)[0] + "…"
