"""The output file: append-only, one whole line per write, so a run killed at any moment loses at most
the line being written — and the next run repairs that.

Opening it (1) takes an exclusive lock (two runs never write one file), (2) cuts a torn last line (the
bytes after the last newline: a write the kill interrupted), (3) reads the ids already written, which
the run then skips. Every record is one `os.write` of a complete line on an O_APPEND descriptor: no
buffer to flush and nothing reordered.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path


class OutputError(ValueError):
    """The output file cannot be resumed or written (names the file and the line)."""


class OutputFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise OutputError(f"{self.path}: another run is writing it") from None
        self.repaired = 0  # bytes of a torn last line cut
        self.done = self._read()

    def _read(self) -> set[str]:
        """The ids already written; a torn last line (no newline: a write the kill interrupted) is cut."""
        done, offset = set(), 0
        with open(self.path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.endswith(b"\n"):
                    self.repaired = len(line)
                    os.ftruncate(self.fd, offset)
                    break
                offset += len(line)
                try:
                    done.add(json.loads(line)["id"])
                except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
                    raise OutputError(f"{self.path}: line {n} is not a batch output record; give another output "
                                      "file (or remove this one to start over)") from None
        return done

    def write(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        while data:
            data = data[os.write(self.fd, data):]
        self.done.add(record["id"])

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)  # releases the lock

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
