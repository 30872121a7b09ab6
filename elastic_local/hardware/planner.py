"""Fit planning: which (budget, precision) fits a machine, and what every candidate would cost.

Pure arithmetic on numbers the caller supplies (no checkpoint IO): a hardware `Profile`, one `ArchShape`
per budget (budgets shrink axes, so shapes differ), and `WeightOption`s holding the *exact* weight bytes
of each (budget, precision) from the checkpoint header and budget table. Every MoE expert of a budget is
resident, so weight bytes are the whole budget, not the active part.

Memory of a candidate (all in bytes):

    total = weights + kv + state + workspace + overhead + margin
    kv        = rows x 2 (K and V) x attn_layers x kv_heads x head_dim x context x kv_dtype
    state     = rows x mamba_layers x (conv_len x conv_dim x conv_dtype
                                       + mamba_heads x mamba_head_dim x ssm_state x 4)   # ssm fp32
    rows      = caches x batch, + batch where a batch on several caches steps its sub-batches on copies
                (no C step in place: a GPU; engine/cacheset.py, CacheSet.held)
    workspace = see `ArchShape.workspace_bytes` (one prefill chunk through the widest layer, the logits
                of the chunk, one dequantized weight matrix when fp8/nvfp4 is not native, and on a GPU
                the experts each CUDA-graph decode row gathers: caches x batch rows)
    overhead  = CUDA context (500 MiB) on a GPU, the python + torch process (512 MiB) on a CPU, both on a
                unified-memory device
    margin    = max(1 GiB, 5% of available), overridable

`caches` is 2 by default because chat keeps a think cache and an answer cache (SPEC section 7); each is
sized with the candidate's shape, an upper bound for a smaller think budget. Available memory is the
profile's memory minus its reserved bytes (for the live machine: free memory now, other processes
counted).

Choice: budgets are ranked largest first (by the bytes of their bf16 option when every budget has one,
else in the order given); the pick is the first budget with any fitting option, at the best-quality
precision that fits: bf16 > fp8 > nvfp4, a stored file before a load-time quantization of the same
precision. A precision the hardware cannot compute natively still counts: it runs by dequantizing, which
the candidate's note says (23B NVFP4 beats 12B BF16, SPEC section 6).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from ..model.cost import NATIVE_NEEDS, PREFILL_CHUNK, ArchShape, runs_natively
from .profiles import GIB, MIB, Profile

PRECISIONS = ("bf16", "fp8", "nvfp4")  # best quality first
SOURCES = ("stored", "load-time quantization")  # preferred first
CUDA_CONTEXT_BYTES = 500 * MIB  # CUDA context + cuBLAS workspace + allocator slack, per GPU process
# The CPU runtime: everything the process holds besides weights, caches and live activations. Measured by
# benchmarks/bench_memory.py (torch 2.13 CPU, glibc, 2 cores; ~0.55 GiB nested model, bf16, 2048-token context):
# peak RSS less (weights + KV + state + predicted workspace) = 501-527 MiB over three budgets. Of that, the
# process after `import torch, elastic_local` is 236 MiB and the library pages a forward pass touches 18 MiB;
# the rest is memory torch's CPU path keeps after use (oneDNN's primitive cache, malloc arenas), which grows
# with context (+300-350 MiB at 8192 tokens) and drops to ~350 MiB in all with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0
# and MALLOC_MMAP_THRESHOLD_=65536. The chat app's own memory is not in it.
CPU_RUNTIME_BYTES = 512 * MIB
MIN_MARGIN_BYTES = GIB  # llama.cpp --fit keeps 1 GiB free by default
MARGIN_FRACTION = 0.05


@dataclass(frozen=True)
class WeightOption:
    """One loadable form of a budget: exact bytes resident, and bytes read per decoded token."""

    budget: str
    precision: str  # "bf16" | "fp8" | "nvfp4"
    weights_bytes: int
    active_bytes: int  # weights read per decoded token (active experts only): sets the decode ceiling
    source: str = "stored"  # "stored" | "load-time quantization"
    # Active bytes of the same budget in bf16. A precision computed by dequantizing writes and reads a bf16
    # tile for every weight tile it reads, so its ceiling is at best bf16's, never the packed bytes'.
    bf16_active_bytes: int | None = None

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if self.weights_bytes <= 0 or self.active_bytes <= 0:
            raise ValueError(f"{self.budget} {self.precision}: weight bytes must be positive")


@dataclass(frozen=True)
class Workload:
    """What the plan must hold besides weights. Defaults: one chat (think + answer caches) at 32K."""

    context: int = 32768  # tokens per sequence the KV cache holds
    batch: int = 1
    caches: int = 2  # hybrid caches kept per sequence: chat keeps a think and an answer cache
    prefill_chunk: int = PREFILL_CHUNK  # tokens per prefill step (the network's, model/cost.py)
    logits_tokens: int | None = None  # positions whose logits a prefill step computes; None = the chunk
    kv_dtype_bytes: int = 2  # bf16 KV; 1 for an FP8 KV cache
    conv_dtype_bytes: int = 4  # conv state in fp32 (SPEC section 3)
    conv_len: int | None = None  # conv inputs kept per layer; None = conv_kernel
    act_bytes: int = 2  # activation dtype: bf16
    margin_bytes: int | None = None  # None = max(1 GiB, 5% of available)
    overhead_bytes: int | None = None  # None = by device kind (see module docstring)
    cuda_graphs: bool = True  # a GPU decodes through CUDA graphs (engine.load's default)


@dataclass(frozen=True)
class Candidate:
    budget: str
    precision: str
    source: str
    weights_bytes: int
    kv_bytes: int
    state_bytes: int
    workspace_bytes: int
    overhead_bytes: int
    margin_bytes: int
    total_bytes: int
    fits: bool
    native: bool  # computes in its own precision; False: runs by dequantizing (or bf16 via fp16/fp32)
    decode_tps_ceiling: float | None  # bandwidth / active bytes: weights only, an upper bound
    reason: str  # why it does not fit; "" when it fits
    note: str  # how it computes on this hardware

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    candidates: list[Candidate]
    pick: Candidate | None
    available_bytes: int
    profile: Profile
    workload: Workload

    def to_dict(self) -> dict:
        pick = self.pick
        return {
            "profile": self.profile.to_dict(),
            "workload": asdict(self.workload),
            "available_bytes": self.available_bytes,
            "candidates": [c.to_dict() for c in self.candidates],
            "pick": None if pick is None else
            {"budget": pick.budget, "precision": pick.precision, "total_bytes": pick.total_bytes},
        }


def compute_gate(profile: Profile, precision: str) -> tuple[bool, str]:
    """(native, note): whether this runtime computes `precision` natively on the profile's hardware, and
    what happens if not (the gates are the model's, model/cost.py; `info` reports the same)."""
    cc = profile.compute_capability
    native = runs_natively(precision, None if profile.kind == "cpu" else cc)
    if profile.kind == "cpu" and profile.cpu_kernels:  # model/gemv.c: every format read as stored
        if precision == "bf16":
            return True, "decoded in C from bf16 column panels; float32 compute where it fits (C prefill)"
        return True, f"{precision} decoded in registers by the CPU kernels: reads the packed bytes"
    if profile.kind == "cpu" or cc is None:
        if native:
            return True, f"{precision} matmuls in torch on the CPU"
        return False, f"runs by dequantizing {precision} to the compute dtype on the CPU (memory saving, no speed-up)"
    sm = profile.sm
    if native:
        return True, f"native {precision} on {sm}"
    if precision == "bf16":
        return False, f"{sm} has no bf16 compute (needs {NATIVE_NEEDS['bf16']}): computes in fp16 or fp32"
    to = "bf16" if runs_natively("bf16", cc) else "fp16"
    return False, (f"runs by dequantizing {precision} to {to} on {sm} (native: {NATIVE_NEEDS[precision]}); "
                   "saves memory only")


def default_overhead(profile: Profile) -> int:
    return {"cuda": CUDA_CONTEXT_BYTES, "cpu": CPU_RUNTIME_BYTES,
            "unified": CUDA_CONTEXT_BYTES + CPU_RUNTIME_BYTES}[profile.kind]


def default_margin(available_bytes: int) -> int:
    return max(MIN_MARGIN_BYTES, int(MARGIN_FRACTION * available_bytes))


def rank_budgets(options: Sequence[WeightOption]) -> list[str]:
    """Budgets largest first: by bf16 weight bytes when every budget has a bf16 option, else as given."""
    order = list(dict.fromkeys(o.budget for o in options))
    bf16 = {o.budget: o.weights_bytes for o in options if o.precision == "bf16"}
    if set(bf16) == set(order):
        order.sort(key=lambda b: -bf16[b])
    return order


def _candidate(profile: Profile, shape: ArchShape, o: WeightOption, w: Workload, available: int,
               overhead: int, margin: int) -> Candidate:
    native, note = compute_gate(profile, o.precision)
    # a batch on more than one cache, where no C step steps its rows in place (not a CPU with the kernels),
    # decodes its sub-batches on copies of their rows, held between steps: one more cache of every row
    held = w.batch if w.batch > 1 and w.caches > 1 and not (profile.kind == "cpu" and profile.cpu_kernels) else 0
    kv = (w.caches * w.batch + held) * shape.kv_bytes(w.context, w.kv_dtype_bytes)
    state = (w.caches * w.batch + held) * shape.state_bytes(w.conv_len, w.conv_dtype_bytes)
    # the engine prefills (and catches up) one row at a time in chunks and decodes the batch one token per
    # row, so activations peak at a chunk or at the batch, whichever is larger, never at their product
    tokens = max(w.prefill_chunk, w.batch)
    logits = max(w.batch, w.prefill_chunk if w.logits_tokens is None else w.logits_tokens)
    # one graph per budget a sequence decodes with (at most one per cache), each holding its batch's rows
    graph_rows = w.caches * w.batch if w.cuda_graphs and profile.kind == "cuda" else 0
    work = shape.workspace_bytes(tokens, logits, w.act_bytes, dequant=not native and o.precision != "bf16",
                                 graph_rows=graph_rows, packed=o.precision != "bf16")
    total = o.weights_bytes + kv + state + work + overhead + margin
    fits = total <= available
    reason = "" if fits else (f"needs {total / GIB:.2f} GiB, {(total - available) / GIB:.2f} GiB more than "
                              f"the {available / GIB:.2f} GiB available")
    bw = profile.memory_bandwidth_gbps
    read = o.active_bytes if native or o.bf16_active_bytes is None else max(o.active_bytes, o.bf16_active_bytes)
    return Candidate(
        budget=o.budget, precision=o.precision, source=o.source, weights_bytes=o.weights_bytes, kv_bytes=kv,
        state_bytes=state, workspace_bytes=work, overhead_bytes=overhead, margin_bytes=margin,
        total_bytes=total, fits=fits, native=native,
        decode_tps_ceiling=None if not bw else bw * 1e9 / read, reason=reason, note=note,
    )


def plan(profile: Profile, shapes: Mapping[str, ArchShape], options: Sequence[WeightOption],
         workload: Workload = Workload()) -> Plan:
    """Cost every option on `profile` and pick the largest budget that fits at its best precision."""
    missing = sorted({o.budget for o in options} - set(shapes))
    if missing:
        raise KeyError(f"no ArchShape for budget(s) {', '.join(missing)}")
    available = profile.available_bytes
    overhead = default_overhead(profile) if workload.overhead_bytes is None else workload.overhead_bytes
    margin = default_margin(available) if workload.margin_bytes is None else workload.margin_bytes
    rank = {b: i for i, b in enumerate(rank_budgets(options))}
    ordered = sorted(options, key=lambda o: (rank[o.budget], PRECISIONS.index(o.precision),
                                             SOURCES.index(o.source)))
    cands = [_candidate(profile, shapes[o.budget], o, workload, available, overhead, margin) for o in ordered]
    pick = next((c for c in cands if c.fits), None)  # ordered: largest budget, then best precision
    return Plan(candidates=cands, pick=pick, available_bytes=available, profile=profile, workload=workload)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def render_plan(p: Plan) -> str:
    """The plan as a plain-text table for a terminal: memory breakdown in GiB, '*' marks the pick."""
    prof, w = p.profile, p.workload
    head = (f"{prof.name}: {prof.description} [{prof.kind}{', ' + prof.sm if prof.sm else ''}]\n"
            f"memory {_gib(prof.memory_bytes)} GiB - reserved {_gib(prof.reserved_bytes)} GiB = "
            f"{_gib(p.available_bytes)} GiB available; context {w.context} x batch {w.batch} x "
            f"{w.caches} caches, prefill chunk {w.prefill_chunk}")
    cols = ("", "budget", "precision", "weights", "kv", "state", "work", "runtime", "margin", "total",
            "fits", "tok/s<=", "note")
    rows = [cols]
    for c in p.candidates:
        tps = "-" if c.decode_tps_ceiling is None else f"{c.decode_tps_ceiling:.0f}"
        note = c.note if c.source == "stored" else f"{c.source}; {c.note}"
        sizes = (c.weights_bytes, c.kv_bytes, c.state_bytes, c.workspace_bytes, c.overhead_bytes,
                 c.margin_bytes, c.total_bytes)
        rows.append(("*" if c is p.pick else "", c.budget, c.precision, *map(_gib, sizes),
                     "yes" if c.fits else "no", tps, note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    left = {1, 2, 10, 12}  # text columns; numbers align right
    lines = [" ".join(v.ljust(widths[i]) if i in left else v.rjust(widths[i]) for i, v in enumerate(r))
             .rstrip() for r in rows]
    c = p.pick
    tail = ("pick: none fits; try a shorter context or a smaller precision" if c is None else
            f"pick: {c.budget} {c.precision}: {_gib(c.total_bytes)} of {_gib(p.available_bytes)} GiB")
    return "\n".join([head, "sizes in GiB", *lines, tail])
