"""Writers (`nest`, `slice`, `quantize`): a process killed with SIGKILL at any moment leaves nothing under
OUT that loads as a half checkpoint and never touches the source; a rerun removes what the killed one
left and succeeds; an existing OUT is refused before the long work unless --overwrite; outputs get the
umask's modes."""

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import ALIGNED, make_checkpoint, write_tokenizer

import elastic_local
from elastic_local.cli import main
from elastic_local.elastic.nest import nest

# Runs one CLI command and SIGKILLs itself just before the Nth file-system step of the writer (a shard or
# JSON written, a rename, the mode fix-up, a removal): every moment at which the output can be half done.
DRIVER = r"""
import os, signal, sys
import elastic_local.checkpoint.write as w
kill_at, count = int(sys.argv[1]), [0]
def step(f):
    def g(*a, **k):
        count[0] += 1
        if count[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return f(*a, **k)
    return g
w.save_file = step(w.save_file)
w.publish_modes = step(w.publish_modes)
w.os.replace = step(w.os.replace)
w.shutil.rmtree = step(w.shutil.rmtree)
w.CheckpointWriter.write_json = step(w.CheckpointWriter.write_json)
from elastic_local.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("writers")
    make_checkpoint(root / "parent", seed=5, **ALIGNED)
    write_tokenizer(root / "parent")
    nest(root / "parent", root / "nested", {"half": 0.5})
    return root


def _digest(d: Path) -> dict[str, str]:
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*"))
            if f.is_file()}


def _killed_run(kill_at: int, argv: list[str]) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", DRIVER, str(kill_at), *argv], env=env,
                          capture_output=True, text=True, timeout=300).returncode


def _loads(path: Path) -> bool:
    try:
        elastic_local.load(path)
    except Exception:  # noqa: BLE001 - anything that fails to load is what is wanted here
        return False
    return True


def _partials(out: Path) -> list[Path]:
    return list(out.parent.glob(f".{out.name}.partial-*"))


def test_slice_killed_at_every_step_leaves_no_checkpoint_and_a_rerun_cleans_up(ckpts, tmp_path):
    src = ckpts / "nested"
    before = _digest(src)
    out = tmp_path / "out"
    argv = ["slice", str(src), str(out), "--budget", "half"]
    kill_at, killed = 1, 0
    while _killed_run(kill_at, argv) == -signal.SIGKILL:
        killed += 1
        assert not out.exists() or _digest(out) and _loads(out), f"killed before step {kill_at}: half an output"
        if out.exists():  # killed after the final rename (cleaning up): the output is whole
            break
        assert _partials(out), "a killed write leaves its partial directory (the rerun removes it)"
        assert main(argv) == 0 and _loads(out)
        assert not _partials(out), f"killed before step {kill_at}: the rerun left {_partials(out)}"
        assert _digest(src) == before
        import shutil

        shutil.rmtree(out)
        kill_at += 1
    assert killed >= 5  # shard, config, rename, modes, publish: every step was hit


def test_overwrite_killed_at_every_step_keeps_a_whole_output_or_none(ckpts, tmp_path):
    src, out = ckpts / "nested", tmp_path / "out"
    assert main(["slice", str(src), str(out), "--budget", "half"]) == 0
    old = _digest(out)
    argv = ["slice", str(src), str(out), "--budget", "full", "--overwrite"]
    kill_at = 1
    while _killed_run(kill_at, argv) == -signal.SIGKILL:
        if out.exists():
            assert _digest(out) == old or _loads(out)
            assert not (tmp_path / "out" / "previous").exists()
        kill_at += 1
    assert _loads(out) and _digest(out) != old and not _partials(out)


@pytest.mark.parametrize("command", ["nest", "quantize"])
def test_nest_and_quantize_killed_before_publishing_leave_nothing(ckpts, tmp_path, command):
    src = ckpts / ("parent" if command == "nest" else "nested")
    before = _digest(src)
    out = tmp_path / "out"
    extra = ["--budget", "half=0.5"] if command == "nest" else ["--precision", "fp8"]
    argv = [command, str(src), str(out), *extra]
    assert _killed_run(4, argv) == -signal.SIGKILL  # shard, config, rename, then killed before the mode fix-up
    assert not out.exists() and _partials(out) and _digest(src) == before
    assert main(argv) == 0 and _loads(out) and not _partials(out)


def test_an_existing_output_is_refused_before_the_long_work(ckpts, tmp_path, monkeypatch, capsys):
    import elastic_local.elastic.nest as nest_mod
    import elastic_local.ptq.quantize as quant_mod

    def slow(*a, **k):
        raise AssertionError("the long work started before the output was checked")

    monkeypatch.setattr(nest_mod, "load_network", slow)
    monkeypatch.setattr(quant_mod, "load_network", slow)
    out = tmp_path / "out"
    out.mkdir()
    for argv in (["nest", str(ckpts / "parent"), str(out), "--budget", "half=0.5"],
                 ["quantize", str(ckpts / "nested"), str(out), "--precision", "nvfp4"],
                 ["slice", str(ckpts / "nested"), str(out), "--budget", "half"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{out} already exists" in err and "--overwrite" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("where", ["same", "parent"])
def test_the_source_is_never_the_output_even_with_overwrite(ckpts, tmp_path, capsys, where):
    import shutil

    src = tmp_path / "m" / "nested"
    shutil.copytree(ckpts / "nested", src)
    before = _digest(src)
    out = src if where == "same" else src.parent
    assert main(["slice", str(src), str(out), "--budget", "half", "--overwrite"]) == 2
    assert "the source is never written" in capsys.readouterr().err
    assert _digest(src) == before


def test_outputs_are_readable_by_others_as_the_umask_allows(ckpts, tmp_path):
    old = os.umask(0o022)
    try:
        assert main(["slice", str(ckpts / "nested"), str(tmp_path / "out"), "--budget", "half"]) == 0
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert out.stat().st_mode & 0o777 == 0o755
    files = list(out.iterdir())
    assert files and all(f.stat().st_mode & 0o777 == 0o644 for f in files), \
        {f.name: oct(f.stat().st_mode & 0o777) for f in files}
