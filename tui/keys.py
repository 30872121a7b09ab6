"""The user's keys: `keys.toml` in the config dir (`elastic-local paths`) moves any action to other keys.

    answer_budget = "f8"            # one key
    stop = "escape,ctrl+g"          # or several, comma-separated
    copy = "ctrl+o"

The names are the bindings' ids (ACTIONS); Textual's keymap applies them, so the footer and the help show
the new keys. A file that cannot be used is refused whole, before the app starts, with the line to fix:
an action that does not exist, a key Textual has no name for, one key given to two actions, or a key the
message input takes for itself (it has the focus while a person types).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from pathlib import Path

from elastic_local import paths

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

FILE = "keys.toml"
# Binding id -> its default keys, as the app and the chat screen declare them (a test holds the two equal).
ACTIONS = {"quit": "ctrl+q", "stop": "escape", "think_budget": "f2", "answer_budget": "f3", "thinking": "f4",
           "copy": "f5", "new": "ctrl+n", "export": "ctrl+s", "chats": "ctrl+l", "help": "f1"}
# The input box's own keys (tui/widgets/prompt.py): it has the focus as a person types, and a focused
# widget's keys come before the screen's, so an action moved onto one of these would never run.
INPUT_KEYS = ("enter", "shift+enter", "ctrl+j")
MODIFIERS = ("ctrl", "shift", "alt", "super", "meta", "hyper")


class KeysError(ValueError):
    """keys.toml cannot be used; the message names the file, the action and what to write instead."""


def path() -> Path:
    return paths.config_dir() / FILE


@functools.cache
def _named() -> frozenset[str]:
    from textual.keys import Keys  # here, not at import: `elastic-chat --help` lists ACTIONS without Textual

    return frozenset(k.value for k in Keys if "+" not in k.value and not k.value.startswith("<"))


@functools.cache
def input_keys() -> frozenset[str]:
    """INPUT_KEYS and the text area's bindings (f6 / f7 select, ctrl+y redoes, the arrows move...)."""
    from textual.widgets import TextArea

    return frozenset(INPUT_KEYS) | {k.strip() for b in TextArea.BINDINGS for k in b.key.split(",")}


def known_key(key: str) -> bool:
    """A key Textual names: modifiers, then a named key (f7, escape, pageup) or a character (x, comma)."""
    from textual.keys import key_to_character

    *mods, base = key.split("+")
    return (all(m in MODIFIERS for m in mods) and len(set(mods)) == len(mods)
            and (base in _named() or (len(base) == 1 and base.isprintable() and base != " ")
                 or (len(base) > 1 and key_to_character(base) is not None)))


def types(key: str) -> bool:
    """The key types a character into the message (x, shift+x, comma, space)."""
    from textual.keys import key_to_character

    *mods, base = key.split("+")
    return set(mods) <= {"shift"} and (len(base) == 1 or base == "space"
                                       or (base not in _named() and key_to_character(base) is not None))


def load(file: Path | None = None) -> dict[str, str]:
    """The keymap of `file` (default: the config dir's keys.toml; none there: no changes)."""
    file = file or path()
    if not file.is_file():
        return {}
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise KeysError(f"{file}: not TOML ({e}); write one line per action, e.g. answer_budget = \"f8\"") from None
    return check(data, str(file))


def check(data: Mapping[str, object], where: str) -> dict[str, str]:
    keymap: dict[str, str] = {}
    for action, value in data.items():
        if action not in ACTIONS:
            raise KeysError(f"{where}: no action {action!r}; the actions are {', '.join(ACTIONS)}")
        if not isinstance(value, str) or not value.strip():
            raise KeysError(f"{where}: {action} = {value!r}: write the key as a string, e.g. {action} = "
                            f"\"{ACTIONS[action]}\"")
        keys = [k.strip().lower() for k in value.split(",")]
        for key in keys:
            if not known_key(key):
                raise KeysError(f"{where}: {action} = {value!r}: {key!r} is not a key name (like f7, ctrl+o, "
                                "escape, pageup or a single character)")
            if key in input_keys() or types(key):
                raise KeysError(f"{where}: {action} = {value!r}: the message input takes {key} (to type, send, "
                                "move or edit), so it would never reach the action; take an F key or ctrl+ a letter")
        keymap[action] = ",".join(keys)
    taken: dict[str, str] = {}
    for action, default in ACTIONS.items():
        for key in keymap.get(action, default).split(","):
            if key in taken:
                raise KeysError(f"{where}: {key} is given to both {taken[key]} and {action}; move one of them")
            taken[key] = action
    return keymap
