"""Every key and slash command, built from the bindings themselves (nothing listed twice)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from .. import keys
from ..commands import HELP


def key_rows(bindings: list[Binding | tuple], keymap: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(keys, what they do) per binding; `keymap` (keys.toml's) moves the bindings it names by their ids."""
    out, seen = [], set()
    for b in bindings:
        b = b if isinstance(b, Binding) else Binding(*b)
        key = (keymap or {}).get(b.id or "", b.key)
        keys = " / ".join(k.strip() for k in key.split(","))
        if b.description and keys not in seen:
            seen.add(keys)
            out.append((keys, b.tooltip or b.description))
    return out


def command_rows() -> list[tuple[str, str]]:
    """commands.HELP's lines as (usage, what it does): they are written in two columns."""
    return [tuple(part.strip() for part in re.split(r"\s{2,}", line, maxsplit=1)) for line in HELP]


def table(title: str, rows: list[tuple[str, str]]) -> Table:
    """Two columns, the second wrapping under itself (not under the first) in a narrow box."""
    t = Table.grid(padding=(0, 2))
    t.add_column(no_wrap=True)
    t.add_column()
    t.title, t.title_justify = title, "left"
    for row in rows:
        t.add_row(*map(Text, row))  # plain text: a "[" in a description is no markup
    return t


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def __init__(self, bindings: list, keymap: Mapping[str, str] | None = None):
        super().__init__()
        self.bindings, self.keymap = bindings, keymap

    def compose(self) -> ComposeResult:
        sidebar = Text("\nSidebar (Ctrl+L or Tab to reach it): Enter opens\n")
        body = Group(table("Keys", key_rows(self.bindings, self.keymap)), sidebar, table("Commands", command_rows()),
                     Text(f"\nkeys.toml in the config dir (`elastic-local paths`) moves them: action = \"key\", "
                          f"the actions {', '.join(keys.ACTIONS)}.\nEsc closes this help."))
        with VerticalScroll(id="help"):
            yield Static(body)
