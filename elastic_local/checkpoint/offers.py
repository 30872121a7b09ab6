"""What a checkpoint directory can be loaded as, and how many bytes each form keeps resident.

One place for the fact both `info` and `fit` print, so the two never disagree:
- a BF16 file (or any unquantized float file: it is cast to bf16 while loading): bf16 "stored", fp8 and
  nvfp4 by "load-time quantization" of it;
- an FP8 or NVFP4 file (its `hf_quant_config.json` says which, as the loader reads it): that precision
  only; bf16 is not offered (dequantizing gains nothing but memory use), nor another quantized format;
- a config-only directory (no weights, e.g. the shipped Star Elastic description): bf16 is "stored";
  fp8/nvfp4 are "stored" where a `release.json` beside config.json lists a published file for them (with
  the modules it keeps in BF16), else "load-time quantization".

For a stored quantized file the modules kept in high precision are read from the safetensors headers, not
from `exclude_modules` (modelopt 0.47 writes corrupted entries, SPEC section 5).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..model.budget import Budget
from ..model.config import NemotronHConfig
from ..quant.scheme import PRECISIONS, is_quantized, module_of, read_quant_config, weight_bytes
from .files import CheckpointError, TensorInfo, checkpoint_tensors
from .verify import verify_tensors

QUANT_DTYPES = {"U8", "F8_E4M3"}  # what a quantized Linear weight is stored as (NVFP4 packed bytes, FP8)


@dataclasses.dataclass(frozen=True)
class Offer:
    """One precision a directory can be loaded in."""

    precision: str
    source: str  # "stored" | "load-time quantization"
    keep: tuple[str, ...] = ()  # module globs kept in high precision (Model Optimizer's exclude_modules)

    def resident_bytes(self, cfg: NemotronHConfig, b: Budget, keep: tuple[str, ...] = (),
                       active: bool = False, float32: bool = False, bf16_linears: bool = False) -> int:
        """Bytes budget `b` keeps resident in this form (`active`: read per decoded token; `float32`: loaded
        for float32 compute, `bf16_linears` its Linear weights kept bf16 as on a CPU with the C kernels);
        `keep` names the modules a load-time quantization leaves in BF16 (a stored file's own list wins)."""
        return weight_bytes(cfg, b, self.precision, self.keep if self.source == "stored" else keep, active=active,
                            float32=float32, bf16_linears=bf16_linears)


def weight_tensors(path: Path) -> dict[str, TensorInfo] | None:
    """Every tensor of the directory's weight files; None for a config-only directory."""
    if not (path / "model.safetensors.index.json").is_file() and not any(path.glob("model*.safetensors")):
        return None
    return checkpoint_tensors(path)


def header_keep(tensors: dict[str, TensorInfo]) -> tuple[str, ...]:
    """Modules a quantized file keeps in high precision: quantizable Linear weights not stored quantized."""
    return tuple(sorted(module_of(n) for n, t in tensors.items()
                        if is_quantized(n) and t.dtype not in QUANT_DTYPES and not n.startswith("mtp.")))


def offers(path: str | Path, cfg: NemotronHConfig | None = None,
           tensors: dict[str, TensorInfo] | None = None) -> list[Offer]:
    """What the directory can be loaded as (module docstring). Pass `cfg` and `tensors` when already read."""
    path = Path(path)
    cfg = cfg or NemotronHConfig.from_dir(path)
    tensors = weight_tensors(path) if tensors is None else tensors
    if tensors is not None:  # weights that do not match the config are an error here, not at load time
        verify_tensors(path, cfg, tensors)
    if tensors is None:
        release = release_precisions(path)
        return [Offer("bf16", "stored")] + [
            Offer(p, "stored", tuple(release[p]["exclude_modules"])) if p in release
            else Offer(p, "load-time quantization") for p in PRECISIONS[1:]]
    stored = read_quant_config(path)[0]  # what the loader reads: hf_quant_config.json
    if stored == "bf16":
        return [Offer("bf16", "stored"), *(Offer(p, "load-time quantization") for p in PRECISIONS[1:])]
    if not any(t.dtype in QUANT_DTYPES for t in tensors.values()):
        raise CheckpointError(f"{path}: its quantization config says {stored.upper()} but no weight in the "
                              "safetensors headers is stored quantized")
    return [Offer(stored, "stored", header_keep(tensors))]


def release_precisions(path: Path) -> dict:
    """release.json beside a config-only description: {"precisions": {"fp8": {"exclude_modules": [...],
    "repo": ...}}}; {} when there is none."""
    file = path / "release.json"
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text()).get("precisions", {})
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{file}: not valid ({e})") from None
