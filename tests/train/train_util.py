"""A tiny parent with a tokenizer, training text, and the command line of a short training run."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from tiny import ALIGNED, make_checkpoint, write_tokenizer

TEXT = ("the quick brown fox jumps over the lazy dog. then the answer is 42, they said! " * 4 + "\n") * 12
RECIPE = """
[train]
batch_size = 2
seq_len = 16
stage1_seq_len = 8
stage1_fraction = 0.5
lr = 1e-3
checkpoint_every = 2
"""


def make_parent(root: Path, **overrides) -> Path:
    make_checkpoint(root / "parent", seed=13, **{**ALIGNED, **overrides})
    write_tokenizer(root / "parent")
    (root / "data.txt").write_text(TEXT)
    (root / "recipe.toml").write_text(RECIPE)
    return root / "parent"


def train_args(root: Path, out: str, steps: int = 6, *extra: str) -> list[str]:
    return ["train", str(root / "parent"), str(root / out), "--data", str(root / "data.txt"),
            "--budget", "big=0.8", "--budget", "small=0.55", "--steps", str(steps),
            "--recipe", str(root / "recipe.toml"), "--seed", "3", *extra]


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(f).items()})
    return out
