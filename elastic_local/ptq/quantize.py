"""`elastic-local quantize`: post-training quantization of a nested BF16 checkpoint to FP8 or NVFP4.

Weights are quantized tensor by tensor in the file's own layout (whole tensors, so each keeps one
per-tensor scale and every budget's prefix is an exact sub-block); activation scales come from one
calibration pass of the full model. The output is a nested checkpoint in NVIDIA Model Optimizer's
layout: `hf_quant_config.json`, a `quantization_config` in config.json, and the budget table as it was.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..checkpoint.files import Reader, checkpoint_tensors
from ..checkpoint.load import load_network
from ..checkpoint.write import CheckpointWriter, check_output
from ..elastic.importance import calibration_ids
from ..elastic.select import select_plan, take
from ..elastic.slice import prefix_selection
from ..elastic.table import read_budgets
from ..model.config import NemotronHConfig
from ..model.schema import expected_shapes, keeps_fp32, stored_budget
from ..progress import Progress
from ..quant.fp8 import E4M3_MAX
from ..quant.nvfp4 import E2M1_MAX
from ..quant.scheme import GROUP_SIZE, QUANT_ALGO, is_quantized, module_of, nano_keep, quantize, read_quant_config
from ..version import __version__
from .calibrate import input_amax

log = logging.getLogger(__name__)


def exclude_modules(cfg: NemotronHConfig, keep: list[str]) -> list[str]:
    """Real module names left in high precision: lm_head, the embedding, each router and conv1d, and every
    Linear a --keep pattern holds back. Each names a module that exists in the checkpoint."""
    out = ["backbone.embeddings", "lm_head"]
    for i, kind in enumerate(cfg.pattern):
        if kind == "E":
            out.append(f"backbone.layers.{i}.mixer.gate")
        if kind == "M":
            out.append(f"backbone.layers.{i}.mixer.conv1d")
    for name in expected_shapes(cfg, stored_budget(cfg)):
        if name.endswith(".weight") and module_of(name) not in out and not is_quantized(name, keep) \
                and is_quantized(name):
            out.append(module_of(name))
    return out


def split_head_modules(cfg: NemotronHConfig) -> list[str]:
    """Linears whose input columns the loader reorders head by head (Mamba out_proj, attention o_proj; see
    model/layout.py): with several groups of heads narrower than a 16-wide NVFP4 block, packed columns
    cannot be reordered, so NVFP4 leaves those modules in BF16."""
    out = []
    for i, s in enumerate(stored_budget(cfg).layers):
        if s.kind == "M":
            heads, groups, width, name = s.mamba_heads, cfg.n_groups, cfg.mamba_head_dim, "out_proj"
        elif s.kind == "*":
            heads, groups, width, name = s.attention_heads, cfg.num_key_value_heads, cfg.head_dim, "o_proj"
        else:
            continue
        if s.enabled and groups > 1 and heads // groups > 1 and width % GROUP_SIZE:
            out.append(f"backbone.layers.{i}.mixer.{name}")
    return out


def quantize_checkpoint(src: str | Path, out: str | Path, precision: str, calib: str | Path | None = None,
                        keep: tuple[str, ...] = (), preset: str | None = None, device: str = "cpu",
                        max_tokens: int = 4096, seq_len: int = 512, progress: Progress | None = None,
                        overwrite: bool = False) -> Path:
    src = Path(src)
    check_output(out, overwrite, [src])  # before the calibration pass
    if precision not in QUANT_ALGO:
        raise ValueError(f"--precision {precision!r}: choose from {sorted(QUANT_ALGO)}")
    cfg = NemotronHConfig.from_dir(src)
    if read_quant_config(src)[0] != "bf16":
        raise ValueError(f"{src} is already quantized; quantize its BF16 original")
    if cfg.raw.get("elastic"):
        read_budgets(cfg, where=str(src / "config.json"))  # every budget's cuts must be 16-aligned
    if preset not in (None, "nano"):
        raise ValueError(f"unknown preset {preset!r}; known: nano (attention layers and the Mamba layers feeding "
                         "them stay BF16)")
    keep_list = list(keep) + (nano_keep(cfg) if preset == "nano" else [])
    split = split_head_modules(cfg) if precision == "nvfp4" else []
    if split:
        log.warning("%d module(s) stay BF16: their heads (%s) are narrower than an NVFP4 block and are regrouped "
                    "at load", len(split), ", ".join(split))
        keep_list += split
    if calib is None:
        log.warning("no --calib file: activation scales from a generic sample")

    net = load_network(src, device=device, dtype=torch.float32, progress=progress)
    ids, source = calibration_ids(calib, src, cfg.vocab_size, max_tokens)
    amax = input_amax(net, [ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) > 1])
    del net
    act_max = E4M3_MAX if precision == "fp8" else E2M1_MAX * E4M3_MAX

    reader = Reader(checkpoint_tensors(src))
    full = stored_budget(cfg)
    everything = prefix_selection(cfg, full, full)  # the whole model, unchanged
    plan = list(select_plan(cfg, everything, [s.mamba_heads or s.attention_heads or None for s in full.layers]))
    excluded = exclude_modules(cfg, keep_list)
    q = {"quant_algo": QUANT_ALGO[precision], "kv_cache_quant_algo": None, "group_size": GROUP_SIZE,
         "exclude_modules": excluded}
    config = dict(cfg.raw)
    config["quantization_config"] = {"quant_method": "modelopt", **q}
    with CheckpointWriter(out, overwrite=overwrite, sources=[src]) as w:
        for k, (name, req) in enumerate(plan):
            src_name = req[0]
            t = take(reader, *req)
            if not is_quantized(src_name, keep_list):
                if keeps_fp32(src_name):
                    t = t.float()
                w.add(name, t)
            else:
                qw = quantize(t, precision, src_name)
                stem = name[: -len(".weight")]
                w.add(name, qw.weight)
                w.add(f"{stem}.weight_scale", qw.weight_scale.reshape(qw.weight_scale.shape))
                if precision == "nvfp4":
                    w.add(f"{stem}.weight_scale_2", qw.weight_scale_2.reshape(()))
                w.add(f"{stem}.input_scale", torch.tensor(max(amax.get(src_name, 0.0), 1e-12) / act_max))
            if progress:
                progress(k + 1, len(plan), name)
        w.write_json("config.json", config)
        w.write_json("hf_quant_config.json", {"producer": {"name": "elastic-local", "version": __version__},
                                              "quantization": q, "calibration": {"source": source,
                                                                                 "tokens": len(ids)}})
        w.carry(src)
        return w.close()
