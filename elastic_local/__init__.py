"""elastic-local: a local runner for elastic (nested, many-in-one) Nemotron-H reasoning models."""

from .engine import ElasticModel, load
from .model import Budget, NemotronHConfig

__all__ = ["Budget", "ElasticModel", "NemotronHConfig", "load"]
__version__ = "0.1.0"
