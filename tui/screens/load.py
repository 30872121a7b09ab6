"""The first screen: the fit planner's pick (budget, precision, memory, why) and a progress bar while the
model loads on a worker thread; the app opens the chat when it is loaded."""

from __future__ import annotations

from dataclasses import dataclass

from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Label, ProgressBar, Static

from elastic_local.engine import ElasticModel

from ..start import Options, Pick, load, plan


class LoadScreen(Screen):
    @dataclass
    class Loaded(Message):
        model: ElasticModel
        pick: Pick

    def __init__(self, options: Options):
        super().__init__()
        self.options = options

    def compose(self) -> ComposeResult:
        with Vertical(id="loading"):
            yield Label(f"elastic-chat: {self.options.dir}", id="model-dir")
            yield Static("Probing this machine and planning what fits…", id="pick", markup=False)
            yield ProgressBar(id="progress", show_eta=True)
            yield Label("", id="what")

    def on_mount(self) -> None:
        self.load()

    @work(thread=True, exclusive=True)
    def load(self) -> None:
        try:
            _, pick = plan(self.options)
            self.app.call_from_thread(self.query_one("#pick", Static).update, f"{pick.why}\nLoading: {pick.line}")
            model = load(self.options, pick, progress=lambda done, total, what: self.app.call_from_thread(
                self.progress, done, total, what))
        except (ValueError, KeyError, FileNotFoundError) as e:
            self.app.call_from_thread(self.app.exit, message=f"elastic-chat: error: {e}", return_code=2)
            return
        self.post_message(self.Loaded(model, pick))

    def progress(self, done: int, total: int, what: str) -> None:
        self.query_one(ProgressBar).update(total=total, progress=done)
        self.query_one("#what", Label).update(what)
