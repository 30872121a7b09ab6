import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the C decode step on torch's thread count, never fewer (model/threads.py): the tests that run it on 3
# threads must run its parallel paths; tests/test_threads.py turns the choice back on
os.environ.setdefault("ELASTIC_LOCAL_STEP_THREADS", "fixed")


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def threads(request):
    """One thread, and three (uneven shares of every product and scan, products shared across each other), whatever the
    machine: the C kernels' parallel paths run in every test that takes this."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def no_c_step(monkeypatch):
    """One-sequence steps on the CPU would run in C (test_decode_step.py); the compiled and CUDA-graph
    tests pin their own path."""
    from elastic_local.model import step

    monkeypatch.setattr(step, "build", lambda net, b: None)


@pytest.fixture(scope="session")
def nested(tmp_path_factory):
    """A tiny nested checkpoint: its full budget and `half`."""
    from tiny import ALIGNED, make_checkpoint

    from elastic_local.elastic.nest import nest

    root = tmp_path_factory.mktemp("nested")
    make_checkpoint(root / "parent", seed=31, **ALIGNED)
    return nest(root / "parent", root / "nested", {"half": 0.5})


@pytest.fixture(scope="session")
def nested_tails(tmp_path_factory):
    """`nested` with a state size and a head size that leave vector tails (12 = 8 + 4) in the decode step's
    scan, attention and bf16 widening."""
    from tiny import ALIGNED, make_checkpoint

    from elastic_local.elastic.nest import nest

    root = tmp_path_factory.mktemp("nested_tails")
    make_checkpoint(root / "parent", seed=3, **dict(ALIGNED, ssm_state_size=12, head_dim=12))
    return nest(root / "parent", root / "nested", {"half": 0.5})
