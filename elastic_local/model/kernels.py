"""The seam between the network and fast kernels: each op's implementation, chosen once.

Ops: the Mamba2 chunked scan and one-step state update (mamba_ssm), the depthwise causal convolution
for a prefill and for one token (causal_conv1d), and the scaled matmul of FP8 / NVFP4 weights
(`torch._scaled_mm`, on GPUs whose compute capability runs the format natively, see model/cost.py).
A `KernelSet` serves one device type; on any other device, or where it lacks a kernel, the pure-torch
reference runs (ssd.py; quantized weights dequantize inside the matmul). On an x86 CPU a float32 prefill
that needs no gradient runs the scan and the convolution in C instead (step.c, through `cpu_library`): torch's
chunked scan and oneDNN's depthwise convolution cost more there than the layer's projections.

`active()` picks the set on first use: ELASTIC_LOCAL_KERNELS=torch forces the torch path; otherwise
mamba_ssm and causal_conv1d are imported for real, so a build against another torch falls back here
(and `info` says why) instead of failing inside a forward. `use(kernel_set)` swaps the set: `use(TORCH)`
forces the torch path, and the tests drive every call below through fakes that check their arguments
the way the kernels do (tests/kernel_twins.py).

Argument layouts follow the kernels (mamba_ssm 2.2+, causal_conv1d 1.4+): heads are passed group-major
(head h of n belongs to group h // (n / G)), which is how the scan already sees them (mamba2.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import gemv, ssd

log = logging.getLogger(__name__)
FORCE_ENV = "ELASTIC_LOCAL_KERNELS"  # "torch": never use the optional kernels
INSTALL_HINT = "install the CUDA kernels: pip install --no-build-isolation 'elastic-local[cuda]'"


@functools.cache
def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA GPU; None for CPUs and ROCm."""
    if device.type != "cuda" or torch.version.cuda is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


@dataclass(frozen=True)
class KernelSet:
    """The fast implementations for tensors on `device_type`; None where the torch reference runs."""

    name: str
    device_type: str = "cuda"
    chunk_scan: Callable | None = None  # mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined
    state_update: Callable | None = None  # mamba_ssm.ops.triton.selective_state_update.selective_state_update
    conv: Callable | None = None  # causal_conv1d.causal_conv1d_fn
    conv_update: Callable | None = None  # causal_conv1d.causal_conv1d_update
    scaled_mm: Callable | None = None  # torch._scaled_mm
    capability: Callable[[torch.device], tuple[int, int] | None] = lambda device: None
    missing: dict[str, str] = field(default_factory=dict)  # package -> why it did not import

    def op(self, name: str, device: torch.device) -> Callable | None:
        """The kernel for op `name` on `device`, or None: the torch reference runs."""
        return getattr(self, name) if device.type == self.device_type else None


TORCH = KernelSet("torch", device_type="none")


def _import_cuda_kernels() -> KernelSet:
    """Import mamba_ssm and causal_conv1d for real; any failure (a missing package, a build against
    another torch or CUDA, a missing triton) leaves that kernel to the torch reference."""
    found: dict[str, Callable] = {}
    missing = {}
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        found.update(chunk_scan=mamba_chunk_scan_combined, state_update=selective_state_update)
    except Exception as e:  # noqa: BLE001 - an extension built elsewhere raises ImportError, OSError or RuntimeError
        missing["mamba_ssm"] = f"{type(e).__name__}: {e}"
    try:
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update

        found.update(conv=causal_conv1d_fn, conv_update=causal_conv1d_update)
    except Exception as e:  # noqa: BLE001
        missing["causal_conv1d"] = f"{type(e).__name__}: {e}"
    for package, why in missing.items():
        log.info("%s unavailable (%s): its op runs the torch reference", package, why)
    return KernelSet("cuda", "cuda", scaled_mm=torch._scaled_mm, capability=cuda_capability, missing=missing,
                     **found)


_active: KernelSet | None = None


