"""Writing checkpoint directories: sharded safetensors, written tensor by tensor, published atomically.

Tensors go to numbered shards as they come (a shard is flushed once it reaches `max_shard_bytes`), so
a writer never holds more than one shard in memory. Everything is written into a temporary sibling
directory that is renamed to its final name only when complete: a crash leaves no half checkpoint
that looks whole.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                 "chat_template.jinja")


class CheckpointWriter:
    def __init__(self, out: str | Path, max_shard_bytes: int = 4 << 30, overwrite: bool = False):
        self.out = Path(out)
        if self.out.exists() and not overwrite:
            raise FileExistsError(f"{self.out} already exists; choose another output or remove it")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))
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
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
