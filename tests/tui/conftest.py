"""Fixtures of the chat app's tests: a real model (the tiny nested one of the generation tests) and a data
dir of its own for every test."""

from __future__ import annotations

import pytest
from gen_util import elastic_model


@pytest.fixture
def anyio_backend():
    """The async tests (pytest.mark.anyio) run on asyncio, Textual's loop."""
    return "asyncio"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat")
    elastic_model(path, seed=3)
    return path


@pytest.fixture(scope="session")
def model(model_dir):
    return elastic_model(model_dir, seed=3)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """ELASTIC_LOCAL_HOME in the test's own folder: history and exports never touch the user's."""
    monkeypatch.setenv("ELASTIC_LOCAL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"
