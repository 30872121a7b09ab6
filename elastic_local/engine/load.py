"""`elastic_local.load`: a checkpoint directory in, an ElasticModel out."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.load import Progress, load_network, stored_budget
from ..elastic.table import read_budgets
from ..model.config import NemotronHConfig
from .elastic_model import ElasticModel
from .tokenizer import Tokenizer


def load(path: str | Path, budget: str | None = None, precision: str | None = None, device: str = "cpu",
         dtype: torch.dtype = torch.float32, progress: Progress | None = None,
         keep: tuple[str, ...] = ()) -> ElasticModel:
    """Load a Nemotron-H (or nested elastic) checkpoint directory. `budget` makes only that budget
    resident and reads only its slices from disk; every budget up to it then runs as views.
    `precision`: None keeps what the file stores; "fp8" / "nvfp4" from a BF16 file quantize while loading
    (`keep`: module patterns left in high precision); "bf16" from a quantized file dequantizes."""
    path = Path(path)
    cfg = NemotronHConfig.from_dir(path)
    stored = stored_budget(cfg)
    budgets = read_budgets(cfg, where=str(path / "config.json")) if cfg.raw.get("elastic") else {"full": stored}
    if budget is not None and budget not in budgets:
        raise KeyError(f"unknown budget {budget!r}; {path} has {list(budgets)}")
    resident = budgets[budget] if budget is not None else next(iter(budgets.values()))
    net = load_network(path, resident=resident, stored=stored, dtype=dtype, device=device, progress=progress,
                       precision=precision, keep=keep)
    return ElasticModel(net, {k: b for k, b in budgets.items() if b.fits_in(resident)}, path, Tokenizer.from_dir(path))
