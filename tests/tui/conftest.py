"""Fixtures of the chat app's tests: a real model (the tiny nested one of the generation tests), a data
dir of its own for every test, and `wait_until` in place of sleeps."""

from __future__ import annotations

import asyncio
import time

import pytest
from elastic_local.tui.app import ElasticChat
from elastic_local.tui.store import Store
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


def make_app(model, **options) -> ElasticChat:
    """The app on a loaded model with the tests' generation limits (the think budget closes thinking)."""
    defaults = dict(max_think_tokens=8, max_answer_tokens=12, think_close="ok.", precision="fp32")
    return ElasticChat(model=model, store=Store(), **{**defaults, **options})


async def wait_until(pilot, predicate, timeout: float = 30.0) -> None:
    """Let the app run until `predicate()` holds; fail after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {predicate.__doc__ or predicate}")
        await pilot.pause(0.01)
    await asyncio.sleep(0)
