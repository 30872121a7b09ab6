"""`elastic_local.load`: a checkpoint directory in, an ElasticModel out."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.load import Progress, load_network, stored_budget
from ..elastic.table import read_budgets
from ..model.config import NemotronHConfig
from .elastic_model import ElasticModel


def load(path: str | Path, budget: str | None = None, precision: str | None = None, device: str = "cpu",
         dtype: torch.dtype = torch.float32, progress: Progress | None = None) -> ElasticModel:
    """Load a Nemotron-H (or nested elastic) checkpoint directory. `budget` makes only that budget
    resident and reads only its slices from disk; every budget up to it then runs as views.
    `precision` None keeps the stored precision."""
    if precision not in (None, "bf16"):
        raise NotImplementedError(f"precision {precision!r}: quantized loading is not available yet")
    path = Path(path)
    cfg = NemotronHConfig.from_dir(path)
    stored = stored_budget(cfg)
    budgets = read_budgets(cfg, where=str(path / "config.json")) if cfg.raw.get("elastic") else {"full": stored}
    if budget is not None and budget not in budgets:
        raise KeyError(f"unknown budget {budget!r}; {path} has {list(budgets)}")
    resident = budgets[budget] if budget is not None else next(iter(budgets.values()))
    net = load_network(path, resident=resident, stored=stored, dtype=dtype, device=device, progress=progress)
    return ElasticModel(net, {k: b for k, b in budgets.items() if b.fits_in(resident)}, path)
