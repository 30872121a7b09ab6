"""Probe the live machine: NVIDIA GPUs through NVML, RAM and cores through psutil, what torch sees.

Contract: `probe_machine()` never raises. No NVML library, no driver, no GPU, or an NVML error in the
middle of the walk gives a CPU-only result whose `notes` say why; the planner then plans for RAM.
Everything NVML reports is read through attribute lookups on the `pynvml` module at call time, so tests
replace single functions of that module and nothing else.

Free VRAM is read *now*: memory held by other programs (a desktop, a browser, another model) is not
available to us, which is the most common reason local runners run out of memory.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
from dataclasses import asdict, dataclass, field

import psutil


class _NvmlStepError(Exception):
    """An NVML call we cannot do without failed; carries which call, for the note."""

    def __init__(self, call: str, error: Exception):
        super().__init__(f"{call}: {error}")


@dataclass
class GpuProcess:
    pid: int
    used_bytes: int | None  # None where the driver does not say (Windows WDDM)


@dataclass
class GpuInfo:
    index: int  # NVML order (PCI bus); CUDA's order can differ, match on uuid
    name: str
    uuid: str | None  # "GPU-..."; None where NVML does not say
    total_bytes: int
    free_bytes: int
    used_bytes: int
    reserved_bytes: int | None  # driver/firmware reservation; only memory info v2 reports it
    memory_info_version: int  # 2 where the driver has nvmlDeviceGetMemoryInfo_v2, else 1
    compute_capability: tuple[int, int]
    memory_bandwidth_gbps: float | None  # bus width x max memory clock x 2 (DDR); None if not reported
    processes: list[GpuProcess] | None  # None: the driver does not list them (NotSupported)
    other_processes_bytes: int  # summed usedGpuMemory of processes other than this one

    @property
    def sm(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


@dataclass
class MachineProbe:
    gpus: list[GpuInfo]
    driver_version: str | None
    cuda_driver_version: str | None  # the newest CUDA the driver supports, e.g. "12.8"
    torch_version: str | None
    torch_cuda_build: str | None  # torch.version.cuda; None for a CPU build of torch
    torch_cuda: bool  # torch.cuda.is_available()
    torch_gpu_name: str | None  # device 0 as torch sees it; fills in where NVML cannot (Jetson)
    torch_gpu_capability: tuple[int, int] | None
    torch_gpu_integrated: bool  # shares system RAM (Jetson, GB10)
    torch_gpu_uuid: str | None  # ties torch's cuda:0 to an NVML GpuInfo.uuid
    mamba_ssm: bool
    causal_conv1d: bool
    ram_total_bytes: int
    ram_available_bytes: int
    cpu_physical_cores: int | None
    cpu_logical_cores: int | None
    notes: list[str] = field(default_factory=list)
    ram_read_gbps: float | None = None  # measured when no GPU runs the model: the CPU's decode ceiling
    cpu_kernels: bool = False  # model/gemv.c's kernels run here (x86 with AVX2 and a C compiler)

    def to_dict(self) -> dict:
        d = asdict(self)
        for g, gd in zip(self.gpus, d["gpus"], strict=True):
            gd["compute_capability"] = "{}.{}".format(*g.compute_capability)
        if self.torch_gpu_capability is not None:
            d["torch_gpu_capability"] = "{}.{}".format(*self.torch_gpu_capability)
        return d


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"  # NVML encodes 12.8 as 12080


def _memory_info(nvml, handle) -> tuple[int, int, int, int | None, int]:
    """(total, free, used, reserved, version): v2 where the driver has it, else v1."""
    v2 = getattr(nvml, "nvmlMemory_v2", None)
    if v2 is not None:
        try:
            m = nvml.nvmlDeviceGetMemoryInfo(handle, version=v2)
            return m.total, m.free, m.used, m.reserved, 2
        except nvml.NVMLError:
            pass  # old driver: no _v2 entry point (FunctionNotFound) or version mismatch
    m = nvml.nvmlDeviceGetMemoryInfo(handle)
    return m.total, m.free, m.used, None, 1


def _bandwidth_gbps(nvml, handle) -> float | None:
    try:
        bus_bits = nvml.nvmlDeviceGetMemoryBusWidth(handle)
        mem_mhz = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_MEM)
    except (nvml.NVMLError, AttributeError):  # NotSupported, or bindings too old to have the call
        return None
    # NVML's memory clock is half the data rate for every GDDR/HBM generation: RTX 4090 10501 MHz x 2
    # x 384 bit / 8 = 1008 GB/s, H100 SXM 2619 MHz x 2 x 5120 / 8 = 3352 GB/s.
    return bus_bits / 8 * mem_mhz * 2 / 1000 if bus_bits and mem_mhz else None


def _uuid(nvml, handle) -> str | None:
    try:
        return _text(nvml.nvmlDeviceGetUUID(handle))
    except (nvml.NVMLError, AttributeError):
        return None


def _processes(nvml, handle) -> list[GpuProcess] | None:
    """Compute and graphics processes on this GPU, one row per pid; None when not supported."""
    seen: dict[int, GpuProcess] = {}
    supported = False
    for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            rows = getattr(nvml, fn)(handle)
        except (nvml.NVMLError, AttributeError):
            continue  # NotSupported on some GeForce/Jetson drivers, NoPermission in containers
        supported = True
        for p in rows:
            used = p.usedGpuMemory
            prev = seen.get(p.pid)
            if prev is None or (used or 0) > (prev.used_bytes or 0):
                seen[p.pid] = GpuProcess(p.pid, used)
    return list(seen.values()) if supported else None


def _required(call: str, fn, *args, **kwargs):
    """Run an NVML call we cannot do without; any failure names the call."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # NVMLError, or a broken binding (AttributeError, OSError)
        raise _NvmlStepError(call, e) from e


