import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def threads(request):
    """One thread, and three (uneven shares of every product and scan, split-K partial sums), whatever the
    machine: the C kernels' parallel paths run in every test that takes this."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
