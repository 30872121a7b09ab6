"""elastic-local: a local runner for elastic (nested, many-in-one) Nemotron-H reasoning models."""

from .engine import ElasticModel, load
from .model import Budget, NemotronHConfig
from .version import __version__

__all__ = ["Budget", "ElasticModel", "NemotronHConfig", "__version__", "load"]
