"""Training data: plain text and chat JSONL, tokenized, packed into sequences, with a held-out split.

Every token carries a flag saying whether the model is trained to predict it: all of a text file, the
assistant turns of a chat (rendered with the checkpoint's chat template, so training sees what
inference will). Documents are joined with the end-of-sequence token into one stream; the last
`heldout_fraction` of the stream is held out, the rest is cut into sequences of the stage's length.
Batches are a pure function of (seed, step), so a resumed run reads exactly what an uninterrupted
one would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.chat import ChatTemplate
from ..engine.tokenizer import Tokenizer


@dataclass
class Stream:
    ids: torch.Tensor  # [N] token ids
    target: torch.Tensor  # [N] bool: is this token's prediction trained (from the position before)?

    def __len__(self) -> int:
        return len(self.ids)


def _chat_spans(template: ChatTemplate, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant answers."""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise ValueError(f"{where}: every message needs a role and a string content")
    text = template.render(messages, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = template.render(messages[:i], add_generation_prompt=True, enable_thinking=False)
        end = template.render(messages[: i + 1], add_generation_prompt=False)
        if not (text.startswith(end) and end.startswith(start)):
            start = template.render(messages[:i], add_generation_prompt=False)  # the whole turn, header too
            if not (text.startswith(end) and end.startswith(start)):
                raise ValueError(f"{where}: the chat template does not render this conversation turn by turn; "
                                 "cannot tell which tokens are the assistant's")
        spans.append((len(start), len(end)))
    return text, spans


def _document(tok: Tokenizer, text: str, spans: list[tuple[int, int]] | None) -> tuple[list[int], list[bool]]:
    enc = tok.tok.encode(text, add_special_tokens=False)
    if spans is None:
        return enc.ids, [True] * len(enc.ids)
    flags = [any(a <= s < b for a, b in spans) for s, _ in enc.offsets]
    return enc.ids, flags


def read_stream(files: list[str | Path], tok: Tokenizer) -> Stream:
    """All documents of all files as one stream; `.jsonl` files are chats, anything else plain text."""
    eos = next(iter(tok.eos_ids), None)
    template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    ids: list[int] = []
    flags: list[bool] = []

    def add(doc_ids: list[int], doc_flags: list[bool]) -> None:
        ids.extend(doc_ids)
        flags.extend(doc_flags)
        if eos is not None:
            ids.append(eos)
            flags.append(doc_flags[-1] if doc_flags else False)

    for f in map(Path, files):
        if not f.is_file():
            raise FileNotFoundError(f"--data {f}: no such file")
        if f.suffix == ".jsonl":
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                where = f"{f}:{n}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not JSON ({e.msg}); chat data is one {{\"messages\": [...]}} "
                                     "object per line") from None
                if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
                    raise ValueError(f"{where}: expected an object with a \"messages\" list")
                add(*_document(tok, *_chat_spans(template, row["messages"], where)))
        else:
            add(*_document(tok, f.read_text(), None))
    if not ids:
        raise ValueError(f"--data {[str(f) for f in files]}: no tokens")
    t = torch.tensor(flags + [False])
    return Stream(torch.tensor(ids), t[1:])  # position j is trained when token j+1 is


def split(stream: Stream, heldout_fraction: float, min_heldout: int) -> tuple[Stream, Stream]:
    """(train, held-out): the held-out part is the stream's tail, at least `min_heldout` tokens."""
    n = max(min_heldout, round(len(stream) * heldout_fraction))
    if len(stream) - n < min_heldout:
        raise ValueError(f"the data has {len(stream)} tokens: too few for a held-out split of {n} and training "
                         f"sequences of {min_heldout}; give more data or a shorter --seq-len")
    cut = len(stream) - n
    return Stream(stream.ids[:cut], stream.target[:cut]), Stream(stream.ids[cut:], stream.target[cut:])


def pack(stream: Stream, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([S, seq_len] ids, [S, seq_len] trained flags); the stream's remainder is dropped."""
    s = len(stream) // seq_len
    if s == 0:
        raise ValueError(f"{len(stream)} tokens do not fill one sequence of {seq_len}; lower --seq-len")
    return stream.ids[: s * seq_len].view(s, seq_len), stream.target[: s * seq_len].view(s, seq_len)


def batch_indices(n: int, batch: int, step: int, seed: int) -> torch.Tensor:
    """The sequences of `step`'s batch: consecutive slices of a fresh permutation per epoch."""
    perms: dict[int, torch.Tensor] = {}
    out = []
    for i in range(step * batch, (step + 1) * batch):
        epoch, pos = divmod(i, n)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perms[epoch][pos]))
    return torch.tensor(out)
