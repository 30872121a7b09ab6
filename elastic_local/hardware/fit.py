"""Fit a checkpoint directory to a machine: the planner fed from the directory's own numbers.

    plan_checkpoint(path, profile, context=32768) -> Plan      every (budget, precision), the pick
    choose(path, device=None) -> (budget, precision)           the pick on the live machine, for load("auto")

What a directory offers (`offers`):
- a BF16 file (or any unquantized float file: it is cast to bf16 while loading): bf16 "stored", fp8 and
  nvfp4 by "load-time quantization" of it;
- an FP8 or NVFP4 file (its `hf_quant_config.json` says which, as the loader reads it): that precision
  only; bf16 is not offered (dequantizing gains nothing but memory use), nor another quantized format;
- a config-only directory (no weights, e.g. the shipped Star Elastic description): a plan before
  downloading. bf16 is "stored"; fp8/nvfp4 are "stored" where a `release.json` beside config.json lists a
  published file for them (with the modules it keeps in BF16), else "load-time quantization".

Weight bytes are exact: quant/scheme.py `weight_bytes` sums the tensors a budget holds at a precision, in
Model Optimizer's layout, as this runtime keeps them resident (high-precision tensors in bf16, router,
A_log, D, dt_bias in fp32). For a stored quantized file the modules kept in high precision are read from
the safetensors headers, not from `exclude_modules` (modelopt 0.47 writes corrupted entries, SPEC section
5). `header_bytes` sums the same slices from the headers; for a BF16 or quantized file the two agree
(tests/test_fit.py).

The workload is this runtime's (model/nemotron_h.py): prefill in chunks of 1024 tokens, logits for the
last position only, KV cache and Mamba conv state in the compute dtype (bf16), SSM state in fp32, one
hybrid cache per budget taking part (chat: think + answer = 2). The plan is for bf16 compute: load with
`dtype=torch.bfloat16` for the prediction to hold (a float32 load doubles weights, cache and activations).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..checkpoint.files import CheckpointError, TensorInfo
from ..checkpoint.load import checkpoint_tensors
from ..elastic.table import read_budgets
from ..model.budget import Budget
from ..model.config import NemotronHConfig
from ..model.cost import PREFILL_CHUNK, arch_shape
from ..model.schema import expected_shapes, stored_budget
from ..quant.scheme import is_quantized, module_of, read_quant_config, weight_bytes
from .planner import PRECISIONS, Plan, WeightOption, Workload, plan
from .probe import probe_machine
from .profiles import GIB, Profile, get_profile, profile_from_probe

STAR_ELASTIC = Path(__file__).resolve().parents[1] / "catalog" / "star-elastic"
COMPUTE_BYTES = 2  # bf16: KV cache, conv state and activations are in the compute dtype
_QUANT_DTYPES = {"U8", "F8_E4M3"}  # what a quantized Linear weight is stored as (NVFP4 packed bytes, FP8)


@dataclasses.dataclass(frozen=True)
class Offer:
    """One precision a directory can be loaded in."""

    precision: str
    source: str  # "stored" | "load-time quantization"
    keep: tuple[str, ...] = ()  # module globs kept in high precision (Model Optimizer's exclude_modules)


def runtime_workload(context: int = 32768, caches: int = 2, batch: int = 1,
                     margin_bytes: int | None = None) -> Workload:
    """The planner's workload for this runtime (module docstring)."""
    return Workload(context=context, batch=batch, caches=caches, prefill_chunk=PREFILL_CHUNK, logits_tokens=1,
                    kv_dtype_bytes=COMPUTE_BYTES, conv_dtype_bytes=COMPUTE_BYTES, act_bytes=COMPUTE_BYTES,
                    margin_bytes=margin_bytes)


def weight_tensors(path: Path) -> dict[str, TensorInfo] | None:
    """Every tensor of the directory's weight files; None for a config-only directory."""
    if not (path / "model.safetensors.index.json").is_file() and not any(path.glob("model*.safetensors")):
        return None
    return checkpoint_tensors(path)


def header_keep(tensors: dict[str, TensorInfo]) -> tuple[str, ...]:
    """Modules a quantized file keeps in high precision: quantizable Linear weights not stored quantized."""
    return tuple(sorted(module_of(n) for n, t in tensors.items()
                        if is_quantized(n) and t.dtype not in _QUANT_DTYPES and not n.startswith("mtp.")))


def offers(path: str | Path, cfg: NemotronHConfig | None = None,
           tensors: dict[str, TensorInfo] | None = None) -> list[Offer]:
    """What the directory can be loaded as (module docstring). Pass `cfg` and `tensors` when already read."""
    path = Path(path)
    cfg = cfg or NemotronHConfig.from_dir(path)
    tensors = weight_tensors(path) if tensors is None else tensors
    if tensors is None:
        release = _release(path)
        return [Offer("bf16", "stored")] + [
            Offer(p, "stored", tuple(release[p]["exclude_modules"])) if p in release
            else Offer(p, "load-time quantization") for p in PRECISIONS[1:]]
    stored = read_quant_config(path)[0]  # what the loader reads: hf_quant_config.json
    if stored == "bf16":
        return [Offer("bf16", "stored"), *(Offer(p, "load-time quantization") for p in PRECISIONS[1:])]
    if not any(t.dtype in _QUANT_DTYPES for t in tensors.values()):
        raise CheckpointError(f"{path}: its quantization config says {stored.upper()} but no weight in the "
                              "safetensors headers is stored quantized")
    return [Offer(stored, "stored", header_keep(tensors))]


