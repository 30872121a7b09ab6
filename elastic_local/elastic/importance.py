"""Importance of every elastic axis, measured on calibration tokens (SPEC §2).

Width: activation-based. Embedding channels sum |normed activations| over every block input; Mamba
heads score the norm of their gated output (ranked later within their group); attention heads their
query activations; FFN and expert channels the magnitude of their first-layer outputs. Experts: REAP,
router weight x expert output norm averaged over the tokens routed to the expert. Depth: the
normalised MSE of the logits when a layer is removed, iteratively (remove the least harmful, repeat).

Where this departs from the paper (which scores Mamba heads on the x projection's output and FFN channels
as |x W1| before the activation), it is because it ranked better: on the demo parent, nest with the
paper's scores gave mid 11.9% / small 4.8% held-out accuracy against 38.1% / 10.7% with these, and with
only Mamba heads cut (6 of 8) the paper's ranking lost twice our held-out KD (benchmarks/bench_importance.py,
README "Elastic training").

Scores come out in the *file* layout (hub head order), ready for nest.py to permute.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.budget import Budget
from ..model.layout import rank_major_heads
from ..model.moe import route
from ..model.nemotron_h import NemotronH

log = logging.getLogger(__name__)

# Used when no --calib file is given: enough to exercise every path, not to rank a real model well.
GENERIC_SAMPLE = (
    "The committee met on Tuesday to review the budget. After a long discussion about costs, schedules and "
    "risks, they agreed to fund the new bridge, provided the engineers could show that the design would "
    "survive a flood of the kind recorded in 1927. Question: if a train leaves at 9:40 and travels 210 km at "
    "84 km/h, when does it arrive? Think step by step. 210 / 84 = 2.5 hours, so it arrives at 12:10. "
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "Photosynthesis converts light energy into chemical energy stored in glucose; chlorophyll absorbs mostly "
    "blue and red light. In 1905 Einstein published four papers that changed physics. "
)


@dataclass
class Importance:
    hidden: torch.Tensor  # [D]
    layers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # layer -> axis -> scores
    depth_order: list[int] | None = None  # layers from least to most important (removal order)
    depth_nmse: list[float] | None = None  # logits' normalised MSE after removing depth_order[:k + 1]
    tokens: int = 0
    source: str = ""

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tensors = {"hidden": self.hidden.contiguous()}
        for i, axes in self.layers.items():
            for name, t in axes.items():
                tensors[f"layers.{i}.{name}"] = t.contiguous()
        # one metadata entry: safetensors writes several in hash order, which differs from run to run, so the
        # same build's file differed byte for byte
        meta = {"tokens": self.tokens, "source": self.source, "depth_order": self.depth_order,
                "depth_nmse": self.depth_nmse}
        save_file(tensors, path, metadata={"importance": json.dumps(meta, sort_keys=True)})


def calibration_ids(calib: str | Path | None, tokenizer_dir: Path, vocab_size: int,
                    max_tokens: int) -> tuple[list[int], str]:
    """Token ids to score on: a text file (tokenized with the checkpoint's tokenizer), a JSON list of token
    ids (or list of lists), or, without a file, the generic sample."""
    if calib is not None and Path(calib).suffix == ".json":
        data = json.loads(Path(calib).read_text())
        ids = [t for row in data for t in row] if data and isinstance(data[0], list) else list(data)
        bad = [t for t in ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"{calib}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        return [int(t) for t in ids[:max_tokens]], Path(calib).name
    text = Path(calib).read_text() if calib is not None else GENERIC_SAMPLE * 8
    # the file's name, not its path: a build folder's path in a shipped file is noise, and it made the same
    # build in two folders differ byte for byte
    source = Path(calib).name if calib is not None else "generic sample (no --calib)"
    tok_file = tokenizer_dir / "tokenizer.json"
    if tok_file.is_file():
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(tok_file)).encode(text).ids
    elif calib is None:  # no tokenizer and no file: deterministic pseudo-text ids
        ids = torch.randint(0, vocab_size, (max_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    else:
        raise ValueError(f"{tokenizer_dir}: no tokenizer.json to tokenize {calib}; pass token ids as a .json list")
    return ids[:max_tokens], source


def _file_heads(n: int, groups: int) -> torch.Tensor:
    return rank_major_heads(n, groups)  # resident position -> file head (full model)


def score(net: NemotronH, ids: list[int], seq_len: int = 512, depth: bool = False,
          progress: Callable[[int, int, str], None] | None = None) -> Importance:
    """Run the full resident model over `ids` in sequences of `seq_len` and collect every score."""
    cfg = net.cfg
    if net.resident != Budget.full(cfg):
        raise ValueError("importance needs the full model resident")
    dev = net.device
    imp = Importance(hidden=torch.zeros(cfg.hidden_size, dtype=torch.float64), tokens=len(ids))
    acc: dict[int, dict[str, torch.Tensor]] = {}
    counts: dict[int, torch.Tensor] = {}

    def add(i: int, name: str, value: torch.Tensor) -> None:
        d = acc.setdefault(i, {})
        v = value.detach().double().cpu()
        d[name] = d[name] + v if name in d else v

    def observe(i: int, what: str, x: torch.Tensor) -> None:
        layer, kind = net.layers[i], cfg.pattern[i]
        flat = x.reshape(-1, x.shape[-1])
        if what == "mamba_y":
            heads = flat.view(flat.shape[0], -1, cfg.mamba_head_dim).norm(dim=-1).sum(0)
            add(i, "mamba_heads", heads[_order(_file_heads(cfg.mamba_num_heads, cfg.n_groups))])
            return
        imp.hidden += flat.abs().sum(0).double().cpu()
        w = layer.mixer
        if kind == "*":
            hq = cfg.num_attention_heads * cfg.head_dim
            q = F.linear(flat, w.qkv[:hq]).view(flat.shape[0], -1, cfg.head_dim).norm(dim=-1).sum(0)
            add(i, "attention_heads", q[_order(_file_heads(cfg.num_attention_heads, cfg.num_key_value_heads))])
        elif kind == "-":
            add(i, "mlp_channels", F.relu(F.linear(flat, w.up)).square().sum(0))
        elif kind == "E":
            weights, eids = route(flat, w.gate, w.bias, cfg.n_routed_experts, cfg)
            E = cfg.n_routed_experts
            reap = torch.zeros(E, dtype=torch.float64)
            chan = torch.zeros(E, cfg.moe_intermediate_size, dtype=torch.float64)
            n = torch.bincount(eids.reshape(-1), minlength=E).double().cpu()
            for e in eids.unique().tolist():
                tok, slot = (eids == e).nonzero(as_tuple=True)
                h = F.relu(F.linear(flat[tok], w.up[e])).square()
                out = F.linear(h, w.down[e])
                reap[e] = (weights[tok, slot] * out.float().norm(dim=-1)).sum().double().cpu()
                chan[e] = h.abs().sum(0).double().cpu()
            add(i, "expert_reap_sum", reap)
            add(i, "expert_channels", chan)
            counts[i] = counts.get(i, torch.zeros(E, dtype=torch.float64)) + n
            add(i, "shared_channels", F.relu(F.linear(flat, w.shared_up)).square().sum(0))

    seqs = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) > 1]
    net.observer = observe
    try:
        for k, seq in enumerate(seqs):
            net.forward(torch.tensor([seq], device=dev))
            if progress:
                progress(k + 1, len(seqs), "activations")
    finally:
        net.observer = None

    for i, axes in acc.items():
        if "expert_reap_sum" in axes:  # REAP is a mean over the tokens routed to each expert
            axes["experts"] = axes.pop("expert_reap_sum") / counts[i].clamp(min=1)
        imp.layers[i] = {k: v.float() for k, v in axes.items()}
    imp.hidden = imp.hidden.float()
    if depth:
        imp.depth_order, imp.depth_nmse = depth_order(net, seqs, progress)
    return imp


def _order(file_heads: torch.Tensor) -> torch.Tensor:
    """Permutation taking scores in resident order to file head order."""
    return torch.argsort(file_heads)


DEPTH_SEQUENCES = 4  # the search runs L^2 / 2 forwards over each: a handful of sequences, not the whole set


@torch.inference_mode()
def depth_order(net: NemotronH, seqs: list[list[int]], progress=None) -> tuple[list[int], list[float]]:
    """Layers in removal order, each step removing the layer whose absence changes the logits least
    (normalised MSE against the full model) given the layers already removed; and that NMSE after each
    step (the budget search charges a depth cut what it adds)."""
    full = net.resident
    batches = [torch.tensor([s], device=net.device) for s in seqs[:DEPTH_SEQUENCES]]
    ref = [net.forward(b) for b in batches]
    removed: list[int] = []
    nmse: list[float] = []
    L = len(full.layers)
    for step in range(L - 1):
        best, best_err = -1, float("inf")
        for i in range(L):
            if i in removed:
                continue
            off = set(removed) | {i}
            b = replace(full, name="probe", layers=tuple(replace(s, enabled=j not in off) for j, s in
                                                         enumerate(full.layers)))
            err = sum(float((net.forward(x, b) - r).pow(2).mean() / r.pow(2).mean()) for x, r in zip(batches, ref))
            if err < best_err:
                best, best_err = i, err
        removed.append(best)
        nmse.append(best_err / len(batches))
        if progress:
            progress(step + 1, L - 1, "depth")
    return removed + [i for i in range(L) if i not in removed], nmse
