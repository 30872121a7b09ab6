"""A checkpoint's tokenizer: `tokenizer.json` (run by the `tokenizers` library) and `tokenizer_config.json`
(special tokens, eos, the chat template). Nothing is ever downloaded; a directory without tokenizer.json
has no tokenizer and the engine then works on token ids alone.

Streaming text goes through `IncrementalDecoder`, which decodes a short window of recent tokens and
emits only what is new, holding text back while the window ends inside a multi-byte character.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(file: Path) -> dict:
    """A JSON object from `file` ({} when absent); a corrupt one is a ValueError naming the file."""
    if not file.is_file():
        return {}
    try:
        d = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e}); re-download or re-export it") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file}: not a JSON object; re-download or re-export it")
    return d


class Tokenizer:
    def __init__(self, tok, config: dict | None = None, chat_template: str | None = None):
        from tokenizers import Tokenizer as _Tokenizer

        self.tok: _Tokenizer = tok
        self.config = config or {}
        self.chat_template = chat_template
        self.template_file: Path | None = None  # where chat_template came from (for errors)
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer stored in a checkpoint directory, or None when it has no tokenizer.json.
        The chat template comes from tokenizer_config.json or, as transformers >= 4.43 saves it,
        from chat_template.jinja next to it."""
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        config = _read_json(path / "tokenizer_config.json")
        template, where = config.get("chat_template"), path / "tokenizer_config.json"
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if template is None and (path / "chat_template.jinja").is_file():
            template, where = (path / "chat_template.jinja").read_text(), path / "chat_template.jinja"
        try:
            tok = _Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception with a parser's message
            raise ValueError(f"{path / 'tokenizer.json'}: not a tokenizer the `tokenizers` library reads ({e}); "
                             "re-download or re-export it") from None
        out = cls(tok, config, template)
        out.template_file = where if template is not None else None
        return out

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    @property
    def eos_ids(self) -> set[int]:
        i = self.token_id(self.eos_token)
        return set() if i is None else {i}

    @property
    def think_ids(self) -> tuple[int | None, int | None]:
        """Ids of `<think>` and `</think>` when they are single tokens (None otherwise)."""
        return self.token_id(THINK_START), self.token_id(THINK_END)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as it stands: no BOS or other post-processing (chat templates add their own)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)


class IncrementalDecoder:
    """The text of a growing list of tokens, one piece per pushed token.

    Decoding tokens one at a time is wrong twice over: a character split across byte tokens decodes to
    U+FFFD, and tokenizers that drop a leading space (Metaspace) lose spaces. So each push decodes the
    window `ids[prefix:]` and compares it with the already-emitted `ids[prefix:read]`; the difference
    is new text unless it ends in U+FFFD (an unfinished character: wait for the next token).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] was emitted last; ids[:read] is all emitted

    def push(self, token: int) -> str:
        return self.extend((token,))

    def extend(self, tokens: Sequence[int]) -> str:
        """The new text of several tokens at once, in two decodes where a push a token takes two each (a
        run ahead's tokens, whose pieces nobody reads)."""
        self.ids.extend(tokens)
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character comes out as U+FFFD)."""
        if self.read == len(self.ids):  # nothing held back: two decodes of the last window would say ""
            self.prefix = self.read
            return ""
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]
