"""Broken checkpoint files (tests/fuzz_files.py) against every command that reads one: each is a one-line
error naming the file and the tensor or field (exit 2), never a traceback, a hang or exit 0, and nothing
is written."""

import shutil

import pytest
from fuzz_files import CORRUPTIONS, sharded_ok
from tiny import ALIGNED, make_checkpoint, write_tokenizer

import elastic_local
from elastic_local.cli import main


def _argv(command: str, d, out) -> list[str]:
    return {"info": ["info", str(d)],
            "fit": ["fit", str(d), "--profile", "rtx5080"],
            "slice": ["slice", str(d), str(out), "--budget", "full"],
            "nest": ["nest", str(d), str(out), "--budget", "half=0.5"],
            "quantize": ["quantize", str(d), str(out), "--precision", "fp8"],
            "generate": ["generate", str(d), "--prompt", "hi", "--max-tokens", "2", "--max-think-tokens", "2"]}[command]


COMMANDS = ["info", "fit", "slice", "nest", "quantize", "generate"]


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
            made[name] = d, CORRUPTIONS[name](d)
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
