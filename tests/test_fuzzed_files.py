"""Broken checkpoint files (tests/fuzz_files.py) against every command that reads one: each is a one-line
error naming the file and the tensor or field (exit 2), never a traceback, a hang or exit 0, and nothing
is written."""

import shutil

import pytest
import torch
from fuzz_files import CORRUPTIONS, TOKENIZER_CORRUPTIONS, sharded_ok
from tiny import ALIGNED, make_checkpoint, write_tokenizer

import elastic_local
from elastic_local.cli import main


def _argv(command: str, d, out) -> list[str]:
    if command == "batch":
        (d.parent / "prompts.txt").write_text("hi\n")
    return {"info": ["info", str(d)],
            "fit": ["fit", str(d), "--profile", "rtx5080"],
            "slice": ["slice", str(d), str(out), "--budget", "full"],
            "nest": ["nest", str(d), str(out), "--budget", "half=0.5"],
            "quantize": ["quantize", str(d), str(out), "--precision", "fp8"],
            "generate": ["generate", str(d), "--prompt", "hi", "--max-tokens", "2", "--max-think-tokens", "2"],
            "batch": ["batch", str(d.parent / "prompts.txt"), str(out), str(d)]}[command]


COMMANDS = ["info", "fit", "slice", "nest", "quantize", "generate", "batch"]



@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz") / "good"
    make_checkpoint(d, seed=2, **ALIGNED)
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def broken(good):
    """corruption name -> (directory, the text its error must name); made once per module."""
    made = {}

    def get(name):
        if name not in made:
            d = good.parent / name
            shutil.copytree(good, d)
            made[name] = d, {**CORRUPTIONS, **TOKENIZER_CORRUPTIONS}[name](d)
        return made[name]

    return get


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_broken_checkpoint_is_a_one_line_error_naming_the_file_and_tensor(broken, tmp_path, capsys, monkeypatch,
                                                                            corruption, command):
    monkeypatch.setenv("ELASTIC_LOCAL_HOME", str(tmp_path / "home"))
    d, names = broken(corruption)
    out = tmp_path / "out"
    assert main(_argv(command, d, out)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("elastic-local:")]
    assert len(lines) == 1 and lines[0] == err.strip().splitlines()[-1], err
    assert "Traceback" not in err and "internal error" not in err
    assert str(d) in lines[0] and names in lines[0], lines[0]
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_load_raises_a_value_error_naming_the_file_and_tensor(broken, corruption):
    d, names = broken(corruption)
    with pytest.raises(ValueError) as e:
        elastic_local.load(d)
    assert str(d) in str(e.value) and names in str(e.value)


def test_a_sharded_checkpoint_with_a_consistent_index_loads(good, tmp_path):
    d = tmp_path / "sharded"
    shutil.copytree(good, d)
    sharded_ok(d)
    assert main(["info", str(d)]) == 0
    assert elastic_local.load(d).budgets == ["full"]


@pytest.mark.parametrize("precision, tensor, dtype", [("nvfp4", "weight_scale", torch.float32),
                                                      ("nvfp4", "weight", torch.int8),
                                                      ("fp8", "weight", torch.bfloat16)])
def test_a_quantized_tensor_of_the_wrong_dtype_is_named(good, tmp_path, capsys, precision, tensor, dtype):
    from safetensors.torch import load_file, save_file

    d = tmp_path / precision
    assert main(["quantize", str(good), str(d), "--precision", precision]) == 0
    capsys.readouterr()
    name = f"backbone.layers.0.mixer.in_proj.{tensor}"
    tensors = load_file(d / "model.safetensors")
    tensors[name] = tensors[name].view(torch.uint8).to(dtype) if tensor == "weight" else tensors[name].to(dtype)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    for argv in (["info", str(d)], ["slice", str(d), str(tmp_path / "out"), "--budget", "full"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert name in err and "is stored as" in err and len(err.splitlines()) == 1, err
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        elastic_local.load(d)


@pytest.mark.parametrize("corruption", list(TOKENIZER_CORRUPTIONS))
def test_a_broken_tokenizer_or_generation_config_is_named(broken, tmp_path, capsys, monkeypatch, corruption):
    monkeypatch.setenv("ELASTIC_LOCAL_HOME", str(tmp_path / "home"))
    d, names = broken(corruption)
    assert main(_argv("generate", d, None)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(d / names) in err and "internal" not in err, err
    with pytest.raises(ValueError, match=names):  # at load (tokenizer files) or at the first generation
        m = elastic_local.load(d)
        m.generate(m.chat_prompt("hi"), max_think_tokens=1, max_answer_tokens=1)
