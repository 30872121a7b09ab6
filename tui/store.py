"""Chat history in SQLite: conversations and their messages, saved while a reply streams.

One file, `<data dir>/chat.sqlite3` (`elastic_local.paths.data_dir()`; ELASTIC_LOCAL_HOME relocates it).
WAL journal: every `save_reply` is its own committed transaction, so a process killed with SIGKILL keeps
everything committed before the kill (WAL survives a process crash; only power loss needs
synchronous=FULL). A reply is written as it grows with status "streaming"; on the next start such a reply
is one the app never finished, and `open` marks it "incomplete" (it stays, with the text it had).

Statuses of an assistant message: "streaming" (being written now), "done", "stopped" (Esc),
"incomplete" (the app died mid-reply), "error" (the engine raised; `meta["error"]` says what).
`meta` is JSON: the budgets, thinking on/off, switch marks and the engine's stats.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from elastic_local import paths

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    reasoning TEXT NOT NULL DEFAULT '',
    status TEXT NOT NULL DEFAULT 'done',
    meta TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation, id);
"""


def default_path() -> Path:
    return paths.data_dir() / "chat.sqlite3"


@dataclass
class Message:
    id: int
    role: str  # "user" | "assistant"
    content: str
    reasoning: str = ""
    status: str = "done"
    meta: dict = field(default_factory=dict)


@dataclass
class Conversation:
    id: int
    title: str
    system: str
    updated: float
    messages: list[Message] = field(default_factory=list)


class Store:
    """The history file. Safe to share between the UI thread and the generation thread (one lock)."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.db.executescript(SCHEMA)
        except sqlite3.DatabaseError as e:
            raise ValueError(f"{self.path}: not a usable chat history ({e}); move it aside to start anew") from None
        self.lock = threading.Lock()
        # replies left "streaming" by a process that died are incomplete now
        self._write("UPDATE messages SET status = 'incomplete' WHERE status = 'streaming'")

    def close(self) -> None:
        with self.lock:
            self.db.close()

    def _write(self, sql: str, args: tuple = ()) -> int:
        with self.lock:
            return self.db.execute(sql, args).lastrowid or 0

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self.lock:
            return self.db.execute(sql, args).fetchall()

    # ------------------------------------------------------------------------------------ conversations

    def new_conversation(self, title: str = "New chat", system: str = "") -> int:
        now = time.time()
        return self._write("INSERT INTO conversations (title, system, created, updated) VALUES (?, ?, ?, ?)",
                           (title, system, now, now))

    def conversations(self, search: str = "") -> list[Conversation]:
        """Newest first; `search` matches titles and message text (case-insensitive)."""
        sql = "SELECT id, title, system, updated FROM conversations"
        args: tuple = ()
        if search:
            like = f"%{search}%"
            sql += (" WHERE title LIKE ? OR id IN (SELECT conversation FROM messages"
                    " WHERE content LIKE ? OR reasoning LIKE ?)")
            args = (like, like, like)
        return [Conversation(*row) for row in self._read(sql + " ORDER BY updated DESC, id DESC", args)]

    def conversation(self, cid: int) -> Conversation:
        rows = self._read("SELECT id, title, system, updated FROM conversations WHERE id = ?", (cid,))
        if not rows:
            raise KeyError(f"no conversation {cid} in {self.path}")
        c = Conversation(*rows[0])
        c.messages = [Message(i, role, content, reasoning, status, json.loads(meta)) for i, role, content, reasoning,
                      status, meta in self._read("SELECT id, role, content, reasoning, status, meta FROM messages "
                                                 "WHERE conversation = ? ORDER BY id", (cid,))]
        return c

    def rename(self, cid: int, title: str) -> None:
        self._write("UPDATE conversations SET title = ? WHERE id = ?", (title, cid))

    def set_system(self, cid: int, system: str) -> None:
        self._write("UPDATE conversations SET system = ?, updated = ? WHERE id = ?", (system, time.time(), cid))

    def delete(self, cid: int) -> None:
        self._write("DELETE FROM conversations WHERE id = ?", (cid,))

    # ------------------------------------------------------------------------------------ messages

    def add(self, cid: int, role: str, content: str, status: str = "done", meta: dict | None = None) -> int:
        now = time.time()
        with self.lock:
            self.db.execute("BEGIN")
            mid = self.db.execute("INSERT INTO messages (conversation, role, content, status, meta, created) "
                                  "VALUES (?, ?, ?, ?, ?, ?)",
                                  (cid, role, content, status, json.dumps(meta or {}), now)).lastrowid
            self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, cid))
            self.db.execute("COMMIT")
        return mid

    def save_reply(self, mid: int, content: str, reasoning: str, status: str, meta: dict) -> None:
        """The reply as it stands now, in one committed transaction (called while it streams)."""
        self._write("UPDATE messages SET content = ?, reasoning = ?, status = ?, meta = ? WHERE id = ?",
                    (content, reasoning, status, json.dumps(meta), mid))
