"""Calibrating activation scales: the largest |input| each Linear sees on calibration tokens.

Each Linear weight of the resident model is swapped for a recorder that computes the same matmul and
remembers max |x|; one forward pass over the calibration sequences fills the table. Scales are taken
on the full budget and shared by every budget (one `input_scale` per tensor, SPEC §5).
"""

from __future__ import annotations

import torch

from ..model.linear import block, linear
from ..model.nemotron_h import NemotronH


class _Recorder:
    def __init__(self, w, names: list[str], amax: dict[str, float]):
        self.w, self.names, self.amax = w, names, amax
        self.shape = w.shape

    def __getitem__(self, e: int) -> _Recorder:  # one expert of a stacked weight
        return _Recorder(self.w[e], [n.format(e=e) for n in self.names], self.amax)

    def block(self, r0: int, r1: int, cols: int) -> _Recorder:
        return _Recorder(block(self.w, r0, r1, cols), self.names, self.amax)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        a = float(x.detach().abs().amax())
        for n in self.names:
            self.amax[n] = max(self.amax.get(n, 0.0), a)
        return linear(x, self.w)


_LINEARS = {  # block letter -> (attribute, canonical tensor names it computes)
    "M": (("in_proj", ["in_proj"]), ("out_proj", ["out_proj"])),
    "*": (("qkv", ["q_proj", "k_proj", "v_proj"]), ("o_proj", ["o_proj"])),
    "E": (("up", ["experts.{e}.up_proj"]), ("down", ["experts.{e}.down_proj"]),
          ("shared_up", ["shared_experts.up_proj"]), ("shared_down", ["shared_experts.down_proj"])),
    "-": (("up", ["up_proj"]), ("down", ["down_proj"])),
}


@torch.inference_mode()
def input_amax(net: NemotronH, sequences: list[list[int]]) -> dict[str, float]:
    """Canonical weight name -> max |input| over the sequences. Routed experts share one value per layer and
    projection (the largest): vLLM's fused MoE keeps one input scale per layer, and an expert the
    calibration text never reached still gets a sane scale."""
    amax: dict[str, float] = {}
    saved = []
    for i, layer in enumerate(net.layers):
        if layer.mixer is None:
            continue
        for attr, names in _LINEARS[layer.kind]:
            w = getattr(layer.mixer, attr)
            saved.append((layer.mixer, attr, w))
            setattr(layer.mixer, attr, _Recorder(w, [f"layers.{i}.mixer.{n}.weight" for n in names], amax))
    try:
        for seq in sequences:
            net.forward(torch.tensor([seq], device=net.device))
    finally:
        for mixer, attr, w in saved:
            setattr(mixer, attr, w)
    for i, layer in enumerate(net.layers):
        if layer.kind != "E" or layer.mixer is None:
            continue
        for proj in ("up_proj", "down_proj"):
            names = [f"layers.{i}.mixer.experts.{e}.{proj}.weight" for e in range(len(layer.mixer.up))]
            top = max((amax.get(n, 0.0) for n in names), default=0.0)
            amax.update(dict.fromkeys(names, top))
    return amax
