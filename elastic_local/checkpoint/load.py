"""Load a Nemotron-H checkpoint directory into the network, streaming tensor by tensor.

Only the slices of the resident budget are read (memory-mapped), converted to the compute dtype and
moved to the device one tensor at a time, so peak memory stays near the resident model plus one
tensor: a 63 GB BF16 parent never needs twice its size. Grouped heads are reordered rank-major on
the way in (model/layout.py); the file keeps the hub layout every other loader expects.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..model.attention import AttentionWeights
from ..model.budget import Budget, check_budget
from ..model.config import NemotronHConfig
from ..model.layout import head_channels, mamba_rows, rank_major_heads
from ..model.linear import RowConcat
from ..model.mamba2 import MambaWeights
from ..model.moe import MLPWeights, MoEWeights
from ..model.nemotron_h import Layer, NemotronH
from ..model.schema import keeps_fp32, stored_budget
from ..progress import Progress
from ..quant.fp8 import FP8Weight
from ..quant.linear import QuantizedWeight
from ..quant.nvfp4 import NVFP4Weight
from ..quant.scheme import GROUP_SIZE, PRECISIONS, is_linear, is_quantized, quantize, read_quant_config
from .files import CheckpointError, Reader, checkpoint_tensors
from .verify import check_tensors, stored_layout

log = logging.getLogger(__name__)


def _block_index(ch: torch.Tensor, what: str) -> torch.Tensor:
    """Channel indices that come in whole, aligned blocks of 16 -> the block indices."""
    blocks = ch.view(-1, GROUP_SIZE)
    first = blocks[:, 0]
    if ch.numel() % GROUP_SIZE or first.remainder(GROUP_SIZE).any() or \
            not torch.equal(blocks, first[:, None] + torch.arange(GROUP_SIZE)):
        raise CheckpointError(f"{what}: its heads are not whole {GROUP_SIZE}-channel blocks, so the quantized "
                              "columns cannot be reordered at load; load this checkpoint as bf16")
    return first // GROUP_SIZE


def _owned(t: torch.Tensor, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous copy on `device` (converted once to `dtype`): holds no view of the memory-mapped file."""
    return t.to(device, dtype or t.dtype, copy=True, memory_format=torch.contiguous_format)


