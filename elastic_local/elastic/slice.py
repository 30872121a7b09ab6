"""`elastic-local slice`: extract one budget as a standalone Nemotron-H checkpoint ("zero-shot slicing").

The budget's prefix of every axis is read from the memory-mapped nested file and streamed out in the
hub layout. A homogeneous budget becomes a plain Nemotron-H config that transformers and vLLM load
unchanged; a heterogeneous one records per-layer sizes in `block_configs`, which this runner reads
and other runtimes do not. Smaller budgets nested inside the extracted one stay in its budget table.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..checkpoint.files import Reader
from ..checkpoint.verify import verify_tensors
from ..checkpoint.write import CheckpointWriter, check_output
from ..model.budget import Budget
from ..model.config import BLOCK_KINDS, NemotronHConfig
from ..model.schema import stored_budget
from ..progress import Progress
from ..quant.scheme import read_quant_config
from .select import LayerSelection, Selection, materialize, select_plan
from .table import budget_entry, is_homogeneous, read_budgets

_HF_TYPES = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}


def _group_prefix(total: int, groups: int, keep: int) -> torch.Tensor:
    per = total // groups
    return (torch.arange(groups)[:, None] * per + torch.arange(keep // groups)).reshape(-1)


def prefix_selection(cfg: NemotronHConfig, stored: Budget, b: Budget) -> Selection:
    layers = []
    for i, (s, st) in enumerate(zip(b.layers, stored.layers)):
        if not s.enabled:
            continue
        ls = LayerSelection(source=i)
        if s.kind == "M":
            ls.heads = _group_prefix(st.mamba_heads, cfg.n_groups, s.mamba_heads)
        elif s.kind == "*":
            ls.heads = _group_prefix(st.attention_heads, cfg.num_key_value_heads, s.attention_heads)
        elif s.kind == "E":
            ls.experts = torch.arange(s.experts)
            ls.channels = [torch.arange(s.expert_channels)] * s.experts
            ls.shared = torch.arange(s.shared_channels)
        else:
            ls.channels = torch.arange(s.mlp_channels)
        layers.append(ls)
    return Selection(hidden=torch.arange(b.hidden), layers=layers)


def sliced_config(cfg: NemotronHConfig, b: Budget, nested: dict[str, Budget]) -> tuple[dict, bool]:
    """config.json of the extracted budget, and whether other runtimes can load it (homogeneous)."""
    keep = [s for s in b.layers if s.enabled]
    raw = {k: v for k, v in cfg.raw.items() if k not in ("elastic", "block_configs")}
    pattern = "".join(s.kind for s in keep)
    if "hybrid_override_pattern" in raw or "layers_block_type" not in raw:
        raw["hybrid_override_pattern"] = pattern
    if "layers_block_type" in raw:
        raw["layers_block_type"] = [_HF_TYPES[k] for k in pattern]
    raw["num_hidden_layers"] = len(keep)
    raw["hidden_size"] = b.hidden

    def largest(kind: str, axis: str, default: int) -> int:
        return max((getattr(s, axis) for s in keep if s.kind == kind), default=default)

    raw["mamba_num_heads"] = largest("M", "mamba_heads", cfg.mamba_num_heads)
    raw["num_attention_heads"] = largest("*", "attention_heads", cfg.num_attention_heads)
    raw["n_routed_experts"] = largest("E", "experts", cfg.n_routed_experts)
    raw["moe_intermediate_size"] = largest("E", "expert_channels", cfg.moe_intermediate_size)
    raw["moe_shared_expert_intermediate_size"] = largest("E", "shared_channels",
                                                         cfg.moe_shared_expert_intermediate_size)
    raw["intermediate_size"] = largest("-", "mlp_channels", cfg.intermediate_size)
    homogeneous = is_homogeneous(b)
    if not homogeneous:
        raw["block_configs"] = [{"block_type": BLOCK_KINDS[s.kind], "mamba_num_heads": s.mamba_heads,
                                 "num_attention_heads": s.attention_heads, "n_routed_experts": s.experts,
                                 "moe_intermediate_size": s.expert_channels,
                                 "moe_shared_expert_intermediate_size": s.shared_channels,
                                 "intermediate_size": s.mlp_channels} for s in keep]
    new_cfg = NemotronHConfig.from_dict(raw)
    inner = [Budget(x.name, x.hidden, tuple(s for s, k in zip(x.layers, b.layers) if k.enabled))
             for x in nested.values() if x.fits_in(b)]
    # the budget keeps its name, and the smaller budgets nested in it stay: the export is still elastic
    elastic = dict(cfg.raw.get("elastic") or {})
    elastic["budgets"] = [budget_entry(new_cfg, x) for x in inner]
    elastic["sliced_from"] = b.name
    raw["elastic"] = elastic
    return raw, homogeneous


def renumbered_quant_config(src: Path, b: Budget) -> dict:
    """hf_quant_config.json of the export: exclude_modules follow their layers to their new numbers, and
    entries of layers the budget drops go away."""
    q = json.loads((src / "hf_quant_config.json").read_text())
    new_index = {i: j for j, i in enumerate(i for i, s in enumerate(b.layers) if s.enabled)}
    kept = []
    for entry in q["quantization"].get("exclude_modules") or []:
        m = re.match(r"^(backbone\.layers\.)(\d+)(\..*|\*.*)?$", entry)
        if m is None:
            kept.append(entry)
        elif int(m.group(2)) in new_index:
            kept.append(f"{m.group(1)}{new_index[int(m.group(2))]}{m.group(3) or ''}")
    q["quantization"]["exclude_modules"] = kept
    return q


def slice_budget(src: str | Path, out: str | Path, budget: str, progress: Progress | None = None,
                 overwrite: bool = False) -> tuple[Path, bool]:
    """Write `budget` of the nested checkpoint `src` to `out`. Returns (out, loadable by other runtimes)."""
    src = Path(src)
    check_output(out, overwrite, [src])
    cfg = NemotronHConfig.from_dir(src)
    budgets = read_budgets(cfg, where=str(src / "config.json"))
    if budget not in budgets:
        raise KeyError(f"unknown budget {budget!r}; {src} has {list(budgets)}")
    b = budgets[budget]
    stored = stored_budget(cfg)
    raw, homogeneous = sliced_config(cfg, b, budgets)
    precision, kept = read_quant_config(src)
    reader = Reader(verify_tensors(src, cfg))
    sel = prefix_selection(cfg, stored, b)
    heads = [s.mamba_heads or s.attention_heads or None for s in stored.layers]
    plan = list(select_plan(cfg, sel, heads))
    with CheckpointWriter(out, overwrite=overwrite, sources=[src]) as w:
        for k, (name, req) in enumerate(plan):
            for out_name, t in materialize(reader, name, req, precision, kept):
                w.add(out_name, t)
            if progress:
                progress(k + 1, len(plan), name)
        w.write_json("config.json", raw)
        w.carry(src)
        if precision != "bf16":
            w.write_json("hf_quant_config.json", renumbered_quant_config(src, b))
        return w.close(), homogeneous
