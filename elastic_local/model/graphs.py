"""One-token decode steps replayed from CUDA graphs, one per budget (`NemotronH.capture_decode`).

Why: a decode step is a few hundred small kernels, each launched from Python; on a GPU those launches,
not the weights, set the speed of small models and small batches. A CUDA graph records the launches once
and replays them all in one call.

A graph replays the same kernels on the same addresses, so the step it records
- reads nothing back to the host: `NemotronH._layers(static=True, sync_free=True)`, where attention covers
  the cache's whole capacity under a position mask and the MoE gathers its experts' weights instead of
  reading their ids as Python ints;
- reads its inputs (token ids, positions) from buffers of its own, copied in before each replay, and
  writes its logits into one, copied out after;
- belongs to one cache, whose KV and Mamba tensors it writes. Another cache (the next conversation, a
  batch restacked, a KV cache that regrew) runs its first step eagerly and records a new graph on its
  second, for about the cost of two eager steps, so a cache stepped once (the engine's sub-batch of the
  rows that decode) is never recorded; each budget keeps its latest graph.
Recording runs the step once for real (a warm-up on a side stream, so that cuBLAS and Triton set
themselves up outside the capture), so the Mamba states are copied first and put back after; the KV
writes of a step are idempotent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .attention import KVCache
from .mamba2 import MambaState

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids [B, 1], lengths [B]) -> logits [B, 1, V]
# records a closure; returns (replay, the closure's output tensor that every replay rewrites)
Recorder = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def cuda_record(run: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """`run` recorded into a CUDA graph after one warm-up run on a side stream (torch.cuda.graphs' recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph.replay, out


def on(device: torch.device):
    """The GPU a graph records and replays on made current: a capture records only the current device's
    stream, so a model on cuda:1 recorded while cuda:0 is current would record nothing and replay stale
    logits. Nothing elsewhere (a stand-in recorder on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def bound_to(ids: torch.Tensor, states: list) -> tuple:
    """What a recording depends on: the batch, the KV capacity and the address of every state tensor."""
    tensors = [t for s in states if s is not None
               for t in ((s.k, s.v) if isinstance(s, KVCache) else (s.conv, s.ssm))]
    return (tuple(ids.shape), *((t.data_ptr(), tuple(t.shape)) for t in tensors))


@dataclass
class StepGraph:
    key: tuple  # bound_to(...) of the cache it was recorded on
    ids: torch.Tensor  # [B, 1] input buffers, read by every replay
    lengths: torch.Tensor  # [B]
    logits: torch.Tensor  # [B, 1, V] output buffer, rewritten by every replay
    replay: Callable[[], None]

    @classmethod
    def record(cls, step: Step, ids: torch.Tensor, lengths: torch.Tensor, states: list,
               record: Recorder = cuda_record) -> StepGraph:
        """`step` recorded on `states` (a cache's layers), which are left as they were."""
        key, ids, lengths = bound_to(ids, states), ids.clone(), lengths.clone()
        saved = [(s, s.conv.clone(), s.ssm.clone()) for s in states if isinstance(s, MambaState)]
        try:
            with on(ids.device):
                replay, logits = record(lambda: step(ids, lengths))
        finally:
            for s, conv, ssm in saved:
                s.conv.copy_(conv)
                s.ssm.copy_(ssm)
        return cls(key, ids, lengths, logits, replay)

    def __call__(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.lengths.copy_(lengths)
        with on(self.ids.device):
            self.replay()
        return self.logits.clone()  # the buffer is rewritten by the next replay