def _gpu(nvml, index: int) -> GpuInfo:
    handle = _required("nvmlDeviceGetHandleByIndex", nvml.nvmlDeviceGetHandleByIndex, index)
    name = _text(_required("nvmlDeviceGetName", nvml.nvmlDeviceGetName, handle))
    total, free, used, reserved, version = _required("nvmlDeviceGetMemoryInfo", _memory_info, nvml, handle)
    cc = _required("nvmlDeviceGetCudaComputeCapability", nvml.nvmlDeviceGetCudaComputeCapability, handle)
    procs = _processes(nvml, handle)
    me = os.getpid()
    others = sum(p.used_bytes or 0 for p in procs or [] if p.pid != me)
    return GpuInfo(
        index=index, name=name, uuid=_uuid(nvml, handle), total_bytes=total, free_bytes=free, used_bytes=used,
        reserved_bytes=reserved, memory_info_version=version, compute_capability=(int(cc[0]), int(cc[1])),
        memory_bandwidth_gbps=_bandwidth_gbps(nvml, handle), processes=procs, other_processes_bytes=others,
    )


def _probe_nvml(notes: list[str]) -> tuple[list[GpuInfo], str | None, str | None]:
    """(gpus, driver version, CUDA driver version); ([], None, None) plus a note on any failure."""
    try:
        import pynvml as nvml
    except ImportError:
        notes.append("NVML bindings not installed (pip install nvidia-ml-py): treating as CPU-only")
        return [], None, None
    try:
        nvml.nvmlInit()
    except Exception as e:  # LibraryNotFound (no driver), DriverNotLoaded, ...
        notes.append(f"NVML unavailable ({e}): no NVIDIA driver found, treating as CPU-only")
        return [], None, None
    try:
        driver = _text(_required("nvmlSystemGetDriverVersion", nvml.nvmlSystemGetDriverVersion))
        cuda = _cuda_version(
            _required("nvmlSystemGetCudaDriverVersion", nvml.nvmlSystemGetCudaDriverVersion)
        )
        count = _required("nvmlDeviceGetCount", nvml.nvmlDeviceGetCount)
        gpus = [_gpu(nvml, i) for i in range(count)]
    except _NvmlStepError as e:
        notes.append(f"NVML failed mid-probe ({e}): treating as CPU-only")
        return [], None, None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass  # shutting down is best effort; the readings are already taken
    if not gpus:
        notes.append(f"NVIDIA driver {driver} present but no GPU visible: treating as CPU-only")
    return gpus, driver, cuda


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass
class _TorchView:
    version: str | None = None
    cuda_build: str | None = None
    cuda: bool = False
    gpu_name: str | None = None
    gpu_capability: tuple[int, int] | None = None
    integrated: bool = False
    uuid: str | None = None


