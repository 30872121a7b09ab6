"""Helpers of the chat app's tests: the app on a loaded model, and `wait_until` in place of sleeps."""

from __future__ import annotations

import asyncio
import time

from elastic_local.tui.app import ElasticChat
from elastic_local.tui.store import Store

QUESTION = "What is 237 + 682?"  # one of the demo model's task families (it thinks digit by digit, then answers)


def make_app(model, **options) -> ElasticChat:
    """The app on a loaded model with the tests' generation limits (greedy: the engine's default temperature 0)."""
    defaults = dict(max_think_tokens=200, max_answer_tokens=40, precision="fp32")  # the demo loads as float32 on CPU
    return ElasticChat(model=model, store=Store(), **{**defaults, **options})


def footer(app) -> str:
    """The reply's footer as shown, or "" while the reply re-renders itself whole at its end (`finish`
    recomposes it, so for a moment it has no footer)."""
    found = app.screen.query(".reply-footer")
    return str(found.last().render()) if found else ""


async def wait_until(pilot, predicate, timeout: float = 30.0) -> None:
    """Let the app run until `predicate()` holds; fail after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {predicate.__doc__ or predicate}")
        await pilot.pause(0.01)
    await asyncio.sleep(0)
