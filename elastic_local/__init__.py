"""elastic-local: a local runner for elastic (nested, many-in-one) Nemotron-H reasoning models.

The public names are imported on first use (PEP 562), not with the package: torch alone takes seconds to
import, which `elastic-local --help` should not wait for."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .version import __version__

if TYPE_CHECKING:
    from .engine import ElasticModel, load
    from .model import Budget, NemotronHConfig

__all__ = ["Budget", "ElasticModel", "NemotronHConfig", "__version__", "load"]
_HOMES = {"ElasticModel": ".engine", "load": ".engine", "Budget": ".model", "NemotronHConfig": ".model"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'elastic_local' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
