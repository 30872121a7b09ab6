"""Writing a checkpoint as a selection of another's channels, heads, experts and layers.

Nesting and slicing are the same operation seen twice: nesting selects *every* unit in importance
order (a function-preserving permutation), slicing selects a budget's *prefix* of units (a smaller
model). A Selection says, for each output position, which source unit it takes; `select_plan` lists
the output tensors and `materialize` reads each one (quantized Linears with their scales) when it is
written, so only one tensor is in memory at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..checkpoint.files import Reader
from ..checkpoint.load import read_quantized
from ..model.config import NemotronHConfig
from ..model.layout import head_channels, mamba_rows
from ..quant.scheme import is_quantized


@dataclass
class LayerSelection:
    source: int  # the source layer this output layer comes from
    heads: torch.Tensor | None = None  # M: Mamba heads; *: query heads (source indices, group-major)
    experts: torch.Tensor | None = None  # E: source experts
    channels: list[torch.Tensor] | torch.Tensor | None = None  # E: per output expert; -: MLP channels
    shared: torch.Tensor | None = None  # E: shared expert channels


@dataclass
class Selection:
    hidden: torch.Tensor  # source embedding channel of each output channel
    layers: list[LayerSelection]  # output layers, in order (dropped layers are absent)


def _prefix_len(idx: torch.Tensor) -> int | None:
    n = idx.numel()
    return n if torch.equal(idx, torch.arange(n)) else None


Request = tuple[str, str, "torch.Tensor | int | None", "torch.Tensor | None"]


def _index(ix: torch.Tensor | int | None, full: int) -> torch.Tensor | int:
    """None -> everything; an index tensor that is a prefix -> its length; else the tensor."""
    if ix is None:
        return full
    if isinstance(ix, torch.Tensor):
        return _prefix_len(ix) or ix
    return ix


def _req(name: str, rows: torch.Tensor | int | None, cols: torch.Tensor | None = None) -> tuple:
    return name, rows, cols


def take(reader: Reader, name: str, rows: torch.Tensor | int | None, cols: torch.Tensor | None = None) -> torch.Tensor:
    """tensor[rows][:, cols], reading contiguous prefixes as slices and only the needed bytes."""
    info = reader.info(name)
    rows = info.shape[0] if rows is None else rows
    if isinstance(rows, torch.Tensor) and (n := _prefix_len(rows)) is not None:
        rows = n
    if cols is None:
        return reader.read(name, rows)
    n = _prefix_len(cols)
    if n is not None:
        return reader.read(name, rows, n)
    if isinstance(rows, int):
        return reader.read(name, rows, cols)
    return reader.read(name, rows).index_select(1, cols)


def select_plan(cfg: NemotronHConfig, sel: Selection, stored_heads: list[int | None]) -> Iterator[Request]:
    """What the selected checkpoint holds: (hub name, source name, rows, cols) per logical tensor.
    `stored_heads[i]` is the number of Mamba or query heads source layer i stores (they fix where the
    x, B, C and dt rows of in_proj begin)."""
    P = sel.hidden
    V = cfg.vocab_size
    p, hd = cfg.mamba_head_dim, cfg.head_dim
    yield "backbone.embeddings.weight", _req("embeddings.weight", V, P)
    for j, ls in enumerate(sel.layers):
        src, out = f"layers.{ls.source}.", f"backbone.layers.{j}."
        kind = cfg.pattern[ls.source]
        yield out + "norm.weight", _req(src + "norm.weight", P)
        m, o = src + "mixer.", out + "mixer."
        if kind == "M":
            ch = head_channels(ls.heads, p)
            rows, conv_rows = mamba_rows(ls.heads, stored_heads[ls.source], cfg)
            yield o + "in_proj.weight", _req(m + "in_proj.weight", rows, P)
            yield o + "conv1d.weight", _req(m + "conv1d.weight", conv_rows)
            if cfg.use_conv_bias:
                yield o + "conv1d.bias", _req(m + "conv1d.bias", conv_rows)
            for name in ("dt_bias", "A_log", "D"):
                yield o + name, _req(m + name, ls.heads)
            yield o + "norm.weight", _req(m + "norm.weight", ch)
            yield o + "out_proj.weight", _req(m + "out_proj.weight", P, ch)
        elif kind == "*":
            ch = head_channels(ls.heads, hd)
            yield o + "q_proj.weight", _req(m + "q_proj.weight", ch, P)
            yield o + "k_proj.weight", _req(m + "k_proj.weight", None, P)
            yield o + "v_proj.weight", _req(m + "v_proj.weight", None, P)
            yield o + "o_proj.weight", _req(m + "o_proj.weight", P, ch)
        elif kind == "E":
            yield o + "gate.weight", _req(m + "gate.weight", ls.experts, P)
            yield o + "gate.e_score_correction_bias", _req(m + "gate.e_score_correction_bias", ls.experts)
            for e_out, e_src in enumerate(ls.experts.tolist()):
                c = ls.channels[e_out]
                yield o + f"experts.{e_out}.up_proj.weight", _req(m + f"experts.{e_src}.up_proj.weight", c, P)
                yield o + f"experts.{e_out}.down_proj.weight", _req(m + f"experts.{e_src}.down_proj.weight",
                                                                     P, c)
            yield o + "shared_experts.up_proj.weight", _req(m + "shared_experts.up_proj.weight", ls.shared, P)
            yield o + "shared_experts.down_proj.weight", _req(m + "shared_experts.down_proj.weight",
                                                               P, ls.shared)
        else:
            yield o + "up_proj.weight", _req(m + "up_proj.weight", ls.channels, P)
            yield o + "down_proj.weight", _req(m + "down_proj.weight", P, ls.channels)
    yield "backbone.norm_f.weight", _req("norm_f.weight", P)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", _req("lm_head.weight", V, P)


def materialize(reader: Reader, out_name: str, req: tuple, precision: str = "bf16",
                kept: list[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """The stored tensors of one request: the tensor itself, or a quantized Linear's weight and scales
    cut to the same logical rows and columns (whole NVFP4 blocks, so the cut is exact)."""
    src, rows, cols = req
    if precision == "bf16" or not is_quantized(src, kept):
        yield out_name, take(reader, src, rows, cols)
        return
    out, k = reader.info(src).shape
    q = read_quantized(reader, src, precision, _index(rows, out), _index(cols, k * (2 if precision == "nvfp4" else 1)),
                       "cpu")
    stem = out_name[: -len(".weight")]
    yield out_name, q.weight
    yield f"{stem}.weight_scale", q.weight_scale
    if precision == "nvfp4":
        yield f"{stem}.weight_scale_2", q.weight_scale_2
    yield f"{stem}.input_scale", q.input_scale
