"""The Nemotron-H network, elastic from the start: every layer runs at the sizes a Budget gives.

Budgets and configs import without torch (the planner needs no more); the network on first use (`lazy.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports
from .budget import Budget, LayerSizes, count_params
from .config import ConfigError, NemotronHConfig

if TYPE_CHECKING:
    from .nemotron_h import HybridCache, NemotronH

__all__ = ["Budget", "ConfigError", "HybridCache", "LayerSizes", "NemotronH", "NemotronHConfig", "count_params"]
__getattr__, __dir__ = exports(__name__, {"HybridCache": ".nemotron_h", "NemotronH": ".nemotron_h"})
