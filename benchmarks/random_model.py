"""A random-weight Nemotron-H parent checkpoint written straight from a config (no transformers needed),
shared by the benchmarks that nest one: weights at scales where every block matters."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_random_parent(parent: Path, config: dict, seed: int) -> None:
    from elastic_local.model.budget import Budget
    from elastic_local.model.config import NemotronHConfig
    from elastic_local.model.schema import expected_shapes

    parent.mkdir(parents=True)
    (parent / "config.json").write_text(json.dumps(config, indent=2))
    cfg = NemotronHConfig.from_dir(parent)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(cfg, Budget.full(cfg)).items():
        if name.endswith("A_log"):
            t = torch.log(torch.empty(shape).uniform_(1, 8, generator=g))
        elif name.endswith("dt_bias"):
            t = torch.empty(shape).uniform_(-3, 0.5, generator=g)
        elif "norm" in name or name.endswith(".D"):
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        tensors[("" if name == "lm_head.weight" else "backbone.") + name] = t
    save_file(tensors, parent / "model.safetensors", metadata={"format": "pt"})
