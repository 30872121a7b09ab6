"""Mixture of experts with Nemotron-H's router, the shared expert, and the dense MLP.

Router (SPEC §3): s = sigmoid(x W^T) in float32; the top-k of s + e_score_correction_bias choose the
experts (the bias only selects, optionally within the best `topk_group` of `n_group` groups); the
weights are the unbiased s of the chosen experts, normalised to sum 1 when norm_topk_prob, times
routed_scaling_factor. A budget keeping K experts restricts the choice to the first K.
Expert and MLP: down(relu(up x)^2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import gemv, kernels, step
from .linear import ExpertStack, Panels, Transposed, block, linear
from .soft import SoftLayer, unit_weights


@dataclass
class MoEWeights:
    gate: torch.Tensor  # [E, D] float32
    bias: torch.Tensor  # [E] float32 e_score_correction_bias
    up: torch.Tensor  # [E, I, D]
    down: torch.Tensor  # [E, D, I]
    shared_up: torch.Tensor  # [S, D]
    shared_down: torch.Tensor  # [D, S]


@dataclass
class MLPWeights:
    up: torch.Tensor  # [I, D]
    down: torch.Tensor  # [D, I]


def mlp(x: torch.Tensor, up, down, channels: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """down(relu(up x)^2) over the first `channels` channels; `keep` weighs them (soft budgets)."""
    d = x.shape[-1]
    h = F.relu(linear(x, block(up, 0, channels, d))).square()
    if keep is not None:
        h = h * keep.to(h.dtype)
    return linear(h, block(down, 0, d, channels))


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, experts: int, cfg,
          kept: torch.Tensor | None = None):
    """(weights [N, k] float32, expert ids [N, k]) for tokens x [N, d], choosing among the first `experts`.
    `kept` (soft budgets, router training only): per expert, the probability that the budget keeps it; an
    expert is chosen as if its score were lowered by log(kept) and its output is weighed by it, so a kept
    expert (1) routes as usual and a dropped one (0) is never chosen: the prefix the runtime routes within."""
    d = x.shape[-1]
    if kept is None and cfg.n_group == 1 and (out := _route_cpu(x, gate, bias, experts, cfg)) is not None:
        return out
    scores = torch.sigmoid(F.linear(x.float(), gate[:experts, :d]))
    choice = scores + bias[:experts]
    if kept is not None:
        choice = choice + kept.float().clamp_min(1e-12).log()
    E = gate.shape[0]
    if cfg.n_group > 1:  # group-limited: keep the topk_group groups whose two best experts score highest
        if experts < E:
            choice = F.pad(choice, (0, E - experts), value=-torch.inf)
        groups = choice.view(-1, cfg.n_group, E // cfg.n_group)
        best = groups.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(cfg.topk_group, dim=-1).indices, True)
        choice = groups.masked_fill(~keep[..., None], -torch.inf).view(-1, E)[:, :experts]
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if kept is not None:
        weights = weights * kept.float()[ids]
    return weights * cfg.routed_scaling_factor, ids


def _route_cpu(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, experts: int, cfg):
    """route by step.c's route_rows (the decode step's router, a token per call there), or None where it does
    not run: another device, a router not float32, or gradients to compute."""
    (n, d), k = x.shape, cfg.num_experts_per_tok
    g, b = gate[:experts, :d], bias[:experts]
    lib = kernels.cpu_library(g, b, x, bf16=True)
    if lib is None or g.dtype != torch.float32 or b.dtype != torch.float32 or g.stride(1) != 1 or k > experts:
        return None
    x, b = x.float().contiguous(), b.contiguous()
    ids, weights = torch.empty(n, k, dtype=torch.int64), torch.empty(n, k)
    lib.route_rows(x.data_ptr(), n, d, g.data_ptr(), g.stride(0), b.data_ptr(), experts, k,
                   int(cfg.norm_topk_prob), cfg.routed_scaling_factor, ids.data_ptr(), weights.data_ptr(),
                   torch.get_num_threads())
    return weights, ids


def moe(x: torch.Tensor, w: MoEWeights, experts: int, channels: int, shared_channels: int, cfg,
        soft: SoftLayer | None = None, sync_free: bool = False) -> torch.Tensor:
    """Routed experts + shared expert. Several tokens: in C where it runs (`_experts_cpu`), else grouped by
    expert (one sort) and each expert that got any token runs once on all of its tokens: the Python loop
    is over experts, never over tokens. `sync_free` (a step a CUDA graph records): `_experts_gathered`."""
    keep, keep_shared = unit_weights(soft, "expert_channels", channels), unit_weights(soft, "shared_channels",
                                                                                      shared_channels)
    shape = x.shape
    d = shape[-1]
    flat = x.reshape(-1, d)
    weights, ids = route(flat, w.gate, w.bias, experts, cfg, unit_weights(soft, "experts", experts))
    if sync_free:
        out = _experts_gathered(flat, w, experts, channels, ids, weights)
    elif flat.shape[0] == 1:  # one token (batch-1 decode): just its k experts, no sorting
        out = sum(mlp(flat, w.up[e], w.down[e], channels, keep) * wt
                  for e, wt in zip(ids[0].tolist(), weights[0].to(x.dtype).unbind()))
    else:
        out = None if keep is not None else _experts_cpu(flat, w, experts, channels, ids, weights)
        if out is None:
            out = _experts_grouped(flat, w, experts, channels, ids, weights, keep)
    return out.to(x.dtype).view(shape) + mlp(x, w.shared_up, w.shared_down, shared_channels, keep_shared)


def _experts_grouped(flat: torch.Tensor, w: MoEWeights, experts: int, channels: int, ids: torch.Tensor,
                     weights: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The routed experts' sum [N, d] float32 in torch: the (token, expert) pairs sorted by expert, each
    expert once on its rows, added into place (a shape per expert: the compiled decode step traces it)."""
    order = ids.reshape(-1).argsort()
    counts = torch.bincount(ids.reshape(-1), minlength=experts).tolist()
    token_of = order // ids.shape[1]
    out = torch.zeros(flat.shape[0], flat.shape[1], dtype=torch.float32, device=flat.device)
    pos = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[pos:pos + n]
        h = mlp(flat[rows], w.up[e], w.down[e], channels, keep)
        out.index_add_(0, rows, h.float() * weights.reshape(-1)[order[pos:pos + n], None])
        pos += n
    return out