def active() -> KernelSet:
    """The kernel set in use, chosen on first call (module docstring)."""
    global _active
    if _active is None:
        forced = os.environ.get(FORCE_ENV, "").lower() == "torch"
        _active = TORCH if forced or not torch.cuda.is_available() else _import_cuda_kernels()
    return _active


def use(kernels: KernelSet | None) -> KernelSet | None:
    """Run with `kernels` from now on (None: choose again on next use); returns the set replaced."""
    global _active
    previous, _active = _active, kernels
    return previous


def describe(device: str | torch.device) -> dict[str, str]:
    """What runs each Mamba2 op on `device`, and why not the kernel when it is missing."""
    k, device = active(), torch.device(device)
    in_c = device.type == "cpu" and gemv.library() is not None  # prompts in either dtype (cpu_library)
    out = {"kernels": k.name,
           "mamba_scan": "mamba_ssm (CUDA kernels)" if k.op("chunk_scan", device) else
           "C (model/step.c; float32 arithmetic, a bfloat16 prompt's too)" if in_c else "torch SSD reference",
           "mamba_conv": "causal_conv1d (CUDA kernel)" if k.op("conv", device) else
           "C (model/step.c; a bfloat16 prompt's rounded where torch's bf16 conv1d rounds)" if in_c
           else "torch conv1d"}
    if device.type == "cuda" and k.missing:
        out["note"] = "; ".join(f"{p}: {why}" for p, why in k.missing.items()) + f"; {INSTALL_HINT}"
    elif device.type == "cuda" and k is TORCH:
        out["note"] = f"torch path forced ({FORCE_ENV}=torch)"
    return out


def _channel_last(xt: torch.Tensor) -> torch.Tensor:
    """x (b, C, T) laid out as causal_conv1d wants it: channels contiguous, the other strides multiples of 8."""
    if xt.stride(1) == 1 and xt.stride(0) % 8 == 0 and xt.stride(2) % 8 == 0:
        return xt
    return xt.transpose(1, 2).contiguous().transpose(1, 2)


def cpu_library(*tensors: torch.Tensor | None, bf16: bool = False):
    """The CPU library (gemv.py) where every tensor is a float32 CPU tensor (or bf16, with `bf16`: the caller
    widens them, computes in float32 and rounds where the torch ops round), no gradient is to be computed
    and the call is not being traced; else None (the torch reference runs, and training differentiates it)."""
    given = [t for t in tensors if t is not None]
    dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    if (torch.compiler.is_compiling() or any(t.device.type != "cpu" or t.dtype not in dtypes for t in given)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in given))):
        return None
    return gemv.library()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, groups: int = 1, p: int | None = None,
                 gate: torch.Tensor | None = None) -> torch.Tensor | None:
    """RMSNorm of x [..., width] (times silu(gate) first, where given) times weight [width] by step.c's
    norm_rows, over each of `groups` rank-major groups of p-channel runs (Mamba2's gated norm) or the whole
    row; None where it does not run (cpu_library): the torch ops then do. bf16 tensors are widened first
    and the norm rounded to x's dtype after, where the torch ops compute in float32 and round too."""
    dtype = x.dtype
    lib = cpu_library(x, weight, gate, bf16=True)
    if lib is None or x.numel() == 0:
        return None
    x, weight, gate = x.float(), weight.float(), None if gate is None else gate.float()
    x, weight, width = x.contiguous(), weight.contiguous(), x.shape[-1]
    rows = x.numel() // width
    if gate is not None:  # rows of a strided gate (in_proj's z columns) are read where they are
        gate = gate.reshape(rows, width)
        if gate.stride(1) != 1:
            gate = gate.contiguous()
    out = torch.empty_like(x)
    lib.norm_rows(x.data_ptr(), _ptr(gate), 0 if gate is None else gate.stride(0), weight.data_ptr(),
                  out.data_ptr(), rows, width, groups, p or width, eps, torch.get_num_threads())
    return out.to(dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  state: torch.Tensor | None) -> torch.Tensor:
    """silu(causal depthwise conv) of x [b, T, C] with weight [C, K]; continues from and updates `state`
    [b, C, K] (the last K inputs) in place."""
    k = active()
    T, (C, K) = x.shape[1], weight.shape
    conv = k.op("conv", x.device)
    if (conv is None and T > 1 and (state is None or state.is_contiguous())
            and (lib := cpu_library(x, weight, bias, state, bf16=x.dtype == torch.bfloat16)) is not None):
        return _cpu_conv(lib, x, weight, bias, state)
    update = k.op("conv_update", x.device)
    if update is not None and state is not None and T == 1:
        # state_len K >= width - 1: the kernel shifts the window by one and appends x, as ssd.causal_conv1d does
        return update(x[:, 0], state, weight, bias, activation="silu")[:, None]
    if conv is None or C % 8 or not 2 <= K <= 4:  # the kernel's limits
        return ssd.causal_conv1d(x, weight, bias, state)
    xt = _channel_last(x.transpose(1, 2))  # (b, C, T)
    init = None
    if state is not None:  # initial_states: the last K-1 inputs (b, C, K-1), channels contiguous
        init = _channel_last(state[:, :, 1:].to(x.dtype))
        state.copy_(torch.cat([state, xt.to(state.dtype)], dim=-1)[:, :, -K:])
    return conv(xt, weight, bias, initial_states=init, activation="silu").transpose(1, 2)


