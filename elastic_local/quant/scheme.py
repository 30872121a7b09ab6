"""Which tensors a precision quantizes, what it stores for them, and what it costs in bytes.

Model Optimizer's layout (SPEC §5): a quantized Linear `X.weight` becomes
    FP8:   X.weight float8_e4m3fn [out, in],  X.weight_scale f32 [],  X.input_scale f32 []
    NVFP4: X.weight uint8 [out, in/2],  X.weight_scale float8_e4m3fn [out, in/16],
           X.weight_scale_2 f32 [],  X.input_scale f32 []
Everything else stays in high precision: embeddings, lm_head, conv1d, norms, A_log, D, dt_bias and
the router (fp32). `exclude_modules` lists the real module names kept that way.
"""

from __future__ import annotations

import fnmatch
import functools
import re

from ..model.budget import Budget
from ..model.config import NemotronHConfig
from ..model.schema import DTYPE_BYTES, expected_shapes, keeps_fp32

PRECISIONS = ("bf16", "fp8", "nvfp4")
QUANT_ALGO = {"fp8": "FP8", "nvfp4": "NVFP4"}
GROUP_SIZE = 16
_LINEAR = re.compile(r"^layers\.\d+\.mixer\.(in_proj|out_proj|[qkvo]_proj|up_proj|down_proj|"
                     r"experts\.\d+\.(up|down)_proj|shared_experts\.(up|down)_proj)\.weight$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def module_of(name: str) -> str:
    """Hub module name of a canonical tensor name: layers.3.mixer.in_proj.weight -> backbone.layers.3.mixer.in_proj."""
    stem = name.rsplit(".", 1)[0]
    return stem if stem == "lm_head" else f"backbone.{stem}"


def nano_keep(cfg: NemotronHConfig) -> list[str]:
    """NVIDIA's conservative Nano recipe: attention layers and the Mamba layers feeding them stay BF16."""
    keep = []
    for i, kind in enumerate(cfg.pattern):
        if kind == "*":
            keep.append(f"backbone.layers.{i}.mixer.*")
            j = i - 1
            while j >= 0 and cfg.pattern[j] != "M":
                j -= 1
            if j >= 0:
                keep.append(f"backbone.layers.{j}.mixer.*")
    return keep


def is_linear(name: str) -> bool:
    """Whether canonical tensor `name` is a Linear weight or the LM head: what a float32 load on a CPU with
    the C kernels keeps in bf16 where the file stores BF16 (engine.load; the kernels widen it as they read)."""
    return bool(_LINEAR.match(name)) or name == "lm_head.weight"


@functools.lru_cache(maxsize=64)
def kept_modules(keep: tuple[str, ...]) -> re.Pattern:
    """`keep`'s globs as one pattern: a stored file's list names hundreds of modules, and a fit plan asks
    about every tensor of every budget and precision (one fnmatch per glob took seconds on the 30B)."""
    return re.compile("|".join(fnmatch.translate(k) for k in keep) if keep else "(?!)")  # (?!): matches nothing


def is_quantized(name: str, keep: list[str] | tuple[str, ...] | re.Pattern = ()) -> bool:
    """Whether canonical tensor `name` is a Linear weight that a quantized precision stores quantized;
    `keep`: module globs kept in high precision, or `kept_modules` of them."""
    if not _LINEAR.match(name):
        return False
    kept = keep if isinstance(keep, re.Pattern) else kept_modules(tuple(keep))
    return not kept.match(module_of(name))


def stored_tensors(name: str, shape: tuple[int, ...], precision: str,
                   keep: list[str] | tuple[str, ...] | re.Pattern = ()) -> dict:
    """{tensor name: (safetensors dtype, shape)} that `precision` stores for one logical tensor."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {list(PRECISIONS)}")
    if precision == "bf16" or not is_quantized(name, keep):
        return {name: ("F32" if keeps_fp32(name) else "BF16", shape)}
    stem = name[: -len(".weight")]
    out, k = shape
    if precision == "fp8":
        return {name: ("F8_E4M3", shape), f"{stem}.weight_scale": ("F32", ()), f"{stem}.input_scale": ("F32", ())}
    return {name: ("U8", (out, k // 2)), f"{stem}.weight_scale": ("F8_E4M3", (out, k // GROUP_SIZE)),
            f"{stem}.weight_scale_2": ("F32", ()), f"{stem}.input_scale": ("F32", ())}


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= d
    return n


def weight_bytes(cfg: NemotronHConfig, budget: Budget, precision: str, keep: list[str] = (),
                 active: bool = False, float32: bool = False, bf16_linears: bool = False) -> int:
    """Exact bytes of a budget's weights at a precision: the sum of the tensors its file would hold.
    `active`: only what one decoded token reads (the top-k routed experts, one embedding row). `float32`:
    as a float32 load keeps them (the BF16 tensors in float32; packed ones as they are), with
    `bf16_linears` its Linear weights and LM head in bf16 (on a CPU with the C kernels: `is_linear`)."""
    total, keep = 0, kept_modules(tuple(keep))
    for name, shape in expected_shapes(cfg, budget).items():
        expert = _EXPERT.search(name) if active else None
        if expert and int(expert.group(1)) >= cfg.num_experts_per_tok:
            continue
        for dtype, s in stored_tensors(name, shape, precision, keep).values():
            if float32 and dtype == "BF16" and not (bf16_linears and is_linear(name)):
                dtype = "F32"
            total += _nbytes(dtype, s[1:] if active and name == "embeddings.weight" else s)
    return total


def read_quant_config(path) -> tuple[str, list[str]]:
    """(stored precision, modules kept in high precision) of a checkpoint directory."""
    import json
    from pathlib import Path

    file = Path(path) / "hf_quant_config.json"
    if not file.is_file():
        return "bf16", []
    q = json.loads(file.read_text()).get("quantization", {})
    algo = q.get("quant_algo")
    by_algo = {v: k for k, v in QUANT_ALGO.items()}
    if algo not in by_algo:
        raise ValueError(f"{file}: quant_algo {algo!r} is not supported; this runner reads {sorted(by_algo)}")
    if algo == "NVFP4" and q.get("group_size", GROUP_SIZE) != GROUP_SIZE:
        raise ValueError(f"{file}: NVFP4 group_size {q.get('group_size')} is not {GROUP_SIZE}")
    return by_algo[algo], list(q.get("exclude_modules") or [])


def quantize(w, precision: str, name: str, amax=None):
    """Quantize a weight; `amax` (of the full stored tensor) fixes the per-tensor scale, so that a slice
    quantized now equals the same slice of the whole tensor quantized."""
    from .fp8 import E4M3_MAX, quantize_fp8
    from .nvfp4 import E2M1_MAX, quantize_nvfp4

    given = amax is not None and float(amax) > 0
    if precision == "fp8":
        return quantize_fp8(w, name, amax.float() / E4M3_MAX if given else None)
    if precision == "nvfp4":
        return quantize_nvfp4(w, amax.float() / (E2M1_MAX * E4M3_MAX) if given else None, name)
    raise ValueError(f"cannot quantize to {precision!r}")
