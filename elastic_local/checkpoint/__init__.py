"""Checkpoint files: reading, validating and (later) writing Nemotron-H directories.

Headers and indexes read without torch (`fit` and `info` plan from them); the network loader on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports
from .files import CheckpointError, index_tensors

if TYPE_CHECKING:
    from .load import load_network

__all__ = ["CheckpointError", "index_tensors", "load_network"]
__getattr__, __dir__ = exports(__name__, {"load_network": ".load"})
