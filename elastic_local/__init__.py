"""elastic-local: a local runner for elastic (nested, many-in-one) Nemotron-H reasoning models."""

import os

# oneDNN (torch's CPU matmuls, convolutions, attention) caches one primitive per input shape, 1024 by
# default; every prefill chunk attends to a longer cache, so that cache grew by tens of MiB per chunk
# (measured: 8192 tokens of context held 27% more than planned; with 32 entries 10%, decode unchanged).
# It is read when oneDNN first runs, so this must come before any torch work.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")

from .engine import ElasticModel, load
from .model import Budget, NemotronHConfig

__all__ = ["Budget", "ElasticModel", "NemotronHConfig", "load"]
__version__ = "0.1.0"
