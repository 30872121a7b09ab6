"""How the front ends report a failure: an expected error (bad input, a missing or corrupt file) is one
line saying what is wrong and what to do; anything else is an internal error (a bug), reported as such
in one line that names the file holding its traceback (`--debug` prints the traceback instead).

Expected errors are the ones the library raises on purpose: ValueError (CheckpointError, ConfigError),
OSError with a file name (not found, exists, permission), and KeyError whose message is a sentence
("unknown budget 'x'; ..."). A KeyError holding a bare key ('mamba_heads') is a bug, never shown alone.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

DEBUG_ENV = "ELASTIC_LOCAL_DEBUG"
USAGE, INTERNAL, INTERRUPTED = 2, 1, 130


def is_expected(e: BaseException) -> bool:
    """Whether `e` is a user-facing error the library raised on purpose (else: a bug)."""
    if isinstance(e, KeyError):
        return bool(e.args) and isinstance(e.args[0], str) and " " in e.args[0]
    if isinstance(e, (json.JSONDecodeError, UnicodeError)):
        return False  # a parser's fragment with no file name: the caller should have wrapped it
    if type(e).__name__ == "OutOfMemoryError" or isinstance(e, MemoryError):
        return True
    if isinstance(e, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return True
    if isinstance(e, OSError):
        return e.filename is not None
    return isinstance(e, ValueError)


def message(e: BaseException) -> str:
    """The one line an expected error shows."""
    if isinstance(e, KeyError):
        text = e.args[0]
    elif isinstance(e, OSError) and e.filename is not None and e.strerror:
        text = f"{e.filename}: {e.strerror}"
    elif type(e).__name__ == "OutOfMemoryError" or isinstance(e, MemoryError):
        text = (f"out of memory ({str(e).splitlines()[0][:160] if str(e) else type(e).__name__}); choose a smaller "
                "budget, precision or context (`elastic-local fit` shows what fits)")
    else:
        text = str(e)
    return " ".join(str(text).split()) or type(e).__name__


def _log_dir() -> Path:
    from .paths import data_dir

    return data_dir() / "logs"


def save_traceback(prog: str, e: BaseException) -> Path | None:
    """Write `e`'s traceback to a new file under the data dir's logs/ (else the temp dir); its path."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for folder in (_log_dir, lambda: Path(tempfile.gettempdir())):
        try:
            d = folder()
            d.mkdir(parents=True, exist_ok=True)
            f = d / f"{prog}-crash-{stamp}-{os.getpid()}.txt"
            f.write_text(f"{prog} {' '.join(sys.argv[1:])}\n{text}")
            return f
        except OSError:
            continue
    return None


def report(prog: str, e: BaseException, debug: bool = False) -> int:
    """Print `e` the way a user should see it (stderr) and return the exit status."""
    debug = debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    if isinstance(e, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    if is_expected(e):
        if debug:
            traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        print(f"{prog}: error: {message(e)}", file=sys.stderr)
        return USAGE
    what = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}".rstrip(": ")
    if debug:
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        where = "traceback above"
    else:
        f = save_traceback(prog, e)
        where = f"traceback in {f}" if f else "traceback could not be saved"
        where += "; rerun with --debug to print it"
    print(f"{prog}: internal error (a bug in elastic-local, please report it): {what} ({where})", file=sys.stderr)
    return INTERNAL
