"""The command line's shared parts: every command's help has an example, the model options reach `load`."""

import argparse
import subprocess
import sys

import pytest
import torch
from tiny import ALIGNED, make_checkpoint, write_tokenizer

from elastic_local.cli import add_model_options, build_parser, load_from_args, main
from elastic_local.quant import FP8Weight


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_command_has_help_and_an_example():
    commands = _subcommands()
    assert {"info", "fit", "generate", "nest", "slice", "quantize", "profiles", "paths"} <= set(commands)
    for name, p in commands.items():
        text = p.format_help()
        assert p.description and f"elastic-local {name}" in text, f"{name}: no help text with an example"


def test_the_top_level_help_starts_a_user_off_not_a_reader_of_the_code():
    text = build_parser().format_help()
    for start in ("elastic-local fit", "elastic-local generate", "elastic-chat", "elastic-local batch"):
        assert start in text
    assert "COMMAND_MODULES" not in text and "add_model_options" not in text


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout
    return set(out.splitlines()[-1].split())


def test_help_paths_and_profiles_run_without_importing_torch():
    """torch takes seconds to import: the commands that need no model should not wait for it, nor should
    `elastic-chat --help` or a mistyped flag."""
    held = _modules_after("import elastic_local.cli as c; c.build_parser(); c.main(['paths']); c.main(['profiles'])\n"
                          "from elastic_local.tui import app, cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n"
                          "    pass")
    assert "torch" not in held  # nor does the chat app's module: its loading screen shows first
    assert {"elastic_local.cli", "elastic_local.hardware.profiles", "elastic_local.tui.app"} <= held


def test_fit_for_a_named_machine_plans_from_the_headers_without_torch():
    """`fit --profile` on a checkpoint (here the 30B description) reads config and headers only: it took 2.5-3 s
    while it imported torch, 0.4 s since. (`fit` for this machine probes torch about CUDA, so it waits.)"""
    held = _modules_after("import elastic_local.cli as c\nassert c.main(['fit', '--profile', 'rtx5080']) == 0\n"
                          "assert c.main(['fit', '--profile', 'rtx5080', '--json']) == 0")
    assert "torch" not in held
    assert {"elastic_local.hardware.fit", "elastic_local.checkpoint.verify", "elastic_local.quant.scheme"} <= held


def test_a_load_and_a_reply_import_no_sympy():
    """torch's symbolic shapes pull in sympy (half a second of every launch); only a compiled step needs them."""
    held = _modules_after("import elastic_local; m = elastic_local.load(); list(m.stream(m.chat_prompt('2 + 2?'), "
                          "max_answer_tokens=2))")
    assert "torch" in held and "sympy" not in held


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    add_model_options(p)
    return p.parse_args(list(argv))


def test_model_options_reach_the_loader(tmp_path):
    make_checkpoint(tmp_path, seed=3)
    write_tokenizer(tmp_path)
    m = load_from_args(_args(str(tmp_path), "--device", "cpu", "--dtype", "bfloat16", "--precision", "fp8"))
    assert m.net.embed.dtype == torch.bfloat16
    assert any(isinstance(layer.mixer.in_proj, FP8Weight) for layer in m.net.layers if layer.kind == "M")
    plain = load_from_args(_args(str(tmp_path)))  # defaults on a CPU: float32, as stored, the largest budget
    assert plain.net.embed.dtype == torch.float32 and plain.budgets == ["full"]
    make_checkpoint(tmp_path / "aligned", seed=3, **ALIGNED)  # NVFP4 cuts inputs in blocks of 16
    w4a4 = load_from_args(_args(str(tmp_path / "aligned"), "--precision", "nvfp4", "--activations", "nvfp4"))
    assert all(layer.mixer.in_proj.quantize_inputs for layer in w4a4.net.layers if layer.kind == "M")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gives")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path, capsys):
    make_checkpoint(tmp_path, seed=3)
    write_tokenizer(tmp_path)
    assert main(["generate", str(tmp_path), "--prompt", "x", "--device", "cuda"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err


def test_offline_tools_take_the_gpu_only_when_the_float32_parent_fits(tmp_path, monkeypatch, capsys):
    from elastic_local.cli import offline_device

    make_checkpoint(tmp_path, seed=3)
    params = sum(p.numel() for p in make_checkpoint(tmp_path / "again", seed=3).parameters())
    assert offline_device("auto", str(tmp_path)) == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (int(4 * params * 1.25), 0))
    assert offline_device("auto", str(tmp_path)) == "cuda"
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (4 * params, 0))  # no room for activations
    assert offline_device("auto", str(tmp_path)) == "cpu"
    assert "in float32 takes" in capsys.readouterr().err
    assert offline_device("cpu", str(tmp_path)) == "cpu"
    for name in ("nest", "quantize", "train"):
        assert _subcommands()[name].get_default("device") == "auto"


def test_every_command_that_runs_a_model_shares_the_model_options():
    commands = _subcommands()
    for name in ("generate", "batch"):
        opts = {a.dest: a.default for a in commands[name]._actions}
        assert {"device": "auto", "dtype": "auto", "precision": None, "budget": None}.items() <= opts.items(), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gives")
def test_batch_on_cuda_without_a_gpu_is_a_clear_error(tmp_path, capsys):
    make_checkpoint(tmp_path, seed=3)
    write_tokenizer(tmp_path)
    (tmp_path / "in.txt").write_text("hello\n")
    assert main(["batch", str(tmp_path / "in.txt"), str(tmp_path / "out.jsonl"), str(tmp_path),
                 "--device", "cuda"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err
