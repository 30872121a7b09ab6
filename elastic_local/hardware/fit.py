"""Fit a checkpoint directory to a machine: the planner fed from the directory's own numbers.

    plan_checkpoint(path, profile, context=32768) -> Plan      every (budget, precision), the pick
    choose(path, device=None) -> (budget, precision, float32)  the pick on the live machine, for load("auto")

What a directory offers (bf16 stored, fp8/nvfp4 stored or by load-time quantization) and the bytes each
form keeps resident are `checkpoint/offers.py`'s, which `info` prints too.

Weight bytes are exact: quant/scheme.py `weight_bytes` sums the tensors a budget holds at a precision, in
Model Optimizer's layout, as this runtime keeps them resident (high-precision tensors in bf16, router,
A_log, D, dt_bias in fp32). `header_bytes` sums the same slices from the headers; for a BF16 or quantized
file the two agree (tests/test_fit.py).

The workload is this runtime's (model/nemotron_h.py): prefill in chunks of 1024 tokens, logits for the
last position only, KV cache and Mamba conv state in the compute dtype (bf16), SSM state in fp32, one
hybrid cache per budget taking part (chat: think + answer = 2). The plan is for bf16 compute: load with
`dtype=torch.bfloat16` for the prediction to hold (a float32 load doubles cache and activations, and the
high-precision weights except, on a CPU with the C kernels, the Linear ones a BF16 file stores: they stay
bf16 in its panels). `plan_checkpoint(float32=True)` plans the float32 load instead: on a CPU,
`load("auto")` and elastic-chat take the bf16 plan's pick in float32 where that fits too (`in_float32`; a
CPU prefills 1.15-1.35x faster in float32, its C kernels, and decodes alike in both, its C step), else in bf16.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..checkpoint.files import CheckpointError, TensorInfo
from ..checkpoint.offers import offers, release_precisions, weight_tensors
from ..elastic.table import read_budgets
from ..model.budget import Budget
from ..model.config import NemotronHConfig
from ..model.cost import PREFILL_CHUNK, arch_shape
from ..model.schema import expected_shapes, stored_budget
from ..quant.scheme import is_linear, weight_bytes
from .planner import Candidate, Plan, WeightOption, Workload, plan
from .probe import probe_machine
from .profiles import GIB, Profile, get_profile, profile_from_probe

COMPUTE_BYTES = 2  # bf16: KV cache, conv state and activations are in the compute dtype


def runtime_workload(context: int = 32768, caches: int = 2, batch: int = 1,
                     margin_bytes: int | None = None, compute_bytes: int = COMPUTE_BYTES) -> Workload:
    """The planner's workload for this runtime (module docstring); `compute_bytes` 4 for float32 compute."""
    return Workload(context=context, batch=batch, caches=caches, prefill_chunk=PREFILL_CHUNK, logits_tokens=1,
                    kv_dtype_bytes=compute_bytes, conv_dtype_bytes=compute_bytes, act_bytes=compute_bytes,
                    margin_bytes=margin_bytes)


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
                    margin_bytes: int | None = None, keep: tuple[str, ...] = (), float32: bool = False) -> Plan:
    """Cost every (budget, precision) the directory offers on `profile`; `keep` names the modules a
    load-time quantization keeps in BF16 (none by default). `float32`: for a float32 load instead of the
    bf16 one the plan otherwise assumes (high-precision weights, KV cache, conv state and activations at
    4 bytes): a CPU's prompt runs its C scan, convolution and experts only in float32 (docs/decode-speed.md,
    "CPU prefill in C"; in bfloat16 its products alone). On a CPU with the C kernels
    (`profile.cpu_kernels`) that load keeps BF16 Linear weights in bf16 (engine.load)."""
    path = Path(path)
    cfg = NemotronHConfig.from_dir(path)
    budgets = read_budgets(cfg, where=str(path / "config.json"))
    shapes = {name: arch_shape(cfg, b) for name, b in budgets.items()}
    available = offers(path, cfg)
    options = []
    bf16_linears = float32 and profile.kind == "cpu" and profile.cpu_kernels and stores_bf16_linears(path)
    f32 = dict(float32=float32, bf16_linears=bf16_linears)
    for name, b in budgets.items():
        for o in available:
            options.append(WeightOption(name, o.precision, o.resident_bytes(cfg, b, keep, **f32),
                                        o.resident_bytes(cfg, b, keep, active=True, **f32), o.source,
                                        weight_bytes(cfg, b, "bf16", active=True, **f32)))
    return plan(profile, shapes, options,
                runtime_workload(context, caches, batch, margin_bytes, 4 if float32 else COMPUTE_BYTES))


