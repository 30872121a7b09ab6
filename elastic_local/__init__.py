"""elastic-local: a local runner for elastic (nested, many-in-one) Nemotron-H reasoning models.

The public names are imported on first use (`lazy.py`), not with the package."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import exports
from .version import __version__

if TYPE_CHECKING:
    from .engine import ElasticModel, load
    from .model import Budget, NemotronHConfig

__all__ = ["Budget", "ElasticModel", "NemotronHConfig", "__version__", "load"]
__getattr__, __dir__ = exports(__name__, {"ElasticModel": ".engine", "load": ".engine", "Budget": ".model",
                                          "NemotronHConfig": ".model"})
