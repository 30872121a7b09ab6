"""Choosing a budget's axis sizes for a parameter target, guided by importance.

Axes are sorted by importance (nest.py), so cutting an axis from a to a - unit drops its least
important units. Each candidate cut costs the fraction of that axis's importance it removes (averaged
over the layers it touches) and saves some parameters; the search greedily takes the cheapest cut per
parameter saved until the budget is within 2% of its target. Cuts keep input dimensions multiples of
16 (64 where the axis allows). Budgets are searched largest first, each starting from the previous
one's sizes, so every axis of a smaller budget is a prefix of a larger one's.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..model.budget import Budget, count_params
from ..model.config import NemotronHConfig
from .importance import Importance

TOLERANCE = 0.02
DEFAULT_AXES = ("hidden", "mamba_heads", "experts", "expert_channels", "shared_channels", "mlp_channels")
ALL_AXES = (*DEFAULT_AXES, "attention_heads", "depth")
KIND = {"mamba_heads": "M", "attention_heads": "*", "experts": "E", "expert_channels": "E",
        "shared_channels": "E", "mlp_channels": "-"}


def _step(size: int) -> int:
    return 64 if size % 64 == 0 and size >= 256 else 16


def _down(cur: int, step: int) -> int:
    """The next aligned size below `cur` (a full size that is not aligned drops to the aligned one below)."""
    return (cur - 1) // step * step


def _sorted_scores(imp: Importance, cfg: NemotronHConfig) -> dict:
    """Per (layer, axis): scores sorted from most to least important, in the units the axis is cut in.
    For grouped heads a unit is one rank across all groups (the k-th best head of every group)."""
    out: dict = {}
    for i, axes in imp.layers.items():
        for axis, t in axes.items():
            if axis == "mamba_heads":
                out[i, axis] = t.view(cfg.n_groups, -1).sort(dim=1, descending=True).values.sum(0)
            elif axis == "attention_heads":
                out[i, axis] = t.view(cfg.num_key_value_heads, -1).sort(dim=1, descending=True).values.sum(0)
            elif axis == "expert_channels":
                out[i, axis] = t.sort(dim=1, descending=True).values.sum(0)
            else:
                out[i, axis] = t.sort(descending=True).values
    out["hidden"] = imp.hidden.sort(descending=True).values
    return out


def _unit(cfg: NemotronHConfig, axis: str) -> tuple[int, int]:
    """(how many units one cut removes, how many budget-size steps one unit is). A head axis is cut in
    ranks (one head of every group); the ranks kept must be a multiple of the smallest count whose
    channels (ranks x groups x head_dim) are a multiple of 16, else NVFP4 blocks would not slice."""
    if axis == "mamba_heads":
        return 16 // math.gcd(16, cfg.mamba_head_dim * cfg.n_groups), cfg.n_groups
    if axis == "attention_heads":
        return 16 // math.gcd(16, cfg.head_dim * cfg.num_key_value_heads), cfg.num_key_value_heads
    if axis == "experts":
        return cfg.n_group, 1
    return 0, 1  # channel axes: see _step


def _cut_loss(scores: torch.Tensor, keep_units: int, cut_units: int) -> float:
    total = float(scores.sum())
    if total <= 0:
        return 0.0
    return float(scores[keep_units - cut_units:keep_units].sum()) / total


def _depth_loss(b: Budget, depth_nmse: list[float] | None) -> float:
    """What removing the next layer in depth order costs: the logits' normalised MSE it adds, as a fraction
    of what removing all but one layer does (the other axes' losses are fractions too); 1/L, every layer
    alike, when no NMSE was measured."""
    k = sum(not s.enabled for s in b.layers)  # layers the search has already removed, in depth order
    if not depth_nmse or k >= len(depth_nmse) or depth_nmse[-1] <= 0:
        return 1.0 / len(b.layers)
    before = depth_nmse[k - 1] if k else 0.0
    return max(depth_nmse[k] - before, 0.0) / depth_nmse[-1]


def _candidates(cfg: NemotronHConfig, b: Budget, scores: dict, axes: tuple[str, ...], heterogeneous: bool,
                depth_order: list[int] | None, depth_nmse: list[float] | None = None):
    """Yield (loss, new budget) for every single cut allowed from b."""
    if "hidden" in axes:
        step = _step(cfg.hidden_size)
        new = _down(b.hidden, step)
        if new >= step:
            yield _cut_loss(scores["hidden"], b.hidden, b.hidden - new), replace(b, hidden=new)
    for axis in axes:
        if axis not in KIND:
            continue
        layers = [i for i, s in enumerate(b.layers) if s.kind == KIND[axis] and s.enabled]
        groups = [[i] for i in layers] if heterogeneous else ([layers] if layers else [])
        for group in groups:
            cur = getattr(b.layers[group[0]], axis)
            units, per_unit = _unit(cfg, axis)
            if units == 0:  # a channel axis: cut 16 or 64 channels
                full = {"expert_channels": cfg.moe_intermediate_size, "shared_channels":
                        cfg.moe_shared_expert_intermediate_size, "mlp_channels": cfg.intermediate_size}[axis]
                new = _down(cur, _step(full))
                floor = _step(full)
            else:  # the next aligned count of units below (a full count that is not aligned drops to one)
                new = _down(cur // per_unit, units) * per_unit
                # experts: top-k of them, and 2 (transformers and vLLM route through a top-2 per group)
                floor = max(cfg.num_experts_per_tok, 2) if axis == "experts" else units * per_unit
            if new < floor:
                continue
            cut = (cur - new) // per_unit
            loss = sum(_cut_loss(scores[i, axis], cur // per_unit, cut) for i in group) / len(layers)
            layers_new = list(b.layers)
            for i in group:
                layers_new[i] = replace(layers_new[i], **{axis: new})
            yield loss, replace(b, layers=tuple(layers_new))
    if "depth" in axes and depth_order is not None:
        on = [i for i in depth_order if b.layers[i].enabled]
        if len(on) > 1:
            i = on[0]
            layers_new = list(b.layers)
            layers_new[i] = replace(layers_new[i], enabled=False)
            yield _depth_loss(b, depth_nmse), replace(b, layers=tuple(layers_new))


def search_budget(cfg: NemotronHConfig, imp: Importance, start: Budget, name: str, target_params: int,
                  axes: tuple[str, ...] = DEFAULT_AXES, heterogeneous: bool = False) -> Budget:
    """Shrink `start` by importance-guided cuts until its parameters are within 2% of the target."""
    scores = _sorted_scores(imp, cfg)
    b = start.renamed(name)
    params = count_params(cfg, b)[0]
    lo, hi = target_params * (1 - TOLERANCE), target_params * (1 + TOLERANCE)
    while params > hi:
        best = None
        for loss, cand in _candidates(cfg, b, scores, axes, heterogeneous, imp.depth_order, imp.depth_nmse):
            p = count_params(cfg, cand)[0]
            if p < lo:
                continue  # overshoots the target: a finer axis must close the gap
            cost = loss / max(params - p, 1)
            if best is None or cost < best[0]:
                best = (cost, cand, p)
        if best is None:
            raise ValueError(f"budget {name!r}: cannot reach {target_params:,} parameters within 2% with cuts of "
                             f"16/64 channels on axes {list(axes)} (now {params:,}); try other axes or a fraction")
        _, b, params = best
    return b
