"""The app in a child process, for the crash test: sends one message that thinks for long, then prints
the thinking shown on screen (everything shown has been saved first) and keeps streaming until killed.

    python chat_child.py MODEL_DIR   (ELASTIC_LOCAL_HOME says where the history goes)
"""

import asyncio
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]  # tui_util

from elastic_local.tui.widgets.message import AssistantMessage  # noqa: E402
from elastic_local.tui.widgets.prompt import PromptInput  # noqa: E402
from tui_util import QUESTION, make_app  # noqa: E402

import elastic_local  # noqa: E402


async def main(model_dir: str) -> None:
    # no limit and no eos end the reply: it streams until the parent kills the process
    app = make_app(elastic_local.load(model_dir), max_think_tokens=100000, max_answer_tokens=100000,
                   ignore_eos=True)
    async with app.run_test(size=(80, 24)) as pilot:
        prompt = app.screen.query_one(PromptInput)
        prompt.text = QUESTION
        await pilot.press("enter")
        while True:
            await pilot.pause(0.05)
            shown = app.screen.query(AssistantMessage)
            text = "".join(str(w.render()) for w in shown.first().query(".think-text")) if shown else ""
            if len(text) > 20:
                print(json.dumps({"shown": text}), flush=True)
                await asyncio.sleep(3600)
            if app.session.turn is not None and app.session.turn.reply.status != "streaming":
                raise SystemExit(f"the reply ended ({app.session.turn.reply.status}) before it was killed")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
