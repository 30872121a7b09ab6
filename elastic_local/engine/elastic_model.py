"""ElasticModel: one resident network and the budgets it can run, the object `elastic_local.load` returns."""

from __future__ import annotations

from pathlib import Path

import torch

from ..model.budget import Budget
from ..model.config import NemotronHConfig
from ..model.nemotron_h import HybridCache, NemotronH


class ElasticModel:
    def __init__(self, net: NemotronH, budgets: dict[str, Budget], path: Path | None = None):
        self.net, self.path = net, path
        self._budgets = budgets  # every budget the resident weights can run, largest first

    @property
    def config(self) -> NemotronHConfig:
        return self.net.cfg

    @property
    def budgets(self) -> list[str]:
        """Budget names that run on the resident weights, largest first."""
        return list(self._budgets)

    def budget(self, name: str | None = None) -> Budget:
        if name is None:
            return self.net.resident
        if name not in self._budgets:
            raise KeyError(f"unknown budget {name!r}; this model runs {self.budgets}")
        return self._budgets[name]

    def new_cache(self, batch_size: int = 1, budget: str | None = None) -> HybridCache:
        return self.net.new_cache(batch_size, self.budget(budget))

    def forward(self, input_ids: torch.Tensor, cache: HybridCache | None = None, budget: str | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Logits [B, T or 1, vocab] (float32); with a cache, continues and advances it (its budget runs)."""
        b = cache.budget if cache is not None else self.budget(budget)
        return self.net.forward(input_ids.to(self.net.device), b, cache, last_only)

    def logits(self, input_ids: torch.Tensor, budget: str | None = None) -> torch.Tensor:
        """Logits of a whole sequence from scratch: LongTensor [B, T] -> FloatTensor [B, T, vocab]."""
        return self.net.forward(input_ids.to(self.net.device), self.budget(budget))