def _experts_gathered(flat: torch.Tensor, w: MoEWeights, experts: int, channels: int, ids: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' sum [N, d] float32 without reading a value back to the host: every (token, expert)
    pair gathers its expert's weights and the products run batched, so the kernels and their shapes are the
    same on every step, which a CUDA graph needs (model/graphs.py). The gather reads the chosen experts'
    weights once more than the product does: affordable for a few decode rows, not a prompt. Packed experts
    (an ExpertStack) are dequantized one routed slot at a time: a row holds one expert's pair, not k."""
    (n, d), k = flat.shape, ids.shape[1]
    if isinstance(w.up, ExpertStack):
        out = torch.zeros(n, d, dtype=torch.float32, device=flat.device)
        x = w.up.round_inputs(flat)
        for j in range(k):
            up = w.up.dequantize(ids[:, j], channels, d, flat.dtype)  # [N, I, d]
            down = w.down.dequantize(ids[:, j], d, channels, flat.dtype)
            h = w.down.round_inputs(F.relu(torch.bmm(up, x[:, :, None])).square()[..., 0])
            out += torch.bmm(down, h[:, :, None])[..., 0].float() * weights[:, j, None]
        return out
    pick = ids.reshape(-1)
    up, down = _gather(w.up, experts, channels, d, pick), _gather(w.down, experts, d, channels, pick)
    h = F.relu(torch.bmm(up, flat.repeat_interleave(k, 0)[:, :, None])).square()  # [N*k, I, 1]
    y = torch.bmm(down, h).view(n, k, d).float()
    return (y * weights[..., None]).sum(1)


def _gather(w, experts: int, rows: int, cols: int, pick: torch.Tensor) -> torch.Tensor:
    """[len(pick), rows, cols]: block (rows, cols) of the experts `pick` of w [E, out, in] (or its CPU layout)."""
    if isinstance(w, (Transposed, Panels)):
        return w.block(0, rows, cols)[pick].dense().transpose(1, 2)  # cut (a view), then gather
    return w[:experts, :rows, :cols][pick]


def _experts_cpu(flat: torch.Tensor, w: MoEWeights, experts: int, channels: int, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor | None:
    """The routed experts' sum [N, d] float32 for tokens `flat` [N, d] in C (step.c's experts_prefill), on
    any weight format the decode step reads; for bf16 tokens at the torch path's rounding points
    (experts_prefill_bf16: on the CPU's bf16 dots where it has them, else widened to float32 as the torch
    path's products are). None where it does not run: another device or dtype, weights step.c does not
    read, or gradients to compute."""
    n, d = flat.shape
    if flat.dtype == torch.bfloat16:  # a bfloat16 prompt: its own C path
        lib, entry, extra = kernels.cpu_library(flat, weights, bf16=True), "experts_prefill_bf16", (gemv.bf16_dot(),)
    else:
        # plain [out, in] stacks must be float32; panels (float32, or bf16 that step.c widens) and packed
        # weights are read as they are, and the Transposed layout exists only where the kernels do not run
        plain = (t for t in (w.up, w.down) if isinstance(t, torch.Tensor))
        lib, entry, extra = kernels.cpu_library(flat, weights, *plain), "experts_prefill", ()
    described = lib and _described(w, experts, channels, d)
    if not described:
        return None
    up, down = described
    flat, ids, weights = flat.contiguous(), ids.contiguous(), weights.float().contiguous()
    out = torch.zeros(n, d)
    rc = getattr(lib, entry)(flat.data_ptr(), n, d, ids.data_ptr(), weights.data_ptr(), ids.shape[1], experts,
                             up, down, channels, out.data_ptr(), torch.get_num_threads(), *extra)
    if rc == -1:
        raise MemoryError(f"out of memory for the experts' buffers of {n} tokens")
    return None if rc else out  # -2: experts_prefill_bf16 does not take these weights


def _described(w: MoEWeights, experts: int, channels: int, d: int):
    """step.expert_weights of a budget's experts, kept on `w` per budget while its weights stay the same
    objects (the descriptions hold their pointers: replaced weights are described anew); None where step.c
    does not read them, or they mix formats."""
    cache = w.__dict__.setdefault("_described", {})
    if any(up is not w.up or down is not w.down for up, down, _ in cache.values()):
        cache.clear()  # the weights were replaced: no description (nor the old weights it keeps) survives
    key = (experts, channels, d)
    hit = cache.get(key)
    if hit is None:
        try:
            arrays = step.expert_weights(w, experts, channels, d)
        except step.Unsupported:
            arrays = None
        if arrays is not None and any(len({a.format for a in arr}) != 1 for arr in arrays):
            arrays = None
        cache[key] = hit = (w.up, w.down, arrays)
    return hit[2]
