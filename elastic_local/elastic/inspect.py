"""What a checkpoint directory holds, from its config and safetensors headers (no weights are read)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from ..checkpoint.files import CheckpointError, index_tensors
from ..checkpoint.offers import offers
from ..model import gemv, kernels, pages
from ..model.budget import count_params
from ..model.config import BLOCK_KINDS, NemotronHConfig
from ..model.cost import NATIVE_CAPABILITY, runs_natively
from ..model.schema import DTYPE_BYTES, stored_budget
from ..quant.scheme import PRECISIONS, read_quant_config
from .table import budget_entry, read_budgets


def describe(path: str | Path) -> dict:
    """The `info --json` contract. Budget bytes are those `fit` plans with (`checkpoint.offers`): one entry
    per precision the directory can be loaded in, None for one it cannot."""
    path = Path(path)
    cfg = NemotronHConfig.from_dir(path)
    total, active = count_params(cfg, stored_budget(cfg))
    precision = read_quant_config(path)[0]
    budgets = read_budgets(cfg, where=str(path / "config.json"))
    available = {o.precision: o for o in offers(path, cfg)}
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
        "precision": precision,
        "offers": {p: o.source for p, o in available.items()},
        "budgets": [{**budget_entry(cfg, b), "bytes": {p: available[p].resident_bytes(cfg, b) if p in available
                                                       else None for p in PRECISIONS}} for b in budgets.values()],
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
            "stored_dtype": max(by_dtype, key=by_dtype.__getitem__) if by_dtype else None,
            "params_in_files": sum(info.nbytes // DTYPE_BYTES[info.dtype] for name, info in tensors.items()
                                   if not name.startswith("mtp.")),
        }
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out["kernels"] = {"device": device, **kernels.describe(device), "linear": _linear_kernel(precision, device),
                      "decode_step": _decode_step(device)}
    if device == "cpu" and precision in available:
        largest = next(iter(budgets.values()))
        out["kernels"]["weights"] = pages.describe(available[precision].resident_bytes(cfg, largest))
    return out


def _decode_step(device: str) -> str:
    """What runs a one-token decode step by default on `device` (engine/load.py, model/nemotron_h.py)."""
    if device == "cuda":
        return "CUDA graphs, one per budget and cache (--no-cuda-graphs: eager)"
    if gemv.library() is not None:
        return ("in C (model/step.c): one call per token, for one sequence or a batch's rows (each weight read "
                "once for all of them); a prompt of up to 64 tokens as the rows of one call")
    return "torch (eager)"


def _bf16_prompts() -> str:
    """How a bfloat16 load's prompt products run on this CPU (model/gemv.py, bf16_dot)."""
    if gemv.bf16_dot():
        return "a bfloat16 load's prompts on the CPU's bf16 dot products (AVX512-BF16)"
    return "a bfloat16 load's prompts widened to float32 FMAs (no AVX512-BF16 dots here)"


def _linear_kernel(precision: str, device: str) -> str:
    """The matmul path the stored precision takes on `device`, by the gates the runtime uses
    (quant/linear.py, model/cost.py): the ones `fit` plans with."""
    dev = torch.device(device)
    cpu_decode = dev.type == "cpu" and gemv.library() is not None  # model/gemv.py: x86 CPUs with a C compiler
    if precision == "bf16":
        return ("dense (weights kept in column panels, a BF16 file's in bf16: decode in C, model/step.c on "
                f"model/gemv.c, prompts on gemv.c's tiles over the same panels; {_bf16_prompts()})") if cpu_decode \
            else "dense (oneDNN / cuBLAS)"
    k = kernels.active()
    cap = k.capability(dev) if k.op("scaled_mm", dev) is not None else None
    if runs_natively(precision, cap):
        return f"{precision} scaled_mm (compute capability {cap[0]}.{cap[1]})"
    if cpu_decode:
        layout = " FP8 codes kept in column panels;" if precision == "fp8" else ""
        return (f"dequantize in registers (model/gemv.c):{layout} a row of x at a time for decode, into panels for "
                f"a prompt's rows (up to {gemv.MAX_PACKED_ROWS} a call; {_bf16_prompts()})")
    need = NATIVE_CAPABILITY[precision]
    return f"dequantize inside the matmul ({precision} needs compute capability {need[0]}.{need[1]}+ to run natively)"
