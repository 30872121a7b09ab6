"""`elastic-local nest`: turn any Nemotron-H checkpoint into a nested elastic one.

1. score every axis on calibration tokens (importance.py),
2. permute every axis into importance order (function-preserving: the full budget is the input model),
3. choose each budget's sizes for its parameter target (search.py), largest first so budgets nest,
4. write the permuted tensors, the budget table in config.json, the tokenizer files and the scores.
The model is held once (for scoring) and the output is streamed tensor by tensor.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..checkpoint.files import Reader, checkpoint_tensors
from ..checkpoint.load import load_network
from ..checkpoint.write import CheckpointWriter, check_output
from ..model.budget import Budget, count_params
from ..model.config import NemotronHConfig
from ..model.schema import expected_shapes
from ..progress import Progress
from ..quant.scheme import read_quant_config
from .importance import Importance, calibration_ids, score
from .search import ALL_AXES, DEFAULT_AXES, search_budget
from .select import LayerSelection, Selection, materialize, select_plan
from .table import FORMAT_VERSION, budget_entry, check_alignment

log = logging.getLogger(__name__)


def _desc(t: torch.Tensor) -> torch.Tensor:
    return torch.argsort(t, descending=True, stable=True)


def _within_groups(scores: torch.Tensor, groups: int) -> torch.Tensor:
    """Sort units by score inside each of `groups` equal groups; groups keep their place."""
    per = scores.numel() // groups
    order = _desc(scores.view(groups, per))
    return (order + torch.arange(groups)[:, None] * per).reshape(-1)


def importance_orders(cfg: NemotronHConfig, imp: Importance) -> Selection:
    """The permutation that puts every axis in importance order (most important first)."""
    layers = []
    for i, kind in enumerate(cfg.pattern):
        s = imp.layers.get(i, {})
        ls = LayerSelection(source=i)
        if kind == "M":
            ls.heads = _within_groups(s["mamba_heads"], cfg.n_groups)
        elif kind == "*":
            ls.heads = _within_groups(s["attention_heads"], cfg.num_key_value_heads)
        elif kind == "E":
            # experts stay inside their routing group (group-limited top-k depends on membership)
            ls.experts = _within_groups(s["experts"], cfg.n_group)
            ls.channels = [_desc(s["expert_channels"][e]) for e in ls.experts.tolist()]
            ls.shared = _desc(s["shared_channels"])
        else:
            ls.channels = _desc(s["mlp_channels"])
        layers.append(ls)
    return Selection(hidden=_desc(imp.hidden), layers=layers)


def permute_scores(imp: Importance, sel: Selection) -> Importance:
    """The scores as the nested file lays its units out (each axis descending)."""
    out = Importance(hidden=imp.hidden[sel.hidden], depth_order=imp.depth_order, depth_nmse=imp.depth_nmse,
                     tokens=imp.tokens, source=imp.source)
    for ls in sel.layers:
        s = imp.layers.get(ls.source, {})
        d: dict[str, torch.Tensor] = {}
        for axis, t in s.items():
            if axis in ("mamba_heads", "attention_heads"):
                d[axis] = t[ls.heads]
            elif axis == "experts":
                d[axis] = t[ls.experts]
            elif axis == "expert_channels":
                d[axis] = torch.stack([t[e][c] for e, c in zip(ls.experts.tolist(), ls.channels)])
            elif axis == "shared_channels":
                d[axis] = t[ls.shared]
            else:
                d[axis] = t[ls.channels]
        out.layers[ls.source] = d
    return out


def nest(src: str | Path, out: str | Path, budgets: dict[str, float], calib: str | Path | None = None,
         axes: tuple[str, ...] | None = None, heterogeneous: bool = False, full_name: str = "full",
         device: str = "cpu", dtype: torch.dtype = torch.float32, max_tokens: int = 16384, seq_len: int = 512,
         progress: Progress | None = None, overwrite: bool = False, importance: Importance | None = None) -> Path:
    """Write `src` nested: every axis in importance order and a budget per fraction. `importance`, scores
    already measured on `src` (file layout, as `importance.score` returns them), skips the scoring."""
    src, out = Path(src), Path(out)
    check_output(out, overwrite, [src])  # before the scoring, which takes long on a real model
    cfg = NemotronHConfig.from_dir(src)
    if axes is None:  # the default axes, less experts where group-limited routing fixes them
        axes = tuple(a for a in DEFAULT_AXES if a != "experts" or cfg.n_group == 1)
    unknown = set(axes) - set(ALL_AXES)
    if unknown:
        raise ValueError(f"unknown axes {sorted(unknown)}; choose from {list(ALL_AXES)}")
    if "experts" in axes and cfg.n_group > 1:
        raise ValueError("the experts axis needs n_group == 1 (group-limited routing fixes each group's experts); "
                         "leave it out of --axes")
    for name, frac in budgets.items():
        if not 0 < frac < 1:
            raise ValueError(f"budget {name}={frac}: a fraction of the parent's parameters must be in (0, 1)")
        if name == full_name:
            raise ValueError(f"budget name {name!r} is the full model's name; pick another")
    if read_quant_config(src)[0] != "bf16":
        raise ValueError(f"{src} is quantized; nest its BF16 original, then quantize the nested file")
    if calib is None and importance is None:
        log.warning("no --calib file: scoring importance on a generic sample; fine for tests, "
                    "not for ranking a real model")

    if importance is not None:
        imp, source = importance, importance.source
    else:
        net = load_network(src, dtype=dtype, device=device, progress=progress)
        ids, source = calibration_ids(calib, src, cfg.vocab_size, max_tokens)
        imp = score(net, ids, seq_len=seq_len, depth="depth" in axes, progress=progress)
        imp.source = source
        del net

    sel = importance_orders(cfg, imp)
    nested_scores = permute_scores(imp, sel)
    full = Budget.full(cfg, full_name)
    parent = count_params(cfg, full)[0]
    chosen = [full]
    for name, frac in sorted(budgets.items(), key=lambda kv: -kv[1]):
        b = search_budget(cfg, nested_scores, chosen[-1], name, round(frac * parent), axes, heterogeneous)
        check_alignment(cfg, b)
        chosen.append(b)

    reader = Reader(checkpoint_tensors(src))
    stored = [s.mamba_heads or s.attention_heads or None for s in full.layers]
    config = dict(cfg.raw)
    config["elastic"] = {
        "format_version": FORMAT_VERSION,
        "axes": list(axes),
        "heterogeneous": heterogeneous,
        "calibration": {"source": source, "tokens": imp.tokens},
        "importance_file": "importance.safetensors",
        "depth_order": imp.depth_order,
        "budgets": [budget_entry(cfg, b) for b in chosen],
    }
    n = len(expected_shapes(cfg, full))
    with CheckpointWriter(out, overwrite=overwrite, sources=[src]) as w:
        for k, (name, req) in enumerate(select_plan(cfg, sel, stored)):
            for out_name, t in materialize(reader, name, req):
                w.add(out_name, t)
            if progress:
                progress(k + 1, n, f"writing {name}")
        w.write_json("config.json", config)
        w.carry(src)
        nested_scores.save(w.tmp / "importance.safetensors")
        return w.close()
