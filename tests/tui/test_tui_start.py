"""Starting elastic-chat: the device defaults to auto as in every elastic-local command (cuda when torch sees
a GPU, cpu otherwise), the fit planner plans for that device, and the loading screen opens the chat, or
closes the app with a one-line error."""

from __future__ import annotations

import pytest
import torch
from elastic_local.tui.app import ElasticChat
from elastic_local.tui.cli import main, parser
from elastic_local.tui.screens.chat import ChatScreen
from elastic_local.tui.start import Options, load, model_dir, plan
from elastic_local.tui.widgets.prompt import PromptInput
from textual.app import App
from tui_util import wait_until

from elastic_local.hardware import fit


def test_device_defaults_to_auto():
    assert parser().parse_args([]).device == "auto"


def test_plan_resolves_auto_to_cpu_without_a_gpu_and_cuda_with_one(monkeypatch):
    """The device is resolved on the loading screen's worker (`plan`), where torch imports, not before."""
    seen = []
    cpu = fit.live_profile("cpu")
    monkeypatch.setattr(fit, "live_profile", lambda device: seen.append(device) or cpu)
    without, with_one = Options(model_dir(None)), Options(model_dir(None))
    assert without.device == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan(without)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan(with_one)
    assert (without.device, with_one.device) == ("cpu", "cuda") and seen == ["cpu", "cuda"]


def _headless(monkeypatch) -> list[ElasticChat]:
    """`main` runs its app headless (the test has no terminal); the apps it ran."""
    apps = []

    def run(self):
        apps.append(self)
        return App.run(self, headless=True, size=(80, 24))

    monkeypatch.setattr(ElasticChat, "run", run)
    return apps


def test_cuda_without_a_gpu_is_a_one_line_error_from_the_loading_screen(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    apps = _headless(monkeypatch)
    assert main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elastic-chat: error: --device cuda:") and "use --device cpu" in err
    assert len(err.strip().splitlines()) == 1 and apps[0].session is None  # no chat opened


def test_cpu_plans_for_this_machines_ram(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p, pick = plan(Options(model_dir(None)))
    assert p.profile.name == "auto" and "CPU" in pick.why and pick.budget is not None


def test_activations_nvfp4_reach_the_loader(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = parser().parse_args(["--precision", "nvfp4", "--activations", "nvfp4"])
    o = Options(model_dir(None), precision=args.precision, activations=args.activations)
    pick = plan(o)[1]
    assert "precision nvfp4, inputs rounded to NVFP4 (W4A4)" in pick.line  # the load screen says so
    m = load(o, pick)
    assert all(layer.mixer.in_proj.quantize_inputs for layer in m.net.layers if layer.kind == "M")
    assert parser().parse_args([]).activations == "float"


def test_cpu_computes_in_float32_where_it_fits_else_bfloat16(monkeypatch):
    """The plan assumes bf16; a CPU decodes several times faster in float32 (its C step), which doubles the
    caches, the activations and the high-precision weights (not a BF16 file's Linear ones where the C
    kernels run: they stay bf16). The pick loads float32 only where that fits."""
    import dataclasses

    from elastic_local.hardware.fit import plan_checkpoint

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    o = Options(model_dir(None))
    roomy = fit.live_profile("cpu")
    _, pick = plan(o)
    assert pick.dtype == torch.float32 and "float32 compute" in pick.line
    wide = next(c for c in plan_checkpoint(o.dir, roomy, context=o.context, float32=True).candidates
                if (c.budget, c.precision) == (pick.budget, pick.precision))
    assert f"memory {wide.total_bytes / 2**30:.2f} of" in pick.line

    def fits(memory: int, float32: bool) -> bool:
        tight = dataclasses.replace(roomy, memory_bytes=memory, reserved_bytes=0)
        p = plan_checkpoint(o.dir, tight, context=o.context, float32=float32)
        return any(c.fits and (c.budget, c.precision) == (pick.budget, pick.precision) for c in p.candidates)

    lo, hi = 0, wide.total_bytes  # the least memory bf16 fits in: float32 does not
    while hi - lo > 2**16:
        lo, hi = (lo, (lo + hi) // 2) if fits((lo + hi) // 2, False) else ((lo + hi) // 2, hi)
    memory = hi
    assert fits(memory, False) and not fits(memory, True)
    monkeypatch.setattr(fit, "live_profile", lambda device: dataclasses.replace(
        roomy, memory_bytes=memory, reserved_bytes=0))
    _, tight = plan(o)
    assert (tight.budget, tight.precision, tight.dtype) == (pick.budget, pick.precision, torch.bfloat16)
    assert "bfloat16 compute" in tight.line


@pytest.mark.anyio
@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks cuda on this machine")
async def test_the_loading_screen_opens_the_chat_on_the_cpu_by_default():
    app = ElasticChat(Options(model_dir(None)))
    async with app.run_test(size=(80, 24)) as pilot:
        # ready: the chat screen mounted and its input focused (leaving earlier tears the app down while the
        # screen's on_mount still queries its widgets)
        await wait_until(pilot, lambda: isinstance(app.screen, ChatScreen) and isinstance(app.focused, PromptInput),
                         timeout=120)
        assert app.model.device.type == "cpu" and app.model.dtype == torch.float32


def test_a_bug_on_the_loading_screen_is_an_internal_error_with_its_traceback_in_a_file(monkeypatch, capsys, tmp_path):
    from elastic_local.tui.screens import load

    def broken(options):
        raise RuntimeError("a planner bug")

    monkeypatch.setenv("ELASTIC_LOCAL_HOME", str(tmp_path))  # its logs/ takes the traceback, its data the history
    monkeypatch.setattr(load, "plan", broken)
    apps = _headless(monkeypatch)
    assert main([]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("elastic-chat: internal error") and "RuntimeError: a planner bug" in err
    assert "traceback in" in err and apps[0].session is None


def test_sampling_flags_reach_the_chat_and_a_bad_one_is_a_one_line_error(monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(ElasticChat, "run", lambda self: seen.update(self.session_options))
    assert main(["--temperature", "0.7", "--top-k", "40", "--top-p", "0.9", "--min-p", "0.05", "--seed", "3"]) == 0
    assert {k: seen[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed")} == \
        dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=3)
    apps = _headless(monkeypatch)
    assert main(["--top-p", "0"]) == 2
    err = capsys.readouterr().err
    assert "top_p=0.0 must be in (0, 1]" in err and len(err.strip().splitlines()) == 1
    assert apps[0].session is None and apps[0].model is None  # refused before the load


def test_sample_commands_parse_and_say_how_to_write_them():
    from elastic_local.tui.commands import CommandError, parse

    assert parse("/sample temperature=0.7 top_k=40 seed=3").sampling == {"temperature": 0.7, "top_k": 40, "seed": 3}
    assert parse("/sample off").sampling == {"temperature": 0.0}
    assert parse("/sample seed=none").sampling == {"seed": None}
    for bad in ("/sample", "/sample heat=2", "/sample top_p=", "/sample top_k=1.5"):
        with pytest.raises(CommandError, match="/sample temperature=T"):
            parse(bad)
