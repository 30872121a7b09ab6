"""A sampled token drawn in C (sample.c): what the run ahead (step.c) and the engine's steps on the CPU
both call, so that a seeded request gives the same tokens whichever of them took each one.

The uniform numbers come from the request's torch generator, one a token, in the order torch draws them
one call at a time; `Uniforms` lends a run ahead as many as it may take and gives back what it did not use.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from . import gemv

NOT_FINITE = ("cannot draw a token: the model's next-token probabilities are not finite numbers (NaN or "
              "infinite logits); its weights or the compute dtype overflowed: try dtype float32, or check the "
              "checkpoint")


class Params(ctypes.Structure):
    """sample.c's `sampling`: temperature > 0; top_k 0, top_p 1 and min_p 0 leave every token in."""

    _fields_ = [("top_k", ctypes.c_int64), ("temperature", ctypes.c_float), ("top_p", ctypes.c_float),
                ("min_p", ctypes.c_float)]


def rows(logits: Tensor, params: Params, generator: torch.Generator | None) -> list[int] | None:
    """[B, V] float CPU logits -> B tokens, row r drawn with the generator's r-th next uniform number; None
    where the C kernels are not built here (the caller's torch draw then runs)."""
    lib = gemv.library()
    if lib is None or logits.device.type != "cpu":
        return None
    logits = logits.detach().float().contiguous()
    B, V = logits.shape
    u = torch.rand((B, 1), generator=generator)
    out = (ctypes.c_int64 * B)()
    probs, keys = torch.empty(V), torch.empty(V, dtype=torch.int64)
    if lib.sample_rows(logits.data_ptr(), B, V, ctypes.byref(params), u.data_ptr(), out, probs.data_ptr(),
                       keys.data_ptr()):
        raise ValueError(NOT_FINITE)
    return list(out)


class Uniforms:
    """Up to n uniform numbers of `generator` (torch's default one for None) lent to a run ahead:
    `give_back(used)` leaves the generator as if it had drawn only the first `used` of them."""

    def __init__(self, n: int, generator: torch.Generator | None):
        self.generator = generator if generator is not None else torch.default_generator
        self.state = self.generator.get_state()
        self.u = torch.rand(n, generator=self.generator)

    def give_back(self, used: int) -> None:
        self.generator.set_state(self.state)
        torch.rand(used, generator=self.generator)