def stores_bf16_linears(path: Path) -> bool:
    """Whether the directory's unquantized Linear weights are BF16 in the file: only then does a float32
    CPU load keep them bf16 (checkpoint/load_network's `linear_dtype`; a float32 file stays float32). A
    description without weights stands for its published files, which store BF16."""
    tensors = weight_tensors(path)
    if tensors is None:
        return True
    floats = [t.dtype for name, t in tensors.items() if is_linear(name) and t.dtype in ("BF16", "F16", "F32")]
    return bool(floats) and all(d == "BF16" for d in floats)


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
           profile: Profile | None = None) -> tuple[str, str, bool]:
    """(budget, precision, float32) for load(budget="auto", precision="auto"): the planner's pick on the live
    machine (or `profile`), and on a CPU whether it fits in float32 too (`in_float32`). Raises ValueError
    saying what is missing when nothing fits."""
    profile = profile or live_profile(device)
    p = plan_checkpoint(path, profile, context=context, caches=caches)
    if p.pick is None:
        raise ValueError(summary(p))
    b, q = p.pick.budget, p.pick.precision
    return b, q, profile.kind == "cpu" and in_float32(path, profile, b, q, context, caches) is not None


def in_float32(path: str | Path, profile: Profile, budget: str, precision: str, context: int = 32768,
               caches: int = 2) -> Candidate | None:
    """The float32 candidate of (budget, precision) where it fits on `profile`, else None: a CPU computes
    exactly in float32, where the plan assumes bf16 (and prefills faster where it has no bf16 dot
    products), at more memory (caches, activations and the small high-precision tensors at 4 bytes; see
    `plan_checkpoint`)."""
    p = plan_checkpoint(path, profile, context=context, caches=caches, float32=True)
    return next((c for c in p.candidates if c.fits and (c.budget, c.precision) == (budget, precision)), None)


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


def next_steps(path: str | Path, p: Plan) -> list[str]:
    """What to run after `fit`: the pick as an `elastic-chat` command; for a description that holds no
    weights, where the pick's file is published and the embedded demo model to chat with meanwhile."""
    c = p.pick
    if c is None:
        return []
    path = Path(path)
    device = " --device cuda" if p.profile.kind == "cuda" else ""
    precision = c.precision if c.source == "stored" else f"{c.precision} (quantized while loading)"
    if p.profile.kind == "cpu":  # what elastic-chat and load("auto") compute in there (in_float32)
        wide = in_float32(path, p.profile, c.budget, c.precision, p.workload.context, p.workload.caches)
        precision += (f", float32 compute (exact): {wide.total_bytes / GIB:.2f} GiB" if wide else
                      ", bf16 compute (float32, exact, does not fit)")
    if weight_tensors(path) is not None:
        return [f"elastic-chat {path} --budget {c.budget} --precision {c.precision}{device}"
                f"    # chat with {c.budget} in {precision}"]
    release = release_precisions(path)
    file = c.precision if c.source == "stored" else "bf16"
    repo = release.get(file, {}).get("repo")
    if repo is None:
        return [f"{path} holds no weights: put the checkpoint's safetensors beside its config.json, then "
                f"elastic-chat DIR --budget {c.budget} --precision {c.precision}{device}",
                "elastic-chat    # meanwhile: the embedded demo model, no download"]
    local = f"~/models/{repo.split('/')[-1]}"
    return [f"# {path.name} is a description: it holds no weights, and elastic-local never downloads. "
            f"The {file.upper()} file ({c.budget} is a slice of it) is published as {repo}:",
            f"hf download {repo} --local-dir {local}",
            f"elastic-chat {local} --budget {c.budget} --precision {c.precision}{device}"
            + (f"    # {precision}" if p.profile.kind == "cpu" else ""),
            "elastic-chat    # meanwhile: the embedded demo model, no download"]


def fit_report(path: str | Path, p: Plan) -> dict:
    """The plan as one JSON-ready object (the `fit --json` contract: sizes in bytes)."""
    return {"checkpoint": str(path), "summary": summary(p), **p.to_dict(), "next": next_steps(path, p)}
