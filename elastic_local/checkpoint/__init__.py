"""Checkpoint files: reading, validating and (later) writing Nemotron-H directories."""

from .files import CheckpointError, index_tensors
from .load import load_network

__all__ = ["CheckpointError", "index_tensors", "load_network"]
