"""Decode's matrix-vector products on x86 CPUs: `gemv.c`, compiled on first use with the system's C compiler.

Batch-1 decode reads every weight once per token, so its speed is the speed at which the matmul streams
the weights. torch has no CPU matmul for FP8 / NVFP4 weights (they dequantize a tile at a time, 0.26-0.59x
of BF16 although they read 2-3.5x fewer bytes), and its matrix-vector products lose speed on the strided
row-prefix views smaller budgets cut and, on CPUs without bf16 instructions, on bf16 weights. gemv.c reads
each format as stored, prefix views included, and decodes the packed ones in registers. Float32
weights are kept in column panels (`panels`, linear.Panels) that every budget's view streams as whole
blocks; a prompt's products (many rows of x) run register tiles on those panels, faster than MKL's sgemm
at a prompt's size on this project's AMD CPU.

The library is built once per source version into the user's cache dir (`paths.cache_dir()/kernels`):
`$CC` or `cc`, AVX2 + FMA + F16C, OpenMP (torch's own runtime, already loaded). Any other CPU, a missing
compiler (a warning says so), or ELASTIC_LOCAL_CPU_GEMV=0: torch's matmul runs (the same results up to
float32 rounding: the kernels sum in another order).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from ..paths import cache_dir

ENV = "ELASTIC_LOCAL_CPU_GEMV"  # "0": never build or use the kernels
# gemv.c: the products; step.c: whole decode-step blocks built on them (model/step.py), the sequential
# parts of a Mamba2 prefill (model/kernels.py) and a prefill's routed experts (model/moe.py); sample.c: a
# sampled next token (step.c's run ahead, engine/sampling.py)
SOURCES = [Path(__file__).with_name(name) for name in ("gemv.c", "step.c", "sample.c")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared"]
# Rows of x the decode kernels take: float weights up to MAX_ROWS (past that, float32 weights in column
# panels take the blocked product, `panels`, any other float weight torch's matmul); packed weights up to
# MAX_PACKED_ROWS, a prefill chunk (cost.py). From 4 rows the packed kernels decode 24 weight rows at a
# time into a panel and run register tiles over x, where torch's path dequantizes whole tiles first:
# measured on 2 threads, FP8 / NVFP4, against that path (scratch, 3608x768, 16-row panels): 16 rows
# 4.1 / 4.6x, 128 rows 2.0 / 1.7x, 512 rows 1.6 / 1.2x, 2048 rows 1.0 / 1.05x, and against torch's float32
# matmul of the same shape 0.8-1.2x.
MAX_ROWS = 4
MAX_PACKED_ROWS = 1024

_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "gemv_f32": [_P, _P, _P, _I, _I, _I, _I, _C],
    "gemv_p_f32": [_P, _P, _P, _I, _I, _I, _I, _I, _C],
    "gemm_p_f32": [_P, _P, _P, _I, _I, _I, _I, _I, _C],
    "gemv_p_bf16": [_P, _P, _P, _I, _I, _I, _I, _I, _C],
    "gemv_p_fp8": [_P, _P, _P, _I, _I, _I, _I, _I, _F, _C],
    "gemm_p_bf16": [_P, _P, _P, _I, _I, _I, _I, _I, _C],
    "gemm_p_bf16x": [_P, _P, _P, _I, _I, _I, _I, _I, _C],
    "gemm_p8_bf16x": [_P, _P, _P, _I, _I, _I, _I, _I, _F, _C],
    "panel_copy": [_P, _P, _I, _I, _I, _I],
    "gemm_packed_bf16x": [_C, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _C],
    "bf16_dot": [],
    "gemv_bf16": [_P, _P, _P, _I, _I, _I, _I, _C],
    "gemv_fp8": [_P, _P, _P, _I, _I, _I, _I, _F, _C],
    "gemv_nvfp4": [_P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _C],
    "gemv_nvfp4_a4": [_P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _F, _C],
    "nvfp4_round_rows": [_P, _P, _I, _I, _F],
    "decode_token": [_P, _I, _I, _P, _C],
    "decode_ahead": [_P, _I, _I, _I, _P, _I, _P, _P, _P, _P, _P, _C],
    "decode_rows": [_P, _I, _P, _P, _P, _P, _I, _P, _I, _P, _C],
    "sample_rows": [_P, _I, _I, _P, _P, _P, _P, _P],
    "norm_rows": [_P, _P, _I, _P, _P, _I, _I, _I, _I, _F, _C],
    "conv_prefill": [_P, _I, _I, _P, _P, _P, _P, _I, _I, _I, _I, _C, _C],
    "ssm_scan": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _C],
    "experts_prefill": [_P, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _C],
    "experts_prefill_bf16": [_P, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _C, _C],
    "to_bf16": [_P, _P, _I],
    "route_rows": [_P, _I, _I, _P, _I, _P, _I, _I, _I, _F, _P, _P, _C],
    "owned": [_P, _I, _I, _P, _P],
    "meet_time": [_I, _C, _P],
    "meet_check": [_I, _C],
    "own_states_tokens": [],
    "release_threads": [],
    "float_mode": [],
    "set_float_mode": [_C],
}


def _compile(out: Path, sources: list[Path] = SOURCES) -> str | None:
    """Build `sources` into `out` (atomically: concurrent first runs each build and rename); None or why not.
    The sources compile in parallel, then link: each takes seconds at -O3, and a first run's first prompt
    waits for the build (4.5 s for both sources in one compiler call, 2.7 s in parallel on two cores)."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return f"no C compiler: {cc!r} not found (install gcc, or set CC)"
    out.parent.mkdir(parents=True, exist_ok=True)
    compile_flags = [f for f in FLAGS if f != "-shared"]
    with tempfile.TemporaryDirectory(prefix=".build-", dir=out.parent) as work:
        objects = [os.path.join(work, f"{i}.o") for i in range(len(sources))]
        why = ""
        for openmp in (["-fopenmp"], []):  # a compiler without OpenMP (e.g. clang without libomp): one thread
            jobs = [subprocess.Popen([cc, *compile_flags, *openmp, "-c", str(src), "-o", obj],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                    for src, obj in zip(sources, objects)]
            errors = [job.communicate()[1] for job in jobs]
            failed = [(job.returncode, err) for job, err in zip(jobs, errors) if job.returncode]
            if not failed:
                lib = os.path.join(work, "lib.so")
                done = subprocess.run([cc, *FLAGS, *openmp, *objects, "-o", lib, "-lm"], capture_output=True,
                                      text=True)
                if done.returncode == 0:
                    os.replace(lib, out)
                    return None
                failed = [(done.returncode, done.stderr)]
            if not why:
                code, err = failed[0]
                lines = err.strip().splitlines()
                why = lines[-1] if lines else f"exit {code}"
        return f"{cc} failed: {why}"


_library: ctypes.CDLL | None | bool = False  # False: not looked for yet


def library_path() -> Path:
    """Where this version of the sources is built: one file per source version and flags."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"gemv-{key}.so"


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot run (module docstring); looked for once. (A plain
    global, not functools.cache: a compiled decode step reads it while tracing.)"""
    global _library
    if _library is False:
        _library = _load()
    return _library


def _supported() -> bool:
    return (os.environ.get(ENV) != "0" and platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def runs_here() -> bool:
    """Whether the kernels run on this machine, without building them: a supported CPU, and the library
    built or a C compiler to build it (the fit planner's live CPU profile)."""
    return _supported() and (library_path().is_file() or shutil.which(os.environ.get("CC") or "cc") is not None)


def prebuild() -> threading.Thread | None:
    """Build the library in the background if it is not built yet. The loader calls this so that the
    ~2 s a build takes (once per install) overlaps the weights' load; the loader then asks `library()`
    (which waits for this build and reports a failed one) whether float32 weights go into the kernels'
    column panels."""
    global _building
    if _library is not False or not _supported() or library_path().is_file():
        return None
    _building = threading.Thread(target=_compile, args=(library_path(),), name="elastic-kernels-build", daemon=True)
    _building.start()
    return _building


_building: threading.Thread | None = None


def building() -> bool:
    """Whether a build `prebuild` started is still running (`library()` would wait for it)."""
    return _building is not None and _building.is_alive()


def _load() -> ctypes.CDLL | None:
    if not _supported():
        return None
    if _building is not None:
        _building.join()  # a build `prebuild` started: wait for it rather than compile a second time
    path = library_path()
    lib, why = None, None
    for _ in range(2):  # a cached library that does not load (truncated, say) is rebuilt once
        try:
            why = None if path.is_file() else _compile(path)
            lib = None if why else ctypes.CDLL(str(path))
            break
        except OSError as e:
            why = f"{path}: {e}"
            path.unlink(missing_ok=True)
    if why:
        warnings.warn(f"CPU decode kernels unavailable ({why}); decode uses torch's matmul, which is slower "
                      f"(FP8 / NVFP4 weights several times slower)", stacklevel=2)
        return None
    return bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with every entry point's argument and result types set."""
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int  # 0; -1: a scratch buffer could not be allocated
    return lib


def release_threads() -> None:
    """Give the calling thread's OpenMP worker threads back, before generation moves to another thread (a
    Stream's). libgomp (torch's and these kernels') keeps a team of workers for every thread that has
    started a parallel region; once the teams' threads outnumber the cores it stops spinning and sleeps in
    the kernel instead. Each decode step is one parallel region: its start and end then cost a wake-up
    (its barriers are step.c's own and keep spinning): the demo's C step took 148-172 us on a Stream's
    thread beside a kept team against 102-110 on the main thread, and, with OpenMP's barriers before,
    451-492 (docs/decode-speed.md, "The decode step's own barrier"). The calling thread's next parallel region starts
    a new team (tens of microseconds). Without the kernels, through the libgomp torch loaded: torch's own
    parallel work leaves teams too, and stream.py's engine thread outlives its generations."""
    if _library:
        _library.release_threads()
    elif (omp := _openmp()) is not None:
        omp.omp_pause_resource_all(1)  # omp_pause_soft


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The libgomp this process loaded (torch's, on Linux), found in /proc/self/maps; None elsewhere."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libgomp" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all.argtypes, lib.omp_pause_resource_all.restype = [ctypes.c_int], ctypes.c_int
            return lib
        except (OSError, AttributeError):  # not loadable, or older than OpenMP 5.0's call (gcc 9)
            continue
    return None


def float_mode() -> int | None:
    """The calling thread's floating-point mode (x86's MXCSR: torch.set_flush_denormal sets it, for its own
    thread only), or None where the kernels are not loaded. A thread that generates for another sets it
    with `set_float_mode` (stream.py's engine thread: new threads inherit it, a long-lived one does not)."""
    return _library.float_mode() if _library else None


def set_float_mode(mode: int | None) -> None:
    if mode is not None and _library:
        _library.set_float_mode(mode)


def serves(device: torch.device, rows: int, max_rows: int = MAX_ROWS) -> bool:
    """Whether an input of `rows` rows on `device` goes to the kernels."""
    return device.type == "cpu" and rows <= max_rows and library() is not None


def usable(x: Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether x (a CPU activation of a few rows) goes to the kernels."""
    return serves(x.device, x.numel() // x.shape[-1], max_rows)


# The wrappers below run ~70 times per decoded token: each torch call they avoid is a microsecond or two.

def _call(kernel, x: Tensor, n: int, weights: tuple, layout: tuple) -> Tensor:
    """kernel(x, *weights, y, M, N, K, *layout, threads) on x's rows as float32 into a new [..., n] tensor,
    returned in x's dtype."""
    xs = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[:-1] + (n,))
    k = x.shape[-1]
    if kernel(xs.data_ptr(), *weights, y.data_ptr(), xs.numel() // k, n, k, *layout, torch.get_num_threads()):
        raise MemoryError(f"out of memory for a {xs.numel() // k}x{k} input's scratch copy")
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def matvec(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T for a float32 / bfloat16 weight w [out, in] (rows contiguous: budgets' prefix views are).
    Inside a compiled decode step it is an op that inductor leaves opaque."""
    return (_matvec_op if torch.compiler.is_compiling() else _matvec)(x, w)


def _matvec(x: Tensor, w: Tensor) -> Tensor:
    kernel = _library.gemv_f32 if w.dtype == torch.float32 else _library.gemv_bf16
    return _call(kernel, x, w.shape[0], (w.data_ptr(),), (w.stride(0),))


@torch.library.custom_op("elastic_local::matvec", mutates_args=())
def _matvec_op(x: Tensor, w: Tensor) -> Tensor:
    return _matvec(x, w)


@_matvec_op.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


BF16_DOT_ENV = "ELASTIC_LOCAL_BF16_DOT"  # "0": bf16 prompts widen to float32 FMAs even where bf16 dots exist


def bf16_dot() -> bool:
    """Whether a bfloat16 prompt's products run on the CPU's bf16 dot products (AVX512-BF16: gemv.c's
    gemm_p_bf16x on bf16 panels, gemm_packed_bf16x on FP8 / NVFP4 rows, step.c's experts_prefill_bf16):
    where it has them, unless ELASTIC_LOCAL_BF16_DOT=0."""
    return os.environ.get(BF16_DOT_ENV) != "0" and bool(_library.bf16_dot())


def panels(x: Tensor, p: Tensor, skip: int, n: int) -> Tensor:
    """x @ W.T for a float32 or bf16 weight in column panels (linear.Panels; bf16 widened exactly as it is
    read, the same sums as its float32 panels, but a bf16 prompt on bf16 dot products where the CPU has
    them: `bf16_dot`), in x's dtype: p [panels, in, 24], panel rows
    contiguous, the view's `n` outputs starting `skip` columns into the first panel. Up to MAX_ROWS rows
    of x four panels at a time; more (a prompt) on the blocked product's tiles, which on this project's
    CPU ran 1.24-1.29x MKL's sgemm at 128 rows, 1.0-1.2x from 512 (docs/decode-speed.md, "Prefill products on packed
    panels"). Inside a compiled step it is an op that inductor leaves opaque."""
    return (_panels_op if torch.compiler.is_compiling() else _panels)(x, p, skip, n)


def _panels(x: Tensor, p: Tensor, skip: int, n: int) -> Tensor:
    few = x.numel() <= MAX_ROWS * x.shape[-1]
    if not few and x.dtype == p.dtype == torch.bfloat16 and x.shape[-1] % 2 == 0 and bf16_dot():
        xs, y = x.contiguous(), torch.empty(x.shape[:-1] + (n,))
        if _library.gemm_p_bf16x(xs.data_ptr(), p.data_ptr(), y.data_ptr(), xs.numel() // x.shape[-1], n,
                                 x.shape[-1], p.stride(0), skip, torch.get_num_threads()):
            raise MemoryError(f"out of memory for a {x.shape[-1]}-input weight's re-paired panels")
        return y.to(torch.bfloat16)
    if p.dtype == torch.float32:
        kernel = _library.gemv_p_f32 if few else _library.gemm_p_f32
    else:
        kernel = _library.gemv_p_bf16 if few else _library.gemm_p_bf16
    return _call(kernel, x, n, (p.data_ptr(),), (p.stride(0), skip))


@torch.library.custom_op("elastic_local::panels", mutates_args=())
def _panels_op(x: Tensor, p: Tensor, skip: int, n: int) -> Tensor:
    return _panels(x, p, skip, n)


@_panels_op.register_fake
def _(x: Tensor, p: Tensor, skip: int, n: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], n)


def fp8_panels(x: Tensor, p: Tensor, skip: int, n: int, scale: float) -> Tensor:
    """x @ (W * scale).T for e4m3 codes in column panels (quant.fp8.FP8Panels: p [panels, in, 24] bytes, the
    view's `n` outputs starting `skip` columns into the first panel), in x's dtype: one row decodes the
    codes in registers (three integer operations per eight weights), a few rows' tiles widen them as they
    read, more widen a panel's block once; a bf16 prompt runs on bf16 dot products where the CPU has them
    (`bf16_dot`)."""
    k = x.shape[-1]
    if x.dtype == torch.bfloat16 and x.numel() >= MAX_ROWS * k and k % 2 == 0 and bf16_dot():
        xs, y = x.contiguous(), torch.empty(x.shape[:-1] + (n,))
        if _library.gemm_p8_bf16x(xs.data_ptr(), p.data_ptr(), y.data_ptr(), xs.numel() // k, n, k, p.stride(0),
                                  skip, scale, torch.get_num_threads()):
            raise MemoryError(f"out of memory for a {k}-input weight's re-paired panels")
        return y.to(torch.bfloat16)
    return _call(_library.gemv_p_fp8, x, n, (p.data_ptr(),), (p.stride(0), skip, scale))


def panel_copy(w: Tensor, p: Tensor) -> bool:
    """p [.., panels, in, 24] = w [.., out, in] in panels of 24 outputs, for a 1-byte (e4m3 codes) or a bf16
    weight (its columns in linear.BF16_COLUMNS' order): gemv.c's panel_copy, a load's repacking at 1.7-3.6x
    torch's strided copy. False where it cannot (no kernels, another dtype, not contiguous on the CPU): the
    caller copies."""
    if (library() is None or w.device.type != "cpu" or not (w.element_size() == 1 or w.dtype == torch.bfloat16)
            or not w.is_contiguous() or not p.is_contiguous()):
        return False
    out, k = w.shape[-2:]
    _library.panel_copy(w.data_ptr(), p.data_ptr(), w.numel() // max(out * k, 1), out, k, w.element_size())
    return True


_FP8, _NVFP4 = 2, 3  # gemv.c's PANEL_FP8, PANEL_NVFP4


def fp8(x: Tensor, codes: Tensor, scale: float) -> Tensor:
    """x @ (codes * scale).T for e4m3 codes [out, in] (rows contiguous)."""
    if (y := _packed_bf16(_FP8, x, codes, None, scale)) is not None:
        return y
    return _call(_library.gemv_fp8, x, codes.shape[0], (codes.data_ptr(),), (codes.stride(0), scale))


def nvfp4(x: Tensor, codes: Tensor, block_scales: Tensor, scale: float) -> Tensor:
    """x @ W.T for NVFP4 codes [out, in/2] (two per byte) and e4m3 block scales [out, in/16]."""
    if (y := _packed_bf16(_NVFP4, x, codes, block_scales, scale)) is not None:
        return y
    return _call(_library.gemv_nvfp4, x, codes.shape[0], (codes.data_ptr(), block_scales.data_ptr()),
                 (codes.stride(0), block_scales.stride(0), scale))


def nvfp4_a4(x: Tensor, codes: Tensor, block_scales: Tensor, scale: float, input_scale: float) -> Tensor:
    """nvfp4() with x's rows rounded to NVFP4 first (W4A4: gemv.c's integer products for one row); input_scale
    0: each row's own amax / (6 * 448)."""
    return _call(_library.gemv_nvfp4_a4, x, codes.shape[0], (codes.data_ptr(), block_scales.data_ptr()),
                 (codes.stride(0), block_scales.stride(0), scale, input_scale))


def nvfp4_round(x: Tensor, input_scale: float) -> Tensor:
    """x [.., K] (float32, K % 16 == 0) with each row rounded to NVFP4 and back (gemv.c nvfp4_round_rows)."""
    xs = x.contiguous()
    out = torch.empty_like(xs)
    _library.nvfp4_round_rows(xs.data_ptr(), out.data_ptr(), xs.numel() // x.shape[-1], x.shape[-1], input_scale)
    return out


def _packed_bf16(fmt: int, x: Tensor, codes: Tensor, block_scales: Tensor | None, scale: float) -> Tensor | None:
    """A bf16 prompt (MAX_ROWS rows or more) on packed weights, on the bf16 dots where the CPU has them (their
    values are exact in bf16; gemv.c's gemm_packed_bf16x); None where the float32 kernels take it."""
    k = x.shape[-1]
    if x.dtype != torch.bfloat16 or x.numel() < MAX_ROWS * k or k % 2 or not bf16_dot():
        return None
    xs, y = x.contiguous(), torch.empty(x.shape[:-1] + (codes.shape[0],))
    if _library.gemm_packed_bf16x(fmt, xs.data_ptr(), codes.data_ptr(), 0 if block_scales is None else
                                  block_scales.data_ptr(), y.data_ptr(), xs.numel() // k, codes.shape[0], k,
                                  codes.stride(0), 0 if block_scales is None else block_scales.stride(0), scale,
                                  torch.get_num_threads()):
        raise MemoryError(f"out of memory for a {xs.numel() // k}x{k} prompt's packed panels")
    return y.to(torch.bfloat16)
