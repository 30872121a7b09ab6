"""Running the resident model: budgets, caches and (soon) generation."""

from .elastic_model import ElasticModel
from .load import load

__all__ = ["ElasticModel", "load"]
