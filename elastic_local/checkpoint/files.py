"""The tensors of a checkpoint directory: which file holds each one, its dtype and shape, read from the
safetensors headers alone (no data is touched until a tensor is read, and then only its slice)."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..model.schema import DTYPE_BYTES


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the tensor and says what to do."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    key: str  # name inside the file
    dtype: str  # safetensors dtype: BF16, F32, F8_E4M3, U8, ...
    shape: tuple[int, ...]
    row: int | None = None  # one entry of a stacked tensor (transformers stacks experts as [E, ...])

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for s in self.shape:
            n *= s
        return int(n)


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check the file holds every byte it promises."""
    size = file.stat().st_size
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{file}: not a safetensors file ({size} bytes); re-download or re-export it")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(f"{file}: truncated inside its header ({size} bytes, header needs {n + 8}); "
                                  "re-download or re-export it")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        last = max(header, key=lambda k: header[k]["data_offsets"][1])
        raise CheckpointError(f"{file}: truncated: its header needs {8 + n + end} bytes, the file has {size} "
                              f"(tensor {last!r} and maybe others are cut off); re-download or re-export it")
    return {k: TensorInfo(file, k, v["dtype"], tuple(v["shape"])) for k, v in header.items()}


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists {missing[0].name}, which is missing from {path}; "
                                  "download every shard")
        return files
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no model*.safetensors weights (a config-only directory can be planned "
                              "with `elastic-local fit`, not loaded)")
    return files


_PREFIX = re.compile(r"^(backbone|model)\.")


def canonical(name: str) -> str:
    """Hub names (`backbone.*`) and transformers' renamed layout (`model.*`) map to one set of names."""
    return _PREFIX.sub("", name)


def index_tensors(path: str | Path) -> dict[str, TensorInfo]:
    """Canonical tensor name -> where it lives, for every weight file of the directory."""
    out: dict[str, TensorInfo] = {}
    for file in weight_files(Path(path)):
        for key, info in read_header(file).items():
            name = canonical(key)
            if name in out:
                raise CheckpointError(f"tensor {key!r} appears in both {out[name].file.name} and {file.name}")
            out[name] = info
    return out


class Reader:
    """Reads slices of tensors from memory-mapped safetensors files, keeping each file open once."""

    def __init__(self, tensors: dict[str, TensorInfo]):
        self.tensors = tensors
        self._open: dict[Path, object] = {}

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def slice(self, name: str):
        info = self.tensors[name]
        f = self._open.get(info.file)
        if f is None:
            f = self._open[info.file] = safe_open(str(info.file), framework="pt")
        return f.get_slice(info.key)

    def read(self, name: str, *index) -> torch.Tensor:
        """Read `tensor[index]` where index items are ints (prefix lengths), slices, or index tensors (at most
        one). Index tensors are read as contiguous runs, so only the selected bytes leave the disk."""
        sl = self.slice(name)
        ix = [slice(0, i) if isinstance(i, int) else i for i in index]
        row = self.tensors[name].row
        if row is not None:
            return self._read(sl, [slice(row, row + 1), *ix])[0]
        return self._read(sl, ix)

    @staticmethod
    def _read(sl, ix: list) -> torch.Tensor:
        picked = [j for j, i in enumerate(ix) if isinstance(i, torch.Tensor)]
        if not picked:
            return sl[tuple(ix)]
        (dim,) = picked
        sel = ix[dim]
        uniq = torch.unique(sel)
        breaks = torch.nonzero(uniq[1:] != uniq[:-1] + 1).flatten() + 1
        parts = []
        for run in torch.tensor_split(uniq, breaks.tolist()):
            sub = list(ix)
            sub[dim] = slice(int(run[0]), int(run[-1]) + 1)
            parts.append(sl[tuple(sub)])
        got = torch.cat(parts, dim=dim)
        pos = torch.searchsorted(uniq, sel)
        return got.index_select(dim, pos)
