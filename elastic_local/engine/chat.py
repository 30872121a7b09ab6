"""Conversations: the checkpoint's chat template, and multi-turn chat that reuses caches.

Rendering: the Jinja2 template from tokenizer_config.json (or chat_template.jinja), run the way
transformers runs it (sandboxed, trim_blocks, lstrip_blocks, `raise_exception`, `tojson`), with
`enable_thinking` passed in. Without a template: ChatML with Nemotron-3's thinking convention
(SPEC §3): the generation prompt ends in `<think>\\n` (thinking on) or `<think></think>` (off).

Earlier turns' thinking never goes back into the context: an assistant message is rendered from its
answer alone. So the tokens a turn generated (thinking included) are not the tokens the next turn's
rendered history holds, and a Mamba state cannot be rewound to drop them. Reuse therefore goes through
the session (caches.py): before each turn the prompt's *stable prefix* is found — the tokens it shares
with the same conversation rendered as history, i.e. up to where the assistant's reply begins — and
every budget's cache is snapshotted when it passes that point. The next turn takes, per budget, the
state that consumed the longest prefix of the new rendering (the live cache when nothing changed, the
snapshot when the thinking was dropped) and prefills only the rest. The result equals a fresh run over
the rendered history (tests/test_chat.py checks it token for token); a template that renders the past
differently only costs a longer prefill, never a wrong context.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import TYPE_CHECKING

from jinja2 import ext, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .caches import Session
from .events import Result
from .generate import Generation
from .phases import Request
from .stream import Stream
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .elastic_model import ElasticModel

# ChatML with thinking, for checkpoints that ship no template (the convention of the tests' tiny one)
FALLBACK_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n<think></think>' ~ m.content ~ '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' ~ ('<think>\\n' if enable_thinking else '<think></think>') -}}"
    "{%- endif -%}"
)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (training templates mark assistant text): render the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class TemplateError(ValueError):
    """The chat template raised (`raise_exception`) or failed to render."""


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str | None = None, eos_token: str | None = None):
        def raise_exception(message):
            raise TemplateError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[ext.loopcontrols, _GenerationTag])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source or FALLBACK_TEMPLATE
        try:
            self.template = env.from_string(self.source)
        except Exception as e:  # a jinja2 syntax error: name the template and the line
            raise TemplateError(f"the chat template does not parse ({type(e).__name__}: {e}); fix or remove it") \
                from None
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        enable_thinking=enable_thinking, bos_token=self.bos_token,
                                        eos_token=self.eos_token, tools=None)
        except TemplateError:
            raise
        except Exception as e:  # jinja2 errors: name the template, not a traceback into it
            raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None

    @functools.cached_property
    def keeps_history(self) -> bool:
        """Whether an earlier turn reaches the model: False for a template that renders a chat's latest
        message only (the demo's, trained on one question per conversation), which a chat app says."""
        earlier = "an earlier turn, 5e1f"
        chat = [{"role": "user", "content": earlier}, {"role": "assistant", "content": "A"},
                {"role": "user", "content": "B"}]
        try:
            return earlier in self.render(chat)
        except TemplateError:  # a template with rules of its own about turns: assume it keeps them
            return True


def context_messages(messages: list[dict]) -> list[dict]:
    """Messages as the template sees them: an assistant turn is its answer alone (no reasoning)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def render_prompt(tokenizer: Tokenizer, messages: list[dict], think: bool = True) -> list[int]:
    """Token ids of `messages` in the tokenizer's chat template, with the assistant's turn opened."""
    template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
    return tokenizer.encode(template.render(context_messages(messages), True, think))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Chat:
    """A conversation with the resident model, turn by turn; caches are reused between turns.

        chat = m.chat(system="Be brief.")
        r = chat.send("What is 2 + 2?", think_budget="small", answer_budget="full")
        for ev in chat.stream("And 3 + 3?"): ...

    `messages` holds the conversation (assistant entries keep their thinking under "reasoning", which
    is shown, never fed back). A cancelled turn leaves `messages` as it was."""

    def __init__(self, model: ElasticModel, system: str | None = None, think: bool = True, **options):
        if model.tokenizer is None:
            raise ValueError("chat needs a tokenizer (tokenizer.json in the checkpoint directory)")
        Request.of(**options)  # an unknown option fails here, not at the first turn
        self.model, self.think, self.options = model, think, options
        tok = model.tokenizer
        self.template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.session = Session()
        self._running: Stream | None = None

    def prompt(self, messages: list[dict], think: bool | None = None) -> tuple[list[int], int]:
        """Token ids of the conversation with the assistant's turn opened, and its stable prefix length
        (the tokens the same conversation rendered as history will still start with)."""
        think = self.think if think is None else think
        msgs = context_messages(messages)
        ids = self.model.tokenizer.encode(self.template.render(msgs, True, think))
        history = msgs + [{"role": "assistant", "content": "A"}]
        stable = self.model.tokenizer.encode(self.template.render(history, False, think))
        return ids, common_prefix(ids, stable)

    def _turn(self, text: str, think: bool | None, options: dict) -> tuple[Generation, list[dict]]:
        if self._running is not None and not self._running.done:
            raise RuntimeError("the previous turn is still running; cancel it or read it to the end")
        messages = self.messages + [{"role": "user", "content": text}]
        ids, mark = self.prompt(messages, think)
        req = Request.of(**{**self.options, **options})
        return Generation(self.model, [ids], req, session=self.session, mark=mark), messages

    def _commit(self, messages: list[dict], r: Result) -> None:
        if r.finish_reason != "cancelled":
            self.messages = messages + [{"role": "assistant", "content": r.answer_text, "reasoning": r.think_text}]

    def send(self, text: str, think: bool | None = None, **options) -> Result:
        gen, messages = self._turn(text, think, options)
        r = gen.collect()[0]
        self._commit(messages, r)
        return r

    def stream(self, text: str, think: bool | None = None, **options) -> Stream:
        gen, messages = self._turn(text, think, options)
        self._running = Stream(gen, on_done=lambda results: self._commit(messages, results[0]))
        return self._running