def read_quantized(reader: Reader, name: str, precision: str, rows, cols, device) -> QuantizedWeight:
    """rows / cols of a stored FP8 or NVFP4 Linear (ints are prefixes, tensors indices)."""
    stem = name[: -len(".weight")]

    def scalar(key: str) -> torch.Tensor:
        return _owned(reader.read(f"{stem}.{key}").float().reshape(()), device)

    if precision == "fp8":
        return FP8Weight(_owned(reader.read(name, rows, cols), device), scalar("weight_scale"), scalar("input_scale"))
    if isinstance(cols, int):
        if cols % GROUP_SIZE:
            raise CheckpointError(f"{name}: cut at {cols} inputs, not a multiple of {GROUP_SIZE}")
        packed_cols, scale_cols = cols // 2, cols // GROUP_SIZE
    else:
        scale_cols = _block_index(cols, name)
        packed_cols = (scale_cols[:, None] * (GROUP_SIZE // 2) + torch.arange(GROUP_SIZE // 2)).reshape(-1)
    return NVFP4Weight(_owned(reader.read(name, rows, packed_cols), device),
                       _owned(reader.read(f"{stem}.weight_scale", rows, scale_cols), device),
                       scalar("weight_scale_2"), scalar("input_scale"))


def load_network(path: str | Path, resident: Budget | None = None, stored: Budget | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 progress: Progress | None = None, precision: str | None = None,
                 keep: tuple[str, ...] = (), linear_dtype: torch.dtype | None = None) -> NemotronH:
    """Read the weights of `resident` (default: everything stored) into a NemotronH on `device`.

    `precision` None keeps what the file stores; "fp8" / "nvfp4" from a BF16 file quantize each Linear
    as it is read (peak memory: the quantized model plus one tensor), `keep` naming modules to leave
    alone; "bf16" from a quantized file dequantizes to `dtype`. `linear_dtype`: the dtype of the Linear
    weights and LM head the file stores in BF16 (`quant.scheme.is_linear`), where not `dtype`: engine.load
    keeps them bf16 in a float32 CPU load (half the memory; the C kernels widen them exactly)."""
    path = Path(path)
    cfg = NemotronHConfig.from_dir(path)
    stored = stored or stored_budget(cfg)
    resident = resident or stored
    check_budget(cfg, resident)
    if not resident.fits_in(stored):
        raise CheckpointError(f"{path}: budget {resident.name!r} is larger than what the file stores")
    stored_precision, kept = read_quant_config(path)
    precision = precision or stored_precision
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {list(PRECISIONS)}")
    if stored_precision != "bf16" and precision not in (stored_precision, "bf16"):
        raise CheckpointError(f"{path} stores {stored_precision.upper()} weights; load it as {stored_precision!r} "
                              f"or as 'bf16' (dequantized), not {precision!r}")
    tensors = checkpoint_tensors(path)
    check_tensors(path, tensors, stored_layout(cfg, stored, stored_precision, kept), cfg.raw)
    reader = Reader(tensors)
    log.info("weights: %s stored, %s resident", stored_precision, precision)

    def get(name: str, *index) -> torch.Tensor:
        # a fresh, contiguous copy: a zero-copy view would keep the file's pages (whole rows of a column
        # prefix) mapped and counted, and strided weights take the slow matmul path
        to = torch.float32 if keeps_fp32(name) else dtype
        if linear_dtype is not None and is_linear(name) and reader.info(name).dtype == "BF16":
            to = linear_dtype
        return _owned(reader.read(name, *index), device, to)

    def get_linear(name: str, rows, cols):
        """A Linear weight as this run keeps it: a tensor, or a quantized weight (stored, or quantized now
        with the full stored tensor's scale, so every budget's slice stays the parent's sub-block)."""
        if stored_precision != "bf16" and is_quantized(name, kept):
            q = read_quantized(reader, name, stored_precision, rows, cols, device)
            return q.dequantize(dtype) if precision == "bf16" else q
        if precision == "bf16" or not is_quantized(name, kept if stored_precision != "bf16" else keep):
            return get(name, rows, cols)  # left in high precision: by this load's `keep` or the file's exclusions
        raw = reader.read(name, rows, cols)
        whole = tuple(raw.shape) == reader.info(name).shape  # all of it, maybe reordered: same amax
        lo, hi = torch.aminmax(raw if whole else reader.read(name))  # exact in any dtype, no float copy
        amax = torch.maximum(-lo, hi).float()
        return quantize(raw.to(device), precision, name, amax)

    d = resident.hidden
    G, p, KV = cfg.n_groups, cfg.mamba_head_dim, cfg.num_key_value_heads
    total = len(resident.layers) + 2
    if progress:
        progress(0, total, "embeddings")
    embed = get("embeddings.weight", cfg.vocab_size, d)
    layers: list[Layer] = []
    for i, (s, st) in enumerate(zip(resident.layers, stored.layers)):
        m = f"layers.{i}.mixer."
        if not s.enabled:
            layers.append(Layer(s.kind, torch.empty(0), None))
            continue
        if s.kind == "M":
            heads = rank_major_heads(st.mamba_heads, G, s.mamba_heads // G)
            ch = head_channels(heads, p)
            rows, conv_rows = mamba_rows(heads, st.mamba_heads, cfg)
            conv_w = get(m + "conv1d.weight", conv_rows)[:, 0]
            mixer = MambaWeights(
                in_proj=get_linear(m + "in_proj.weight", rows, d),
                conv_weight=conv_w,
                conv_bias=get(m + "conv1d.bias", conv_rows) if cfg.use_conv_bias else None,
                dt_bias=get(m + "dt_bias", heads),
                A=-torch.exp(get(m + "A_log", heads)),
                D=get(m + "D", heads),
                norm=get(m + "norm.weight", ch),
                out_proj=get_linear(m + "out_proj.weight", d, ch),
            )
        elif s.kind == "*":
            heads = rank_major_heads(st.attention_heads, KV, s.attention_heads // KV)
            ch = head_channels(heads, cfg.head_dim)
            parts = [get_linear(m + "q_proj.weight", ch, d), get_linear(m + "k_proj.weight", KV * cfg.head_dim, d),
                     get_linear(m + "v_proj.weight", KV * cfg.head_dim, d)]
            qkv = torch.cat(parts) if all(isinstance(t, torch.Tensor) for t in parts) else RowConcat(parts)
            mixer = AttentionWeights(qkv, get_linear(m + "o_proj.weight", d, ch))
        elif s.kind == "E":
            E, I = s.experts, s.expert_channels
            up = [get_linear(m + f"experts.{j}.up_proj.weight", I, d) for j in range(E)]
            down = [get_linear(m + f"experts.{j}.down_proj.weight", d, I) for j in range(E)]
            if isinstance(up[0], torch.Tensor):  # plain experts stack into [E, I, D] and [E, D, I]
                up, down = torch.stack(up), torch.stack(down)
            S = s.shared_channels
            mixer = MoEWeights(
                gate=get(m + "gate.weight", E, d),
                bias=get(m + "gate.e_score_correction_bias", E),
                up=up, down=down,
                shared_up=get_linear(m + "shared_experts.up_proj.weight", S, d),
                shared_down=get_linear(m + "shared_experts.down_proj.weight", d, S),
            )
        else:
            mixer = MLPWeights(get_linear(m + "up_proj.weight", s.mlp_channels, d),
                               get_linear(m + "down_proj.weight", d, s.mlp_channels))
        layers.append(Layer(s.kind, get(f"layers.{i}.norm.weight", d), mixer))
        if progress:
            progress(i + 1, total, f"layer {i} ({s.kind})")
    norm_f = get("norm_f.weight", d)
    lm_head = embed if cfg.tie_word_embeddings else get("lm_head.weight", cfg.vocab_size, d)
    if progress:
        progress(total, total, "done")
    return NemotronH(cfg, resident, embed, layers, norm_f, lm_head)
