"""Writing the trained network as a nested checkpoint: today's format, plus the router.

The weights go back to the hub layout in the parent's own dtypes; config.json is the parent's with an
`elastic` table whose budgets are the router's hard choices (per-layer sizes when heterogeneous);
`router.safetensors` + `router.json` let `elastic-local budget` add an unseen budget later.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..checkpoint.files import canonical, checkpoint_tensors
from ..checkpoint.write import CheckpointWriter
from ..elastic.table import FORMAT_VERSION, budget_entry, check_alignment, read_budgets
from ..model.budget import Budget
from ..model.config import NemotronHConfig
from ..model.nemotron_h import NemotronH
from .router import Router
from .weights import hub_tensors

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def stored_dtypes(path: Path) -> dict[str, torch.dtype]:
    """Canonical tensor name -> the dtype the checkpoint stores it in."""
    return {name: DTYPES.get(info.dtype, torch.bfloat16) for name, info in checkpoint_tensors(path).items()}


def elastic_table(cfg: NemotronHConfig, router: Router, budgets: list[Budget], training: dict) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "axes": list(router.axes),
        "heterogeneous": router.heterogeneous,
        "router": {"weights": "router.safetensors", "config": "router.json"},
        "training": training,
        "budgets": [budget_entry(cfg, b) for b in budgets],
    }


def write_trained(net: NemotronH, parent: Path, out: Path, router: Router, budgets: list[Budget], training: dict,
                  overwrite: bool = False) -> Path:
    """`budgets`: full first, then the trained ones largest first."""
    cfg = net.cfg
    for b in budgets:
        check_alignment(cfg, b)
    dtypes = stored_dtypes(parent)
    config = {k: v for k, v in cfg.raw.items() if k not in ("elastic", "quantization_config")}
    config["elastic"] = elastic_table(cfg, router, budgets, training)
    importance = parent / "importance.safetensors"  # same order: training keeps the permutation
    if importance.is_file():
        config["elastic"]["importance_file"] = importance.name
    with CheckpointWriter(out, overwrite=overwrite) as w:
        for name, t in hub_tensors(net):
            w.add(name, t.to("cpu", dtypes.get(canonical(name), t.dtype)))
        w.write_json("config.json", config)
        w.carry(parent)
        if importance.is_file():
            shutil.copy2(importance, w.tmp / importance.name)
        router.save(w.tmp)
        out = w.close()
    read_budgets(NemotronHConfig.from_dir(out), where=str(out / "config.json"))  # the table reads back nested
    return out


def add_budget(directory: str | Path, name: str, fraction: float) -> Budget:
    """Map an unseen budget through the stored router and add it to the checkpoint's table, nested between
    its neighbours; config.json is replaced atomically."""
    directory = Path(directory)
    cfg = NemotronHConfig.from_dir(directory)
    table = read_budgets(cfg, where=str(directory / "config.json"))
    if name in table:
        raise ValueError(f"{directory} already has a budget named {name!r}; pick another name")
    router = Router.load(directory, cfg)
    ranked = list(table.values())  # largest first
    full_params = budget_entry(cfg, ranked[0])["params"]
    target = fraction * full_params
    within = next((b for b in reversed(ranked) if budget_entry(cfg, b)["params"] > target), None)
    above = next((b for b in ranked if budget_entry(cfg, b)["params"] < target), None)
    b = router.budget(name, fraction, within=within, above=above)
    check_alignment(cfg, b)
    raw = json.loads((directory / "config.json").read_text())
    raw["elastic"]["budgets"].append(budget_entry(cfg, b))
    raw["elastic"]["budgets"].sort(key=lambda e: -e["params"])
    tmp = directory / ".config.json.tmp"
    tmp.write_text(json.dumps(raw, indent=2) + "\n")
    tmp.replace(directory / "config.json")
    return b
