"""The first screen: the fit planner's pick (budget, precision, memory, why) and a progress bar while the
model loads on a worker thread, which also imports torch and checks what needs it; the app opens the chat
when the model is loaded, or closes with the error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Label, ProgressBar, Static

from ..start import Options, Pick, check_sampling, load, plan

if TYPE_CHECKING:
    from elastic_local.engine import ElasticModel


class LoadScreen(Screen):
    @dataclass
    class Loaded(Message):
        model: ElasticModel
        pick: Pick

    def __init__(self, options: Options, session_options: dict | None = None):
        super().__init__()
        self.options, self.session_options = options, session_options or {}

    def compose(self) -> ComposeResult:
        with Vertical(id="loading"):
            yield Label(f"elastic-chat: {self.options.dir}", id="model-dir")
            yield Static("Starting: importing torch, probing this machine, planning what fits…", id="pick",
                         markup=False)
            # a still bar until the load reports: an animated one held the interpreter lock from the worker's
            # imports (the chat opened 0.5 s later)
            yield ProgressBar(id="progress", show_eta=True, total=1)
            yield Label("", id="what")

    def on_mount(self) -> None:
        self.load()

    @work(thread=True, exclusive=True)
    def load(self) -> None:
        try:  # torch imports here, with the screen already up
            check_sampling(self.session_options)
            _, pick = plan(self.options)
            self.app.call_from_thread(self.query_one("#pick", Static).update, f"{pick.why}\nLoading: {pick.line}")
            model = load(self.options, pick, progress=lambda done, total, what: self.app.call_from_thread(
                self.progress, done, total, what))
        except Exception as e:  # the app closes and returns it: cli.main reports it as every command does
            self.app.call_from_thread(self.app.exit, e, 2)
            return
        self.post_message(self.Loaded(model, pick))

    def progress(self, done: int, total: int, what: str) -> None:
        self.query_one(ProgressBar).update(total=total, progress=done)
        self.query_one("#what", Label).update(what)