def ssd_scan(x, dt, A, B, C, chunk: int, initial_state: torch.Tensor | None):
    """Chunked scan; shapes as ssd.ssd_chunked (group-major heads): x [b, T, G, r, p], dt [b, T, G, r]
    (after softplus), A [G, r], B, C [b, T, G, N], initial_state [b, G, r, p, N] or None."""
    scan = active().op("chunk_scan", x.device)
    if scan is None:
        lib = cpu_library(x, dt, A, B, C, initial_state)
        if lib is not None:
            b, T, G, r, p = x.shape
            y = x.new_empty(b, T, G, r, p)
            final = x.new_zeros(b, G, r, p, B.shape[-1]) if initial_state is None else initial_state.clone(
                memory_format=torch.contiguous_format)
            return _cpu_scan(lib, x, dt, A, None, B, C, y, final), final
        return ssd.ssd_chunked(x, dt, A, B, C, chunk, initial_state)
    b, T, G, r, p = x.shape
    N = B.shape[-1]
    init = None if initial_state is None else initial_state.reshape(b, G * r, p, N)
    y, final = scan(x.reshape(b, T, G * r, p), dt.reshape(b, T, G * r), A.reshape(G * r), B, C,
                    chunk_size=chunk, initial_states=init, return_final_states=True)
    return y.view(b, T, G, r, p), final.view(b, G, r, p, N)


def _cpu_conv(lib, x, weight, bias, state):
    """causal_conv1d by step.c's conv_prefill: 8 channels at a time across the prompt, silu fused. A bf16
    prompt's inputs, weights and state are widened (exactly), and the convolution rounded to bf16 before
    the silu, whose float32 result is rounded again: where torch's bf16 conv1d and silu round."""
    (b, T, C), K = x.shape, weight.shape[1]
    half = x.dtype == torch.bfloat16
    x = x.float().contiguous() if half else x if x.stride(-1) == 1 else x.contiguous()
    weight, bias = weight.float().contiguous(), None if bias is None else bias.float().contiguous()
    wide = state.float() if half and state is not None and state.dtype != torch.float32 else state
    out = x.new_empty(b, T, C)
    if lib.conv_prefill(x.data_ptr(), x.stride(0), x.stride(1), weight.data_ptr(), _ptr(bias), _ptr(wide),
                        out.data_ptr(), b, T, C, K, half, torch.get_num_threads()):
        raise MemoryError(f"out of memory for the convolution's {C}x{2 * K - 1} taps")
    if wide is not state:
        state.copy_(wide)  # bf16 inputs: exact
    return out.to(torch.bfloat16) if half else out


