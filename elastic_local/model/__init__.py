"""The Nemotron-H network, elastic from the start: every layer runs at the sizes a Budget gives."""

from .budget import Budget, LayerSizes, count_params
from .config import ConfigError, NemotronHConfig
from .nemotron_h import HybridCache, NemotronH

__all__ = ["Budget", "ConfigError", "HybridCache", "LayerSizes", "NemotronH", "NemotronHConfig", "count_params"]
