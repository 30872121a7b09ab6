"""A conversation written out: Markdown to read, JSON to process (the history's own fields)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

from .reply import Mark
from .store import Conversation

NOTE = {"stopped": "stopped (Esc)", "incomplete": "incomplete: the app stopped mid-reply", "error": "error"}


def to_markdown(c: Conversation) -> str:
    out = [f"# {c.title}", ""]
    if c.system:
        out += [f"**System:** {c.system}", ""]
    for m in c.messages:
        if m.role == "user":
            out += ["## User", "", m.content, ""]
            continue
        budgets = f"think {m.meta.get('think_budget', '?')}, answer {m.meta.get('answer_budget', '?')}"
        out += [f"## Assistant ({budgets})", ""]
        if m.reasoning:
            out += ["<details><summary>Thinking</summary>", "", m.reasoning, "", "</details>", ""]
        out += [m.content, ""]
        out += [f"> switch: {Mark(**mark).label()}" for mark in m.meta.get("marks", [])]
        if m.status in NOTE:
            out.append(f"> {NOTE[m.status]}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def to_json(c: Conversation) -> str:
    return json.dumps(asdict(c), indent=2, ensure_ascii=False)


def export(c: Conversation, folder: Path) -> tuple[Path, Path]:
    """Write `<title>-<id>.md` and `.json` into `folder`; returns both paths."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^\w.-]+", "-", c.title).strip("-")[:40] or "chat"
    md, js = folder / f"{stem}-{c.id}.md", folder / f"{stem}-{c.id}.json"
    md.write_text(to_markdown(c), encoding="utf-8")
    js.write_text(to_json(c), encoding="utf-8")
    return md, js
