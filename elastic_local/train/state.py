"""Training state on disk: written atomically every N steps, read back to resume.

A state is a directory `step-NNNNNNNN/` with `tensors.safetensors` (weights, router, optimizer moments)
and `state.json` (step, optimizer hyper-parameters, running figures). It is written under a temporary
name and renamed into place, then `latest` is replaced (also by rename) to point at it: a `kill -9` at
any moment leaves either the previous state or the new one, never half of one. No pickle.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def optimizer_tensors(opt: torch.optim.Optimizer, prefix: str) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer's state as flat named tensors plus its JSON-able parameter groups."""
    sd = opt.state_dict()
    tensors = {f"{prefix}.{i}.{k}": v.detach().cpu().contiguous()
               for i, st in sd["state"].items() for k, v in st.items()}
    return tensors, {"param_groups": sd["param_groups"]}


def load_optimizer(opt: torch.optim.Optimizer, prefix: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for name, t in tensors.items():
        if name.startswith(prefix + "."):
            i, k = name[len(prefix) + 1:].split(".", 1)
            state.setdefault(int(i), {})[k] = t
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_state(directory: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict, keep: int = 2) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".step-partial-", dir=directory))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp / "tensors.safetensors")
    (tmp / "state.json").write_text(json.dumps({"step": step, **meta}, indent=1) + "\n")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    final = directory / f"step-{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = directory / ".latest.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, directory / "latest")
    for old in sorted(directory.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in directory.glob(".step-partial-*"):  # left by a killed writer
        shutil.rmtree(stale, ignore_errors=True)
    return final


def load_state(directory: Path) -> tuple[dict[str, torch.Tensor], dict] | None:
    """(tensors, meta) of the latest complete state, or None when there is none."""
    pointer = directory / "latest"
    if not pointer.is_file():
        return None
    final = directory / pointer.read_text().strip()
    if not (final / "state.json").is_file():
        raise ValueError(f"{pointer} names {final.name}, which is incomplete; remove {directory} to start over")
    return load_file(final / "tensors.safetensors"), json.loads((final / "state.json").read_text())
