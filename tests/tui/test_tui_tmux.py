"""End to end in a real terminal: `elastic-chat` with no DIR (the embedded demo model, as a user first runs
it) under tmux at 80x24, driven with send-keys and read with capture-pane. `.ci/run` installs tmux where it
is missing."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from elastic_local.tui.store import Store

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install -y tmux)")


class Tmux:
    def __init__(self, name: str, command: list[str], env: dict[str, str]):
        self.name = name
        exports = " ".join(f"{k}={v}" for k, v in env.items())
        line = " ".join(command)
        subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "80", "-y", "24",
                        f"env {exports} {line}; echo EXITED $?; sleep 60"], check=True)
        # an app's clipboard writes (OSC 52) become tmux paste buffers, which `buffer` reads
        subprocess.run(["tmux", "set-option", "-s", "set-clipboard", "on"], check=True)

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], check=True, capture_output=True,
                              text=True).stdout

    def wait_for(self, text: str, timeout: float = 120.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{text!r} never appeared; the terminal shows:\n{self.screen()}")

    def buffer(self) -> str:
        return subprocess.run(["tmux", "show-buffer"], capture_output=True, text=True).stdout

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], check=False)


ELASTIC_CHAT = Path(sys.executable).with_name("elastic-chat")  # the console script of this install


def test_elastic_chat_with_no_dir_answers_in_a_real_terminal(home, tmp_path):
    t = Tmux(f"elastic-chat-{tmp_path.name}", [str(ELASTIC_CHAT)], {"ELASTIC_LOCAL_HOME": str(home)})
    try:
        screen = t.wait_for("esc Stop")  # planned, loaded, the chat is up
        # the status line: the budget each phase runs on (the demo's largest), the planned precision, context
        assert "think full" in screen and "answer full" in screen and " · bf16 · ctx 0/4096 " in screen
        t.keys("What is 237 + 682?", "Enter")
        screen = t.wait_for("catch-up")  # the stats line: the reply is done
        assert "█ What is 237 + 682?" in screen and "▶ Thinking" in screen  # thinking folded
        assert "237 + 682 = " in screen  # the demo model's answer
        t.keys("F5")  # the answer to the terminal's clipboard
        t.wait_for("Copied the answer")
        assert t.buffer().startswith("237 + 682 = ")
        t.keys("/export", "Enter")
        t.wait_for("Exported to")
        t.keys("C-q")
        t.wait_for("EXITED 0")
    finally:
        t.close()
    [c] = Store().conversations()
    messages = Store().conversation(c.id).messages
    assert [m.role for m in messages] == ["user", "assistant"] and messages[1].status == "done"
    assert [p.suffix for p in sorted((home / "exports").iterdir())] == [".json", ".md"]
