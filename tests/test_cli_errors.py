"""The CLI's error path: an expected error is one line saying what to do (exit 2); a bug is reported as an
internal error naming the file that holds its traceback (exit 1), and `--debug` prints the traceback."""

import pytest

from elastic_local import cli
from elastic_local.errors import is_expected


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_LOCAL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ELASTIC_LOCAL_DEBUG", raising=False)
    return tmp_path / "home"


def _failing(monkeypatch, exc: BaseException) -> None:
    def boom(args):
        raise exc

    monkeypatch.setattr(cli, "cmd_paths", boom)


def test_a_bare_key_error_is_an_internal_error_with_its_traceback_in_a_file(home, monkeypatch, capsys):
    _failing(monkeypatch, KeyError("mamba_heads"))
    assert cli.main(["paths"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "internal error" in err and "KeyError: 'mamba_heads'" in err and "--debug" in err
    logs = list((home / "logs").glob("elastic-local-crash-*.txt"))
    assert len(logs) == 1 and str(logs[0]) in err
    assert "Traceback" in logs[0].read_text() and "boom" in logs[0].read_text()


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_prints_the_traceback(home, monkeypatch, capsys, where):
    _failing(monkeypatch, KeyError("mamba_heads"))
    argv = ["--debug", "paths"] if where == "before" else ["paths", "--debug"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "internal error" in err.splitlines()[-1]
    assert not (home / "logs").exists()


@pytest.mark.parametrize("exc", [KeyError("unknown budget 'x'; ckpt has ['full']"), ValueError("--budget: bad"),
                                 FileNotFoundError(2, "No such file or directory", "/nowhere/config.json")])
def test_an_expected_error_is_one_line_and_exit_2(home, monkeypatch, capsys, exc):
    _failing(monkeypatch, exc)
    assert cli.main(["paths"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("elastic-local: error: ")
    assert "internal" not in err and "Traceback" not in err and "Errno" not in err


def test_ctrl_c_exits_130_without_a_traceback(home, monkeypatch, capsys):
    _failing(monkeypatch, KeyboardInterrupt())
    assert cli.main(["paths"]) == 130
    assert capsys.readouterr().err.strip() == "elastic-local: interrupted"


def test_parser_fragments_are_not_passed_off_as_expected_errors():
    import json

    with pytest.raises(json.JSONDecodeError) as e:
        json.loads("{")
    assert not is_expected(e.value)
    assert not is_expected(RuntimeError("shape mismatch")) and not is_expected(IndexError("3"))
