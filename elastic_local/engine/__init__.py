"""Running the resident model: budgets, caches and (soon) generation."""

from .elastic_model import ElasticModel, load

__all__ = ["ElasticModel", "load"]
