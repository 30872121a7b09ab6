"""Every key and slash command, built from the bindings themselves (nothing listed twice)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ..commands import HELP


def key_lines(bindings: list[Binding | tuple]) -> list[str]:
    out, seen = [], set()
    for b in bindings:
        b = b if isinstance(b, Binding) else Binding(*b)
        keys = " / ".join(k.strip() for k in b.key.split(","))
        if b.description and keys not in seen:
            seen.add(keys)
            out.append(f"  {keys:<20} {b.tooltip or b.description}")
    return out


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def __init__(self, bindings: list):
        super().__init__()
        self.bindings = bindings

    def compose(self) -> ComposeResult:
        text = "\n".join(["Keys", *key_lines(self.bindings), "", "Sidebar (Ctrl+L or Tab to reach it): Enter opens",
                          "", "Commands", *(f"  {line}" for line in HELP), "", "Esc closes this help."])
        with VerticalScroll(id="help"):
            yield Static(text, markup=False)
