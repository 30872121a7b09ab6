"""Starting elastic-chat: the device defaults to auto as in every elastic-local command (cuda when torch sees
a GPU, cpu otherwise), the fit planner plans for that device, and the loading screen opens the chat."""

from __future__ import annotations

import pytest
import torch
from elastic_local.tui.app import ElasticChat, main
from elastic_local.tui.screens.chat import ChatScreen
from elastic_local.tui.start import Options, model_dir, parser, plan
from elastic_local.tui.widgets.prompt import PromptInput
from tui_util import wait_until


def test_device_defaults_to_auto():
    assert parser().parse_args([]).device == "auto"


def test_auto_device_is_cpu_without_a_gpu_and_cuda_with_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Options(model_dir(None)).device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert Options(model_dir(None)).device == "cuda"


def test_cuda_without_a_gpu_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elastic-chat: error: --device cuda:") and "use --device cpu" in err


def test_cpu_plans_for_this_machines_ram(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p, pick = plan(Options(model_dir(None)))
    assert p.profile.name == "auto" and "CPU" in pick.why and pick.budget is not None


@pytest.mark.anyio
@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks cuda on this machine")
async def test_the_loading_screen_opens_the_chat_on_the_cpu_by_default():
    app = ElasticChat(Options(model_dir(None)))
    async with app.run_test(size=(80, 24)) as pilot:
        # ready: the chat screen mounted and its input focused (leaving earlier tears the app down while the
        # screen's on_mount still queries its widgets)
        await wait_until(pilot, lambda: isinstance(app.screen, ChatScreen) and isinstance(app.focused, PromptInput),
                         timeout=120)
        assert app.model.device.type == "cpu"
