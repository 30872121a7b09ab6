"""elastic-local: a local runner for elastic (nested, many-in-one) Nemotron-H reasoning models."""

import os

# oneDNN (torch's CPU matmuls, convolutions, attention) caches one primitive per input shape, 1024 by
# default; every prefill chunk attends to a longer cache, so that cache grew by tens of MiB per chunk.
# Measured on a 290M model at 8192 tokens (benchmarks/bench_memory.py, bench_decode.py 100m): 1024
# entries hold 1.27x the planned memory; 32 entries 1.09x but prefill and decode slow down (primitives
# rebuilt); 64 entries 1.13x at full speed. Read when oneDNN first runs: this must precede torch work.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")

from .engine import ElasticModel, load
from .model import Budget, NemotronHConfig

__all__ = ["Budget", "ElasticModel", "NemotronHConfig", "load"]
__version__ = "0.1.0"
