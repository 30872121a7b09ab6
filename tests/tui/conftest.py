"""Fixtures of the chat app's tests: the real embedded demo model (the one `elastic-chat` opens with no DIR)
and a data dir of its own for every test."""

from __future__ import annotations

import pytest

import elastic_local
from elastic_local.paths import default_model


@pytest.fixture
def anyio_backend():
    """The async tests (pytest.mark.anyio) run on asyncio, Textual's loop."""
    return "asyncio"


@pytest.fixture(scope="session")
def model_dir():
    return default_model()


@pytest.fixture(scope="session")
def model():
    return elastic_local.load()


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """ELASTIC_LOCAL_HOME in the test's own folder: history and exports never touch the user's."""
    monkeypatch.setenv("ELASTIC_LOCAL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"
