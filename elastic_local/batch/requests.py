"""Reading a batch file: every line becomes a Job (a prompt and its engine Request) or a LineError.

Three forms, told apart by the first non-blank line:
- OpenAI batch JSONL (what vLLM's `run_batch` also reads): {"custom_id", "method": "POST", "url":
  "/v1/chat/completions" | "/v1/completions", "body": {"messages" | "prompt", "max_tokens" |
  "max_completion_tokens", "temperature", "top_p", "seed", "stop", ...}}, with the elastic fields in the
  body: "think_budget", "answer_budget", "max_think_tokens", and thinking on/off as vLLM passes it,
  "chat_template_kwargs": {"enable_thinking": false};
- JSONL with a "prompt" (or "messages") field and an optional "custom_id": a chat turn each;
- plain text: one prompt per line, a chat turn each.
Lines without a custom_id are named `line-N`. `max_tokens` / `max_completion_tokens` limit the answer
(as `generate --max-tokens` does); `max_think_tokens` is the think token budget.

A line that cannot run gets a LineError (its code and a message naming the line) and the rest go on;
duplicate custom_ids are an error for the whole file (`check_unique`), since the output is keyed by them.
Checks that need the model's numbers (budget names, the tokenizer, the context) go through a Checker,
which a checkpoint directory provides without loading any weights (`--dry-run`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.chat import render_prompt
from ..engine.elastic_model import generation_config
from ..engine.phases import Request, Row, Rules, Specials
from ..engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from ..engine import ElasticModel

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
# sampling fields and their ranges (min_p and top_k as vLLM takes them); body fields not read here are
# ignored, as OpenAI-compatible servers ignore options they do not know
_NUMBERS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0)}


@dataclass(frozen=True)
class Defaults:
    """What a request that does not say gets (the command line's options)."""

    think_budget: str | None = None
    answer_budget: str | None = None
    max_think_tokens: int = 1024
    max_tokens: int = 1024
    think: bool = True


@dataclass
class Job:
    """One request ready to run."""

    line: int
    custom_id: str
    url: str  # CHAT or COMPLETION: the kind of response body
    prompt: list[int]
    request: Request
    model: str | None  # the body's "model", echoed in the response
    capacity: int  # tokens it can reach: prompt, thinking (when the prompt opens it) and answer limits

    @property
    def key(self) -> str:
        return record_id(self.custom_id, self.line)


@dataclass
class LineError:
    """A line that cannot run: it gets an error record in the output."""

    line: int
    custom_id: str | None
    code: str
    message: str

    @property
    def key(self) -> str:
        return record_id(self.custom_id, self.line)


def record_id(custom_id: str | None, line: int) -> str:
    """The output record's id, the same on every run (resume matches on it): from the custom_id, or from
    the line number for a line that has none."""
    key = f"c:{custom_id}" if custom_id is not None else f"line:{line}"
    return "batch_req_" + hashlib.sha256(key.encode()).hexdigest()[:24]


class Checker:
    """Turns a parsed line into a Job with the model's numbers: budget names, tokenizer, context."""

    def __init__(self, budgets: list[str], tokenizer: Tokenizer | None, context: int, vocab_size: int,
                 defaults: Defaults = Defaults(), think_close: str | None = None):
        self.budgets, self.tokenizer, self.context = budgets, tokenizer, context
        self.vocab_size, self.defaults = vocab_size, defaults
        think = tokenizer.think_ids if tokenizer is not None else (None, None)
        self.specials = Specials(*think, think_close=think_close)  # the capacity a request needs

    @classmethod
    def for_checkpoint(cls, path: str | Path, context: int | None = None, defaults: Defaults = Defaults()) -> Checker:
        """From a checkpoint directory's config and tokenizer alone: no weights are read."""
        from ..elastic.table import read_budgets
        from ..model.config import NemotronHConfig

        path = Path(path)
        cfg = NemotronHConfig.from_dir(path)
        budgets = list(read_budgets(cfg, where=str(path / "config.json")))
        return cls(budgets, Tokenizer.from_dir(path), context or max_context(cfg), cfg.vocab_size, defaults,
                   generation_config(path)[1])

    @classmethod
    def for_model(cls, model: ElasticModel, context: int | None = None, defaults: Defaults = Defaults()) -> Checker:
        return cls(model.budgets, model.tokenizer, context or max_context(model.config), model.config.vocab_size,
                   defaults, model.specials.think_close)

    def job(self, line: int, custom_id: str, url: str, body: dict) -> Job | LineError:
        def bad(code: str, message: str) -> LineError:
            return LineError(line, custom_id, code, f"line {line}: {message}")

        if body.get("n", 1) != 1:
            return bad("unsupported_parameter", f"n={body['n']!r}: one completion per request is supported (n=1)")
        try:
            request = self._request(body)
        except (ValueError, TypeError) as e:
            return bad("invalid_request", str(e))
        for field in ("think_budget", "answer_budget"):
            name = getattr(request, field)
            if name is not None and name not in self.budgets:
                return bad("unknown_budget", f"{field} {name!r} is not a budget of this model; it runs "
                                             f"{', '.join(self.budgets)}")
        try:
            prompt = self._prompt(url, body)
        except (ValueError, TypeError) as e:
            return bad("invalid_request", str(e))
        if not prompt:
            return bad("invalid_request", "the prompt is empty")
        if len(prompt) >= self.context:
            return bad("context_length_exceeded", f"the prompt is {len(prompt)} tokens, longer than the "
                                                  f"context of {self.context}")
        need = Row(0, prompt, Rules.of(request, self.specials, self.tokenizer), None).capacity
        if need > self.context:
            return bad("context_length_exceeded",
                       f"the prompt ({len(prompt)} tokens) and up to {need - len(prompt)} generated exceed the "
                       f"context of {self.context}; lower max_tokens / max_think_tokens or raise --context")
        return Job(line, custom_id, url, prompt, request, body.get("model"), need)

    def _request(self, body: dict) -> Request:
        d = self.defaults
        answer = _int(body, "max_completion_tokens", _int(body, "max_tokens", d.max_tokens))
        think = _int(body, "max_think_tokens", d.max_think_tokens)
        options = {k: _number(body, k, lo, hi) for k, (lo, hi) in _NUMBERS.items() if body.get(k) is not None}
        if "top_p" in options and options["top_p"] == 0:
            raise ValueError("top_p must be > 0")
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        budgets = {}
        for field in ("think_budget", "answer_budget"):
            v = body.get(field, getattr(d, field))
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{field} must be a budget name (a string)")
            budgets[field] = v
        return Request(max_think_tokens=think, max_answer_tokens=answer, seed=seed, top_k=_int(body, "top_k", 0),
                       stop=tuple(stop), **budgets, **options)

    def _prompt(self, url: str, body: dict) -> list[int]:
        if url == CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ValueError("a chat request needs a non-empty 'messages' list")
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise ValueError("chat_template_kwargs must be an object")
            think = kwargs.get("enable_thinking", self.defaults.think)
            if not isinstance(think, bool):
                raise ValueError("chat_template_kwargs.enable_thinking must be true or false")
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: only /v1/completions with token ids run")
            return render_prompt(self.tokenizer, [_message(m) for m in messages], think)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: give the prompt as token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not all(0 <= t < self.vocab_size for t in prompt):
                raise ValueError(f"a prompt token id is outside the vocabulary (0..{self.vocab_size - 1})")
            return list(prompt)
        raise ValueError("a completion request needs 'prompt': one string or a list of token ids (one prompt per "
                         "request)")


def max_context(cfg) -> int:
    """The context a request may fill by default: the checkpoint's max_position_embeddings."""
    return int(cfg.raw.get("max_position_embeddings") or 4096)


def _int(body: dict, key: str, default: int) -> int:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {v!r}")
    return v


def _number(body: dict, key: str, lo: float, hi: float) -> float:
    v = body[key]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{key} must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def _message(m) -> dict:
    """A message as the chat template sees it: role and text (OpenAI text parts are joined)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError("every message needs a 'role' and 'content'")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ValueError("only text content parts are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ValueError("every message needs a 'role' and 'content'")
    return {"role": m["role"], "content": content}


# ---------------------------------------------------------------------------------------------- the file


def read_lines(path: str | Path) -> list[tuple[int, str]]:
    """(line number, text) of every non-blank line."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return [(n, s) for n, s in enumerate(text.splitlines(), 1) if s.strip()]


Check = Callable[[int, str, str, dict], "Job | LineError"]  # Checker.job: (line, custom_id, url, body)


def parse(lines: list[tuple[int, str]], check: Check) -> list[Job | LineError]:
    """Every line as a Job or a LineError (see the module docstring for the forms)."""
    if not lines:
        return []
    if not lines[0][1].lstrip().startswith("{"):
        return [check(n, f"line-{n}", CHAT, {"messages": [{"role": "user", "content": s}]}) for n, s in lines]
    return [_json_line(n, s, check) for n, s in lines]


def _json_line(n: int, s: str, check: Check) -> Job | LineError:
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        return LineError(n, None, "invalid_json", f"line {n}: not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return LineError(n, None, "invalid_request", f"line {n}: expected a JSON object")
    cid = obj.get("custom_id")
    if cid is not None and not isinstance(cid, str):
        return LineError(n, None, "invalid_request", f"line {n}: custom_id must be a string")
    if "body" in obj or "url" in obj or "method" in obj:  # the OpenAI batch form
        if cid is None:
            return LineError(n, None, "missing_custom_id", f"line {n}: every request needs a custom_id")
        url, body = obj.get("url"), obj.get("body")
        if obj.get("method", "POST") != "POST":
            return LineError(n, cid, "invalid_request", f"line {n}: method must be POST")
        if url not in (CHAT, COMPLETION):
            return LineError(n, cid, "invalid_url", f"line {n}: url {url!r} is not supported: use {CHAT} or "
                                                    f"{COMPLETION}")
        if not isinstance(body, dict):
            return LineError(n, cid, "invalid_request", f"line {n}: body must be a JSON object")
        return check(n, cid, url, body)
    if isinstance(obj.get("prompt"), str) or "messages" in obj:  # the plain JSONL form: a chat turn
        body = dict(obj)
        if "messages" not in body:
            body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        return check(n, cid if cid is not None else f"line-{n}", CHAT, body)
    return LineError(n, cid, "invalid_request", f"line {n}: expected an OpenAI batch request (custom_id, method, "
                                                "url, body) or a 'prompt' field")


def check_unique(items: list[Job | LineError]) -> list[str]:
    """One message per custom_id that occurs more than once, naming its lines (empty when all are unique)."""
    lines: dict[str, list[int]] = {}
    for it in items:
        if it.custom_id is not None:
            lines.setdefault(it.custom_id, []).append(it.line)
    return [f"custom_id {cid!r} is used on lines {', '.join(map(str, ns))}" for cid, ns in lines.items() if len(ns) > 1]