def _probe_torch(notes: list[str]) -> _TorchView:
    """What torch sees; torch is imported only here and only if installed."""
    t = _TorchView()
    if not _has("torch"):
        notes.append("torch is not installed")
        return t
    try:
        import torch

        t.version, t.cuda_build = torch.__version__, torch.version.cuda
        t.cuda = torch.cuda.is_available()
        if t.cuda:
            props = torch.cuda.get_device_properties(0)
            t.gpu_name, t.gpu_capability = props.name, (props.major, props.minor)
            t.integrated = bool(props.is_integrated)
            t.uuid = "GPU-" + str(props.uuid).removeprefix("GPU-")  # NVML's spelling: "GPU-<uuid>"
    except Exception as e:  # a broken CUDA install raises from inside torch.cuda
        notes.append(f"torch failed to query CUDA ({e})")
        t.cuda = False
    return t


@functools.cache
def ram_read_bandwidth_gbps(mib: int = 256, reps: int = 3) -> float | None:
    """RAM read bandwidth as torch's CPU kernels see it (GB/s): the best of `reps` sums over a buffer far
    larger than any cache. Decode on a CPU reads every active weight once per token, so this bounds its
    speed the way a GPU's memory bandwidth does. Measured once per process (~0.3 s); None without torch."""
    if not _has("torch"):
        return None
    import torch

    x = torch.ones(mib * 2**20 // 4)
    x.sum()  # first touch: page faults are not bandwidth
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def probe_machine() -> MachineProbe:
    """Read the machine as it is now. Never raises; reasons for a CPU-only result go to `notes`."""
    from ..model import gemv  # with torch, which the probe reads anyway; `profiles` and `paths` do not

    notes: list[str] = []
    gpus, driver, cuda = _probe_nvml(notes)
    t = _probe_torch(notes)
    if gpus and t.version is not None and t.cuda_build is None:
        notes.append(f"torch {t.version} is a CPU build: install a CUDA wheel of torch to use the GPU")
    elif gpus and t.version is not None and not t.cuda:
        notes.append("torch cannot reach the GPU (torch.cuda.is_available() is False): check driver/CUDA")
    if not gpus and t.cuda:
        notes.append(f"torch sees CUDA device {t.gpu_name!r} that NVML did not report"
                     + (" (integrated: shares system RAM)" if t.integrated else ""))

    mamba, conv = _has("mamba_ssm"), _has("causal_conv1d")
    if gpus or t.cuda:
        missing = [m for m, ok in (("mamba_ssm", mamba), ("causal_conv1d", conv)) if not ok]
        if missing:
            notes.append(f"{' and '.join(missing)} not installed: Mamba layers use the slower pure-torch path"
                         " (pip install --no-build-isolation 'elastic-local[cuda]')")

    vm = psutil.virtual_memory()
    return MachineProbe(
        gpus=gpus, driver_version=driver, cuda_driver_version=cuda, torch_version=t.version,
        torch_cuda_build=t.cuda_build, torch_cuda=t.cuda, torch_gpu_name=t.gpu_name,
        torch_gpu_capability=t.gpu_capability, torch_gpu_integrated=t.integrated, torch_gpu_uuid=t.uuid,
        mamba_ssm=mamba, causal_conv1d=conv,
        ram_total_bytes=vm.total, ram_available_bytes=vm.available,
        cpu_physical_cores=psutil.cpu_count(logical=False), cpu_logical_cores=psutil.cpu_count(logical=True),
        notes=notes, ram_read_gbps=None if gpus or t.cuda else ram_read_bandwidth_gbps(),
        cpu_kernels=gemv.runs_here(),
    )
