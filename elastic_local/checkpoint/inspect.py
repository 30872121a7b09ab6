"""What a checkpoint directory holds, from its config and safetensors headers (no weights are read)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from ..model import kernels
from ..model.budget import Budget, count_params
from ..model.config import BLOCK_KINDS, NemotronHConfig
from .files import DTYPE_BYTES, CheckpointError, index_tensors


def describe(path: str | Path) -> dict:
    path = Path(path)
    cfg = NemotronHConfig.from_dir(path)
    full = Budget.full(cfg)
    total, active = count_params(cfg, full)
    out: dict = {
        "path": str(path),
        "config": {k: cfg.raw.get(k) for k in ("vocab_size", "hidden_size", "num_attention_heads",
                                                 "num_key_value_heads", "head_dim", "mamba_num_heads",
                                                 "mamba_head_dim", "n_groups", "ssm_state_size", "n_routed_experts",
                                                 "num_experts_per_tok", "moe_intermediate_size",
                                                 "moe_shared_expert_intermediate_size", "intermediate_size")},
        "pattern": cfg.pattern,
        "layers": {BLOCK_KINDS[k]: n for k, n in Counter(cfg.pattern).items()},
        "params": total,
        "active_params": active,
        "budgets": [{"name": full.name, "params": total, "active_params": active}],
    }
    try:
        tensors = index_tensors(path)
    except CheckpointError as e:
        out["weights"] = None
        out["weights_note"] = str(e)
    else:
        by_dtype: Counter[str] = Counter()
        for info in tensors.values():
            by_dtype[info.dtype] += info.nbytes
        files = {info.file for info in tensors.values()}
        out["weights"] = {
            "files": len(files),
            "bytes_on_disk": sum(f.stat().st_size for f in files),
            "tensor_bytes_by_dtype": dict(by_dtype),
            "params_in_files": sum(info.nbytes // DTYPE_BYTES[info.dtype] for name, info in tensors.items()
                                   if not name.startswith("mtp.")),
        }
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out["kernels"] = {"device": device, **kernels.describe(device)}
    return out

