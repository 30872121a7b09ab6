"""Writing checkpoint directories: sharded safetensors, written tensor by tensor, published atomically.

Tensors go to numbered shards as they come (a shard is flushed once it reaches `max_shard_bytes`), so
a writer never holds more than one shard in memory. Everything is written into a hidden sibling
directory (`.OUT.partial-PID-*`) that is renamed to its final name only when complete: a process killed
at any moment leaves no half checkpoint under OUT, and the next writer of OUT removes the partial
directories whose process is gone. Outputs get the modes the umask allows (others can read a shared
model); an existing output is replaced only with `overwrite`, and never when it is (or holds) a source.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)

CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                 "chat_template.jinja")


def check_output(out: str | Path, overwrite: bool = False, sources: Iterable[str | Path] = ()) -> Path:
    """Refuse an output that exists (unless `overwrite`) or that is, or contains, a source directory: call
    it before any long work, so a run does not score or calibrate for an hour and then stop."""
    out = Path(out)
    target = out.resolve()
    for src in sources:
        s = Path(src).resolve()
        if target == s or target in s.parents:
            raise ValueError(f"output {out} is the source {src} (or holds it); the source is never written: "
                             "choose another output directory")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another output, remove it, or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory; choose another output")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def remove_stale_partials(out: Path) -> list[Path]:
    """Delete the `.OUT.partial-*` directories that writers killed before finishing left beside `out`
    (those whose process is gone; a live writer's directory, this process's included, is left alone)."""
    removed = []
    if not out.parent.is_dir():
        return removed
    for d in out.parent.glob(f".{out.name}.partial-*"):
        pid = d.name[len(f".{out.name}.partial-"):].split("-")[0]
        if d.is_dir() and not (pid.isdigit() and (int(pid) == os.getpid() or _alive(int(pid)))):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            log.warning("removed %s, left by an interrupted write of %s", d, out)
    return removed


def _umask() -> int:
    """The process's umask, read without changing it where the system allows (os.umask sets it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_modes(root: Path) -> None:
    """Give `root` and everything in it the modes the umask allows (safetensors and mkdtemp make 0600 / 0700
    files and directories that only their owner can read)."""
    mask = _umask()
    for d, _, files in os.walk(root):
        os.chmod(d, 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(d, f), 0o666 & ~mask)


class CheckpointWriter:
    def __init__(self, out: str | Path, max_shard_bytes: int = 4 << 30, overwrite: bool = False,
                 sources: Iterable[str | Path] = ()):
        self.out = check_output(out, overwrite, sources)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(self.out)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-{os.getpid()}-", dir=self.out.parent))
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in s for s in self._shards):
            raise ValueError(f"tensor {name!r} written twice")
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += tensor.nbytes
        self.total_bytes += tensor.nbytes
        if self._pending_bytes >= self.max_shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        save_file(self._pending, self.tmp / f"shard-{len(self._shards):05d}.safetensors", metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def write_json(self, name: str, obj: dict) -> None:
        (self.tmp / name).write_text(json.dumps(obj, indent=2) + "\n")

    def carry(self, src: Path, names: tuple[str, ...] = CARRIED_FILES) -> None:
        """Copy the tokenizer and generation files that exist in `src`."""
        for name in names:
            if (src / name).is_file():
                shutil.copy2(src / name, self.tmp / name)

    def close(self) -> Path:
        """Name the shards, write the index, and move the finished directory into place."""
        self._flush()
        n = len(self._shards)
        if n == 1:
            os.replace(self.tmp / "shard-00000.safetensors", self.tmp / "model.safetensors")
        else:
            weight_map = {}
            for k, names in enumerate(self._shards):
                final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
                os.replace(self.tmp / f"shard-{k:05d}.safetensors", self.tmp / final)
                weight_map.update(dict.fromkeys(names, final))
            self.write_json("model.safetensors.index.json",
                            {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map})
        publish_modes(self.tmp)
        old = None
        if self.out.exists():  # --overwrite: move the old output aside first, so no moment has half of each
            old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-{os.getpid()}-old-", dir=self.out.parent))
            os.replace(self.out, old / "previous")
        os.replace(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
