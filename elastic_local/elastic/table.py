"""The budget table in config.json (`"elastic"`): which nested submodels one file holds.

    "elastic": {"format_version": 1, "axes": [...], "calibration": {...},
                "budgets": [{"name": "30B", "params": ..., "active_params": ...,
                             "sizes": {"hidden": 2688, "mamba_heads": 64, "experts": 128, ...}}, ...]}

Each size is one number for every layer of its kind (homogeneous) or a list with one entry per layer
(null for layers of another kind), which is also the shape a learned router's per-layer choice takes.
An optional "layers" list of booleans switches layers off (depth). Budgets are listed largest first.
"""

from __future__ import annotations

from ..model.budget import Budget, LayerSizes, check_budget, count_params, full_layer
from ..model.config import NemotronHConfig
from ..model.schema import stored_budget

FORMAT_VERSION = 1
LAYER_AXES = {"mamba_heads": "M", "attention_heads": "*", "experts": "E", "expert_channels": "E",
              "shared_channels": "E", "mlp_channels": "-"}
ALIGN = 16  # the NVFP4 block: every input-dimension cut is a multiple of it


class BudgetTableError(ValueError):
    """A budget table that does not fit its model; names the budget, layer and axis."""


def budget_entry(cfg: NemotronHConfig, b: Budget) -> dict:
    total, active = count_params(cfg, b)
    sizes: dict = {"hidden": b.hidden}
    for axis, kind in LAYER_AXES.items():
        vals = [getattr(s, axis) for s in b.layers if s.kind == kind]
        if not vals:
            continue
        if len(set(vals)) == 1:
            sizes[axis] = vals[0]
        else:
            sizes[axis] = [getattr(s, axis) if s.kind == kind else None for s in b.layers]
    if not all(s.enabled for s in b.layers):
        sizes["layers"] = [s.enabled for s in b.layers]
    return {"name": b.name, "params": total, "active_params": active, "sizes": sizes}


def is_homogeneous(b: Budget) -> bool:
    """One size per axis for all layers of a kind: the shape a plain Nemotron-H config can describe."""
    return all(len({getattr(s, axis) for s in b.layers if s.kind == kind}) <= 1 for axis, kind in LAYER_AXES.items())


def parse_budget(cfg: NemotronHConfig, entry: dict, where: str = "config.json") -> Budget:
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise BudgetTableError(f"{where}: a budget has no name")
    sizes = entry.get("sizes", {})
    unknown = set(sizes) - set(LAYER_AXES) - {"hidden", "layers"}
    if unknown:
        raise BudgetTableError(f"{where}: budget {name!r} has unknown axes {sorted(unknown)}")
    L = cfg.num_layers
    enabled = sizes.get("layers", [True] * L)
    if len(enabled) != L:
        raise BudgetTableError(f"{where}: budget {name!r} switches {len(enabled)} layers, the model has {L}")
    layers = []
    for i, kind in enumerate(cfg.pattern):
        full = full_layer(cfg, kind)
        kw = {}
        for axis, k in LAYER_AXES.items():
            if k != kind or axis not in sizes:
                continue
            v = sizes[axis]
            if isinstance(v, list):
                if len(v) != L or v[i] is None:
                    raise BudgetTableError(f"{where}: budget {name!r} axis {axis} needs a size for layer {i}")
                v = v[i]
            kw[axis] = int(v)
        layers.append(LayerSizes(**{**full.__dict__, **kw, "enabled": bool(enabled[i])}))
    b = Budget(name, int(sizes.get("hidden", cfg.hidden_size)), tuple(layers))
    try:
        check_budget(cfg, b, where=f"{where}: budget")
    except ValueError as e:
        raise BudgetTableError(str(e)) from None
    check_alignment(cfg, b, where)
    return b


def check_alignment(cfg: NemotronHConfig, b: Budget, where: str = "") -> None:
    """Every input-dimension cut must be a multiple of 16 so that quantized blocks slice exactly."""
    def bad(what: str, size: int, full: int, layer: int | None = None) -> None:
        if size != full and size % ALIGN:
            at = "" if layer is None else f" layer {layer}"
            src = f"{where}: " if where else ""
            raise BudgetTableError(f"{src}budget {b.name!r}{at} cuts {what} to {size}, not a multiple of "
                                   f"{ALIGN} (NVFP4 blocks would not slice exactly); round it to a multiple of {ALIGN}")

    bad("hidden", b.hidden, cfg.hidden_size)
    for i, s in enumerate(b.layers):
        if not s.enabled:
            continue
        if s.kind == "M":
            bad("Mamba channels", s.mamba_heads * cfg.mamba_head_dim, cfg.mamba_d_inner, i)
        elif s.kind == "*":
            bad("attention channels", s.attention_heads * cfg.head_dim, cfg.num_attention_heads * cfg.head_dim, i)
        elif s.kind == "E":
            bad("expert_channels", s.expert_channels, cfg.moe_intermediate_size, i)
            bad("shared_channels", s.shared_channels, cfg.moe_shared_expert_intermediate_size, i)
        elif s.kind == "-":
            bad("mlp_channels", s.mlp_channels, cfg.intermediate_size, i)


def read_budgets(cfg: NemotronHConfig, where: str = "config.json") -> dict[str, Budget]:
    """The budgets a checkpoint directory holds, largest first (its config's elastic table). A plain
    Nemotron-H checkpoint, or a slice of one budget, holds one: "full", the sizes its file stores."""
    table = cfg.raw.get("elastic")
    if not table:
        return {"full": stored_budget(cfg)}
    version = table.get("format_version")
    if version != FORMAT_VERSION:
        raise BudgetTableError(f"{where}: elastic format_version {version!r}; this runner reads {FORMAT_VERSION}")
    budgets = [parse_budget(cfg, e, where) for e in table.get("budgets", [])]
    if not budgets:
        raise BudgetTableError(f"{where}: the elastic table lists no budgets")
    names = [b.name for b in budgets]
    if len(set(names)) != len(names):
        raise BudgetTableError(f"{where}: budget names repeat: {names}")
    budgets.sort(key=lambda b: -count_params(cfg, b)[0])
    for big, small in zip(budgets, budgets[1:]):
        if not small.fits_in(big):
            raise BudgetTableError(f"{where}: budget {small.name!r} is not nested in {big.name!r} "
                                   "(every axis of a smaller budget must be a prefix of a larger one's)")
    return {b.name: b for b in budgets}