def _cpu_scan(lib, x, dt, A, D, B, C, y, final) -> torch.Tensor:
    """step.c's ssm_scan: the recurrence token by token, one head's state in cache throughout; fills and
    returns y [b, T, G, r, p] (any strides, p contiguous), plus the D skip where D is given, and advances
    `final` [b, G, r, p, N] (contiguous float32) in place, which it leaves untouched where it raises."""
    b, T, G, r, p = x.shape
    N = B.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (B, C))
    if B.stride() != C.stride():
        B, C = B.contiguous(), C.contiguous()
    A, D = A.contiguous(), None if D is None else D.contiguous()
    xs, dts, bcs, ys = ((ctypes.c_int64 * n)(*t.stride()[:n]) for t, n in ((x, 4), (dt, 4), (B, 3), (y, 4)))
    if lib.ssm_scan(x.data_ptr(), xs, dt.data_ptr(), dts, A.data_ptr(), _ptr(D), B.data_ptr(), C.data_ptr(), bcs,
                    y.data_ptr(), ys, final.data_ptr(), b, T, G, r, p, N, torch.get_num_threads()):
        raise MemoryError(f"out of memory for the threads' {p}x{N} SSM state copies")
    return y


def mamba_scan(x, dt, A, D, B, C, chunk: int, state: torch.Tensor | None) -> torch.Tensor:
    """A Mamba2 mixer's scan over a prompt with its D skip: y [b, T, r * G * p] in the rank-major order of
    its heads, which out_proj reads, with `state` [b, G, r, p, N] (None: zeros) advanced in place. Shapes as
    ssd_scan's, D [G, r]. On the CPU one step.c pass writes y in that order and advances the cache's own
    state (ssm_scan); elsewhere ssd_scan, then torch ops add the skip and reorder the heads."""
    b, T, G, r, p = x.shape
    lib = cpu_library(x, dt, A, D, B, C, state) if active().op("chunk_scan", x.device) is None else None
    if lib is None:
        y, final = ssd_scan(x, dt, A, B, C, chunk, state)
        if state is not None:
            state.copy_(final)
        return (y + D[..., None] * x).transpose(2, 3).reshape(b, T, r * G * p)
    y = x.new_empty(b, T, r, G, p)
    final = x.new_zeros(b, G, r, p, B.shape[-1]) if state is None else state
    if not final.is_contiguous():
        final = final.contiguous()
    _cpu_scan(lib, x, dt, A, D, B, C, y.transpose(2, 3), final)
    if state is not None and final is not state:
        state.copy_(final)
    return y.view(b, T, r * G * p)


def ssm_step(ssm: torch.Tensor, x, dt, A, B, C) -> torch.Tensor:
    """One decode step; updates `ssm` [b, G, r, p, N] in place and returns y [b, G, r, p] (without the
    D skip). x [b, G, r, p], dt [b, G, r] (after softplus), A [G, r], B, C [b, G, N]."""
    step = active().op("state_update", x.device)
    if step is None:
        return ssd.ssm_step(ssm, x, dt, A, B, C)
    b, G, r, p = x.shape
    n, N = G * r, ssm.shape[-1]
    # Per-head values tied across head_dim as zero-stride views, as mamba_ssm's Mamba2.step passes them
    # (the kernel then loads them once per head). dt arrives after softplus with its bias added, and the
    # D skip is added by the caller: the kernel gets a zero dt_bias and D, which it requires.
    zero = x.new_zeros(()).expand(n, p)
    y = step(ssm.view(b, n, p, N), x.reshape(b, n, p), dt.reshape(b, n, 1).expand(b, n, p),
             A.reshape(n, 1, 1).expand(n, p, N), B, C, D=zero, dt_bias=zero, dt_softplus=False)
    return y.view(b, G, r, p)
