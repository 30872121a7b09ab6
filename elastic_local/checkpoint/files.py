"""The tensors of a checkpoint directory: which file holds each one, its dtype and shape, read from the
safetensors headers alone (no data is touched until a tensor is read, and then only its slice)."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from ..model.schema import DTYPE_BYTES

if TYPE_CHECKING:  # torch only where a tensor is read: `fit` and `info` plan from the headers alone
    import torch


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


def _header_entry(file: Path, key: str, v) -> TensorInfo:
    """One tensor of a safetensors header, checked: a known dtype, a shape, and offsets spanning its bytes."""
    bad = f"{file}: corrupt safetensors header: tensor {key!r}"
    if not isinstance(v, dict) or not {"dtype", "shape", "data_offsets"} <= set(v):
        raise CheckpointError(f"{bad} lacks dtype, shape or data_offsets; re-download or re-export the file")
    dtype, shape, offsets = v["dtype"], v["shape"], v["data_offsets"]
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{bad} has dtype {dtype!r}, which this runner does not read "
                              f"({', '.join(DTYPE_BYTES)}); re-export it")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{bad} has shape {shape!r} / data_offsets {offsets!r}; re-download or re-export it")
    info = TensorInfo(file, key, dtype, tuple(shape))
    if offsets[1] - offsets[0] != info.nbytes:
        raise CheckpointError(f"{bad} spans {offsets[1] - offsets[0]} bytes, but {dtype} {shape} needs "
                              f"{info.nbytes}; re-download or re-export the file")
    return info


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check the file holds every byte it promises."""
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing; download every weight file") from None
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
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: corrupt safetensors header ({e}); re-download or re-export it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object); re-download or re-export it")
    header.pop("__metadata__", None)
    out = {k: _header_entry(file, k, v) for k, v in header.items()}
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        last = max(header, key=lambda k: header[k]["data_offsets"][1])
        raise CheckpointError(f"{file}: truncated: its header needs {8 + n + end} bytes, the file has {size} "
                              f"(tensor {last!r} and maybe others are cut off); re-download or re-export it")
    return out


def read_index(index: Path) -> dict[str, str]:
    """The weight map (tensor name -> shard file name) of a model.safetensors.index.json, checked."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a valid index ({e}); re-download it, or delete it if the directory "
                              "holds a single model.safetensors") from None
    if not isinstance(weight_map, dict) or not weight_map or \
            not all(isinstance(f, str) and f for f in weight_map.values()):
        raise CheckpointError(f"{index}: its weight_map is missing, empty or not a name -> file map; re-download "
                              "it, or delete it if the directory holds a single model.safetensors")
    return weight_map


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in read_index(index).values()})
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
    """Canonical tensor name -> where it lives, for every weight file of the directory (an index's weight map
    must agree with the shards' headers)."""
    path = Path(path)
    out: dict[str, TensorInfo] = {}
    for file in weight_files(path):
        for key, info in read_header(file).items():
            name = canonical(key)
            if name in out:
                raise CheckpointError(f"tensor {key!r} appears in both {out[name].file.name} and {file.name}")
            out[name] = info
    index = path / "model.safetensors.index.json"
    if index.is_file():
        for key, file in read_index(index).items():
            info = out.get(canonical(key))
            if info is None:
                raise CheckpointError(f"{index} maps tensor {key!r} to {file}, which does not hold it; the index "
                                      "does not match the shards: re-download them")
            if info.file.name != file:
                raise CheckpointError(f"{index} maps tensor {key!r} to {file}, but it is in {info.file.name}; the "
                                      "index does not match the shards: re-download them")
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
        import torch

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


def unstack_experts(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """transformers' renamed layout stacks experts ([E, I, D]); view each expert as its own entry."""
    out = dict(tensors)
    for name, info in tensors.items():
        if name.endswith((".experts.up_proj", ".experts.down_proj")):
            del out[name]
            proj = name.rsplit(".", 1)[1]
            for j in range(info.shape[0]):
                out[f"{name.rsplit('.', 1)[0]}.{j}.{proj}.weight"] = TensorInfo(info.file, info.key, info.dtype,
                                                                                info.shape[1:], row=j)
    return out


def checkpoint_tensors(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint directory under its canonical hub name, one entry per expert."""
    return unstack_experts(index_tensors(path))
