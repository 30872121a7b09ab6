"""elastic-chat: the terminal chat app. It shows the loading screen (fit pick, progress) and then the chat
screen; `cli.main` starts it from the command line. Tests and benchmarks hand it a loaded model instead."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from textual.app import App
from textual.binding import Binding

from .screens.load import LoadScreen
from .start import Options
from .store import Store

if TYPE_CHECKING:
    from elastic_local.engine import ElasticModel

    from .session import ChatSession

# The interpreter's switch interval while the chat screen runs. The generation thread holds no interpreter lock in
# C (a run ahead's 2 ms of a demo model's tokens), but needs it back between calls; while the UI thread
# renders, it waited out the default 5 ms each time: the app decoded at 0.56-0.77x `generate`'s rate, and
# at 0.91-0.98x with 0.2 ms set for the whole process and 0.80-1.08x through this setting, the reply's wall time
# unchanged (benchmarks/bench_chat.py, README "The chat app").
SWITCH_INTERVAL_S = 0.0002


class ElasticChat(App):
    """Give it `options` (it loads the model) or a loaded `model`."""

    CSS_PATH = "chat.tcss"
    TITLE = "elastic-chat"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", show=False, priority=True, id="quit")]
    ENABLE_COMMAND_PALETTE = False  # every action has a key (F1 lists them); the footer needs the room

    def __init__(self, options: Options | None = None, model: ElasticModel | None = None,
                 store: Store | None = None, precision: str = "", keys: Mapping[str, str] | None = None,
                 **session_options):
        """`keys`: action -> keys, as keys.load reads them from keys.toml (checked there)."""
        super().__init__()
        if (options is None) == (model is None):
            raise ValueError("give ElasticChat either options (to load a model) or a loaded model")
        self.options, self.model, self.store = options, model, store
        self.keys = dict(keys or {})
        if self.keys:
            self.set_keymap(self.keys)
        self.precision, self.session_options = precision, session_options
        self.session: ChatSession | None = None
        self._switch_interval = sys.getswitchinterval()  # the process's own, given back at unmount

    def on_mount(self) -> None:
        self.store = self.store or Store()
        if self.model is None:
            self.push_screen(LoadScreen(self.options, self.session_options))
        else:
            self.open_chat(self.model)

    def on_load_screen_loaded(self, event: LoadScreen.Loaded) -> None:
        self.precision = event.pick.precision or ""
        self.open_chat(event.model)

    def open_chat(self, model: ElasticModel) -> None:
        from .screens.chat import ChatScreen  # the engine's modules: not before the loading screen shows
        from .session import ChatSession

        sys.setswitchinterval(SWITCH_INTERVAL_S)  # from the chat on: the load's imports ran ~0.5 s slower under it
        self.model = model
        self.session = ChatSession(model, self.store, precision=self.precision, **self.session_options)
        context = self.options.context if self.options is not None else 0
        screen = ChatScreen(self.session, self.store, context)
        if isinstance(self.screen, LoadScreen):
            self.switch_screen(screen)
        else:
            self.push_screen(screen)

    def on_unmount(self) -> None:
        sys.setswitchinterval(self._switch_interval)
        if self.session is not None:
            self.session.cancel()
