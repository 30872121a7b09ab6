"""The network's weights as trainable parameters, and back to the hub layout for export.

The network keeps its weights as plain tensors in small dataclasses (model/). Training swaps each for
an `nn.Parameter` holding the same storage, so the forward is the very code inference runs. Export
undoes what the loader did: rank-major heads back to group-major, A back to A_log, experts unstacked.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch
from torch import nn

from ..model.attention import AttentionWeights
from ..model.config import NemotronHConfig
from ..model.layout import head_channels, rank_major_heads
from ..model.mamba2 import MambaWeights
from ..model.moe import MoEWeights
from ..model.nemotron_h import NemotronH

FROZEN = ("bias",)  # MoE e_score_correction_bias: a load-balancing statistic, not a trained weight


@dataclass
class Slot:
    """One weight of the network: where it lives (owner object and field) under a canonical name."""
    name: str
    owner: object
    field: str

    def get(self) -> torch.Tensor:
        return getattr(self.owner, self.field)

    def set(self, t: torch.Tensor) -> None:
        setattr(self.owner, self.field, t)


def slots(net: NemotronH) -> Iterator[Slot]:
    """Every weight tensor of a network loaded with its full stored budget resident."""
    yield Slot("embeddings.weight", net, "embed")
    for i, layer in enumerate(net.layers):
        if layer.mixer is None:
            continue
        yield Slot(f"layers.{i}.norm.weight", layer, "norm")
        for f in fields(layer.mixer):  # the weights, not what a layer caches on them (moe._described)
            if getattr(layer.mixer, f.name) is not None:
                yield Slot(f"layers.{i}.mixer.{f.name}", layer.mixer, f.name)
    yield Slot("norm_f.weight", net, "norm_f")
    if not net.cfg.tie_word_embeddings:
        yield Slot("lm_head.weight", net, "lm_head")


def make_trainable(net: NemotronH) -> dict[str, nn.Parameter]:
    """Replace every trained weight by a Parameter on the same storage; returns them by name."""
    params: dict[str, nn.Parameter] = {}
    for s in slots(net):
        if s.field in FROZEN:
            continue
        p = nn.Parameter(s.get())
        s.set(p)
        params[s.name] = p
    return params


def _rows_mamba(cfg: NemotronHConfig, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(file head of each resident head, their channels, in_proj file rows, conv1d file rows) as the loader
    reorders them (checkpoint/load.py)."""
    G, p = cfg.n_groups, cfg.mamba_head_dim
    heads = rank_major_heads(n, G)
    ch = head_channels(heads, p)
    bc = torch.arange(2 * n * p, 2 * n * p + 2 * G * cfg.ssm_state_size)
    rows = torch.cat([ch, n * p + ch, bc, 2 * n * p + len(bc) + heads])
    return heads, ch, rows, torch.cat([ch, bc - n * p])


def _to_file(t: torch.Tensor, order: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Resident position j holds file index order[j]: put every one back at its file index."""
    return t.index_select(dim, torch.argsort(order.to(t.device)))


def hub_tensors(net: NemotronH) -> Iterator[tuple[str, torch.Tensor]]:
    """(hub name, tensor in file layout) of every weight, detached, for a network holding everything."""
    cfg = net.cfg
    yield "backbone.embeddings.weight", net.embed.detach()
    for i, layer in enumerate(net.layers):
        o, w = f"backbone.layers.{i}.mixer.", layer.mixer
        yield f"backbone.layers.{i}.norm.weight", layer.norm.detach()
        if isinstance(w, MambaWeights):
            heads, ch, rows, conv_rows = _rows_mamba(cfg, w.heads)
            yield o + "in_proj.weight", _to_file(w.in_proj.detach(), rows)
            yield o + "conv1d.weight", _to_file(w.conv_weight.detach(), conv_rows)[:, None]
            if w.conv_bias is not None:
                yield o + "conv1d.bias", _to_file(w.conv_bias.detach(), conv_rows)
            yield o + "dt_bias", _to_file(w.dt_bias.detach(), heads)
            yield o + "A_log", _to_file(torch.log(-w.A.detach()), heads)
            yield o + "D", _to_file(w.D.detach(), heads)
            yield o + "norm.weight", _to_file(w.norm.detach(), ch)
            yield o + "out_proj.weight", _to_file(w.out_proj.detach(), ch, 1)
        elif isinstance(w, AttentionWeights):
            KV, hd = cfg.num_key_value_heads, cfg.head_dim
            ch = head_channels(rank_major_heads(w.q_heads(hd, KV), KV), hd)
            q, k, v = w.qkv.detach().split([len(ch), KV * hd, KV * hd])
            yield o + "q_proj.weight", _to_file(q, ch)
            yield o + "k_proj.weight", k
            yield o + "v_proj.weight", v
            yield o + "o_proj.weight", _to_file(w.o_proj.detach(), ch, 1)
        elif isinstance(w, MoEWeights):
            yield o + "gate.weight", w.gate.detach()
            yield o + "gate.e_score_correction_bias", w.bias.detach()
            for e in range(w.gate.shape[0]):
                yield o + f"experts.{e}.up_proj.weight", w.up[e].detach()
                yield o + f"experts.{e}.down_proj.weight", w.down[e].detach()
            yield o + "shared_experts.up_proj.weight", w.shared_up.detach()
            yield o + "shared_experts.down_proj.weight", w.shared_down.detach()
        else:
            yield o + "up_proj.weight", w.up.detach()
            yield o + "down_proj.weight", w.down.detach()
    yield "backbone.norm_f.weight", net.norm_f.detach()
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", net.lm_head.detach()


def file_column_order(net: NemotronH) -> dict[str, torch.Tensor]:
    """Canonical names of the Linears whose resident columns are reordered heads -> the file column of
    each resident column (quantization blocks run along the file's columns; see qad.py)."""
    cfg, out = net.cfg, {}
    for i, layer in enumerate(net.layers):
        w = layer.mixer
        if isinstance(w, MambaWeights):
            out[f"layers.{i}.mixer.out_proj"] = _rows_mamba(cfg, w.heads)[1]
        elif isinstance(w, AttentionWeights):
            KV, hd = cfg.num_key_value_heads, cfg.head_dim
            out[f"layers.{i}.mixer.o_proj"] = head_channels(rank_major_heads(w.q_heads(hd, KV), KV), hd)
    return out


def restore(net: NemotronH, params: dict[str, nn.Parameter]) -> None:
    """Put the plain parameters back where views (fake quantization) stood, e.g. before export."""
    for s in slots(net):
        if s.name in params:
            s.set(params[s.name])
