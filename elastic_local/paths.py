"""Where elastic-local keeps its files: one config dir and one data dir per user.

The platform conventions (what `platformdirs` would answer) without the dependency. One environment
variable, ELASTIC_LOCAL_HOME, relocates both: it wins over every platform rule, so a test or a portable
install points it at one folder and everything (profiles, chat history, caches) lands there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

APP = "elastic-local"
HOME_ENV = "ELASTIC_LOCAL_HOME"


def _home_override() -> Path | None:
    value = os.environ.get(HOME_ENV)
    return Path(value).expanduser() if value else None


def _env_dir(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    return Path(value) if value else default


def config_dir() -> Path:
    """User settings and user hardware profiles (`<config dir>/profiles/*.toml`)."""
    if (home := _home_override()) is not None:
        return home
    if sys.platform == "win32":
        return _env_dir("APPDATA", Path.home() / "AppData" / "Roaming") / APP
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / APP
    return _env_dir("XDG_CONFIG_HOME", Path.home() / ".config") / APP


def data_dir() -> Path:
    """Chat history and other state. On Windows the non-roaming %LOCALAPPDATA%: it can grow large."""
    if (home := _home_override()) is not None:
        return home
    if sys.platform == "win32":
        return _env_dir("LOCALAPPDATA", Path.home() / "AppData" / "Local") / APP
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / APP
    return _env_dir("XDG_DATA_HOME", Path.home() / ".local" / "share") / APP


def cache_dir() -> Path:
    """What can be rebuilt at any time (the compiled CPU decode kernels)."""
    if (home := _home_override()) is not None:
        return home / "cache"
    if sys.platform == "win32":
        return _env_dir("LOCALAPPDATA", Path.home() / "AppData" / "Local") / APP / "cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / APP
    return _env_dir("XDG_CACHE_HOME", Path.home() / ".cache") / APP


# the models that ship inside the package (package data): the embedded demo model, used when none is named,
# and Star Elastic's description (config only), what `fit` plans for when none is named
CATALOG = Path(__file__).resolve().parent / "catalog"
DEMO_MODEL = CATALOG / "demo"
STAR_ELASTIC = CATALOG / "star-elastic"


def default_model() -> Path:
    """The embedded demo model's directory; a clear error when this install lacks it."""
    if not (DEMO_MODEL / "config.json").is_file():
        raise FileNotFoundError(f"{DEMO_MODEL}: the embedded demo model is not in this install; reinstall "
                                "elastic-local, rebuild it (packaging/demo/build.py --ship) or name a checkpoint "
                                "directory")
    return DEMO_MODEL