def _release(path: Path) -> dict:
    """release.json beside a config-only description: {"precisions": {"fp8": {"exclude_modules": [...]}}}."""
    file = path / "release.json"
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text()).get("precisions", {})
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{file}: not valid ({e})") from None


def header_bytes(tensors: dict[str, TensorInfo], cfg: NemotronHConfig, b: Budget) -> int:
    """Bytes of budget `b`'s slices of the tensors in the file, at the dtypes the file stores them in.

    Every tensor of a logical weight (a quantized Linear's packed weight, block scales and scalars too) is
    cut in the proportion the budget cuts the logical shape; scalars are whole."""
    full = expected_shapes(cfg, stored_budget(cfg))
    total = 0
    for name, shape in expected_shapes(cfg, b).items():
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        parts = [name] + ([f"{stem}.{s}" for s in ("weight_scale", "weight_scale_2", "input_scale")] if stem else [])
        for part in parts:
            info = tensors.get(part)
            if info is None:
                if part == name:
                    raise CheckpointError(f"{name}: not in the checkpoint")
                continue
            n = TensorInfo(info.file, info.key, info.dtype, ()).nbytes
            for dim, size, whole in zip(info.shape, shape, full[name]):
                n *= dim * size // whole
            total += n
    return total


def plan_checkpoint(path: str | Path, profile: Profile, context: int = 32768, caches: int = 2, batch: int = 1,
                    margin_bytes: int | None = None, keep: tuple[str, ...] = ()) -> Plan:
    """Cost every (budget, precision) the directory offers on `profile`; `keep` names the modules a
    load-time quantization keeps in BF16 (none by default)."""
    path = Path(path)
    cfg = NemotronHConfig.from_dir(path)
    budgets = read_budgets(cfg, where=str(path / "config.json"))
    shapes = {name: arch_shape(cfg, b) for name, b in budgets.items()}
    available = offers(path, cfg)
    options = []
    for name, b in budgets.items():
        for o in available:
            k = o.keep if o.source == "stored" else keep
            options.append(WeightOption(name, o.precision, weight_bytes(cfg, b, o.precision, k),
                                        weight_bytes(cfg, b, o.precision, k, active=True), o.source))
    return plan(profile, shapes, options, runtime_workload(context, caches, batch, margin_bytes))


def live_profile(device: str | None = None) -> Profile:
    """The live machine: the GPU torch uses as cuda:0 (or the one `cuda:N` names, in NVML order), or its RAM
    for "cpu"."""
    if device in (None, "auto", "cuda"):
        return get_profile("auto")
    probe = probe_machine()
    if device == "cpu":
        probe = dataclasses.replace(probe, gpus=[], torch_cuda=False)
    index = int(device.split(":")[1]) if device and device.startswith("cuda:") else None
    if index is not None and not 0 <= index < len(probe.gpus):
        raise ValueError(f"device {device!r}: this machine has {len(probe.gpus)} GPU(s) that NVML sees")
    return profile_from_probe(probe, index)


def choose(path: str | Path, device: str | None = None, context: int = 32768, caches: int = 2,
           profile: Profile | None = None) -> tuple[str, str]:
    """(budget, precision) for load(budget="auto", precision="auto"): the planner's pick on the live machine
    (or `profile`). Raises ValueError saying what is missing when nothing fits."""
    p = plan_checkpoint(path, profile or live_profile(device), context=context, caches=caches)
    if p.pick is None:
        raise ValueError(summary(p))
    return p.pick.budget, p.pick.precision


def _max_context(p: Plan) -> int:
    """The longest context (a multiple of the prefill chunk) at which the smallest candidate fits; 0: none."""
    c = min(p.candidates, key=lambda c: c.total_bytes)
    per_token = c.kv_bytes / p.workload.context if p.workload.context else 0
    room = p.available_bytes - (c.total_bytes - c.kv_bytes)
    if room <= 0 or per_token == 0:
        return 0
    return int(room / per_token) // PREFILL_CHUNK * PREFILL_CHUNK


def summary(p: Plan) -> str:
    """One sentence a person reads first: what this machine (or profile) runs, or why nothing fits."""
    prof = p.profile
    who = (f"This machine ({prof.description.removeprefix('live: ')}, {p.available_bytes / GIB:.1f} GiB free)"
           if prof.name == "auto" else f"Profile {prof.name} ({prof.description})")
    ctx = f"{p.workload.context} tokens of context"
    c = p.pick
    if c is None:
        n = _max_context(p)
        hint = (f"with --context {n} the smallest one fits" if n >= PREFILL_CHUNK else
                "even without a context the smallest one does not fit")
        small = min(p.candidates, key=lambda c: c.total_bytes)
        return (f"{who} runs nothing at {ctx}: the smallest, {small.budget} {small.precision.upper()}, needs "
                f"{small.total_bytes / GIB:.2f} GiB of {p.available_bytes / GIB:.2f}; {hint}.")
    how = " (quantized from the BF16 file while loading)" if c.source == "load-time quantization" else ""
    how += "" if c.native else " (dequantized to compute: saves memory, not time)"
    speed = "" if c.decode_tps_ceiling is None else f", decode up to ~{c.decode_tps_ceiling:.0f} tokens/s"
    return (f"{who} runs {c.budget} in {c.precision.upper()}{how} at {ctx}: "
            f"{c.total_bytes / GIB:.2f} of {p.available_bytes / GIB:.2f} GiB{speed}.")


def fit_report(path: str | Path, p: Plan) -> dict:
    """The plan as one JSON-ready object (the `fit --json` contract: sizes in bytes)."""
    return {"checkpoint": str(path), "summary": summary(p), **p.to_dict()}
