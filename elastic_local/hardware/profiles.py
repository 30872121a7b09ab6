"""Hardware profiles: a machine described in a TOML file, so the planner can run without having it.

Schema of `profiles/<name>.toml` (one table, top level; unknown keys are errors, to catch typos):

    name = "rtx5080"              # optional; defaults to the file stem and, if given, must equal it
    description = "NVIDIA GeForce RTX 5080 16 GB"                  # required
    kind = "cuda"                 # required: "cuda" (discrete GPU) | "unified" (GPU sharing system
                                  #   RAM: Jetson, GB10) | "cpu"
    memory_gib = 16               # required, exactly one of memory_gib (GiB, 2**30) / memory_bytes:
                                  #   VRAM for "cuda", RAM for "cpu" and "unified"
    compute_capability = "12.0"   # "major.minor"; required for cuda/unified, absent for cpu
    memory_bandwidth_gbps = 960   # required: peak memory bandwidth, GB/s (1e9 bytes/s)
    reserved_mib = 1024           # optional (default 0), at most one of reserved_mib / reserved_bytes:
                                  #   what the driver, OS and desktop take before we load anything
    cpu_kernels = true            # optional, kind "cpu" only (default false): an x86 CPU with AVX2, where
                                  #   model/gemv.c's kernels run (FP8 / NVFP4 decoded in registers)
    notes = "..."                 # optional
    source = "..."                # optional: where the figures come from

Available memory = memory - reserved. Shipped profiles live in `profiles/` at the repository root (a
source checkout) or in the package's `profiles_data/` (a wheel); the user adds or overrides them in
`<config dir>/profiles/*.toml`, and the user's file of the same name wins. The name "auto" is the live
machine (`profile_from_probe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..paths import config_dir
from .probe import MachineProbe, probe_machine

KINDS = ("cuda", "unified", "cpu")
GIB, MIB = 2**30, 2**20
_KEYS = {"name", "description", "kind", "memory_gib", "memory_bytes", "compute_capability",
         "memory_bandwidth_gbps", "reserved_mib", "reserved_bytes", "cpu_kernels", "notes", "source"}


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    kind: str
    memory_bytes: int
    memory_bandwidth_gbps: float | None  # None: unknown (a live machine NVML could not measure)
    compute_capability: tuple[int, int] | None = None
    reserved_bytes: int = 0
    cpu_kernels: bool = False  # kind "cpu": model/gemv.c's kernels run there (FP8 / NVFP4 read as packed)
    notes: str = ""
    source: str = ""
    path: Path | None = None  # the file it came from; None for "auto"

    @property
    def available_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes

    @property
    def sm(self) -> str | None:
        cc = self.compute_capability
        return None if cc is None else f"sm_{cc[0]}{cc[1]}"

    def to_dict(self) -> dict:
        cc = self.compute_capability
        return {
            "name": self.name, "description": self.description, "kind": self.kind,
            "memory_bytes": self.memory_bytes, "reserved_bytes": self.reserved_bytes,
            "available_bytes": self.available_bytes,
            "compute_capability": None if cc is None else f"{cc[0]}.{cc[1]}",
            "memory_bandwidth_gbps": self.memory_bandwidth_gbps, "cpu_kernels": self.cpu_kernels,
            "notes": self.notes, "source": self.source,
            "path": None if self.path is None else str(self.path),
        }


def shipped_profile_dirs() -> list[Path]:
    """Folders of the profiles that ship with elastic-local, lowest precedence first."""
    pkg = Path(__file__).resolve().parents[1]
    dirs = [pkg / "profiles_data"]  # installed wheel
    checkout = pkg.parent
    if (checkout / "pyproject.toml").is_file():  # a source checkout, not site-packages/profiles of others
        dirs.append(checkout / "profiles")
    return [d for d in dirs if d.is_dir()]


def user_profile_dir() -> Path:
    return config_dir() / "profiles"


def _profile_dirs() -> list[Path]:
    return shipped_profile_dirs() + [user_profile_dir()]


def _number(path: Path, raw: dict, key: str, *, positive: bool) -> float | None:
    if key not in raw:
        return None
    v = raw[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (v <= 0 if positive else v < 0):
        need = "a positive number" if positive else "a number >= 0"
        raise ProfileError(f"{path}: field '{key}' must be {need}, got {v!r}")
    return v


def _one_of(path: Path, raw: dict, keys: tuple[str, str], scales: tuple[int, int], *, required: bool,
            positive: bool) -> int:
    """Exactly one (or, if not required, at most one) of two spellings of a size; returns bytes."""
    given = [k for k in keys if k in raw]
    if len(given) > 1:
        raise ProfileError(f"{path}: fields '{keys[0]}' and '{keys[1]}' both given; use one")
    if not given:
        if required:
            raise ProfileError(f"{path}: field '{keys[0]}' (or '{keys[1]}') is required")
        return 0
    key = given[0]
    value = _number(path, raw, key, positive=positive)
    return int(round(value * scales[keys.index(key)]))


def _text(path: Path, raw: dict, key: str, *, required: bool = False) -> str:
    if key not in raw:
        if required:
            raise ProfileError(f"{path}: field '{key}' is required")
        return ""
    if not isinstance(raw[key], str):
        raise ProfileError(f"{path}: field '{key}' must be a string, got {raw[key]!r}")
    return raw[key]


def _capability(path: Path, raw: dict, kind: str) -> tuple[int, int] | None:
    key = "compute_capability"
    if kind == "cpu":
        if key in raw:
            raise ProfileError(f"{path}: field '{key}' is not allowed for kind 'cpu'")
        return None
    if key not in raw:
        raise ProfileError(f"{path}: field '{key}' is required for kind '{kind}'")
    v = raw[key]
    parts = v.split(".") if isinstance(v, str) else []
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ProfileError(f"{path}: field '{key}' must be a \"major.minor\" string like \"12.0\", got {v!r}")
    return int(parts[0]), int(parts[1])


def parse_profile(raw: dict, path: Path) -> Profile:
    """Validate one parsed TOML table; `path` names the file in errors and gives the default name."""
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ProfileError(f"{path}: unknown field '{unknown[0]}' (known: {', '.join(sorted(_KEYS))})")
    name = _text(path, raw, "name") or path.stem
    if name != path.stem:
        raise ProfileError(f"{path}: field 'name' is {name!r} but the file is named {path.stem!r}")
    kind = _text(path, raw, "kind", required=True)
    if kind not in KINDS:
        raise ProfileError(f"{path}: field 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    memory = _one_of(path, raw, ("memory_gib", "memory_bytes"), (GIB, 1), required=True, positive=True)
    reserved = _one_of(path, raw, ("reserved_mib", "reserved_bytes"), (MIB, 1), required=False,
                       positive=False)
    if reserved >= memory:
        key = "reserved_mib" if "reserved_mib" in raw else "reserved_bytes"
        raise ProfileError(f"{path}: field '{key}' ({reserved} bytes) must be below the memory ({memory})")
    bandwidth = _number(path, raw, "memory_bandwidth_gbps", positive=True)
    if bandwidth is None:
        raise ProfileError(f"{path}: field 'memory_bandwidth_gbps' is required")
    kernels = raw.get("cpu_kernels", False)
    if not isinstance(kernels, bool):
        raise ProfileError(f"{path}: field 'cpu_kernels' must be true or false, got {kernels!r}")
    if kernels and kind != "cpu":
        raise ProfileError(f"{path}: field 'cpu_kernels' is for kind 'cpu' (this profile is {kind!r}); remove it")
    return Profile(
        name=name, description=_text(path, raw, "description", required=True), kind=kind,
        memory_bytes=memory, memory_bandwidth_gbps=float(bandwidth),
        compute_capability=_capability(path, raw, kind), reserved_bytes=reserved, cpu_kernels=kernels,
        notes=_text(path, raw, "notes"), source=_text(path, raw, "source"), path=path,
    )


def load_profile_file(path: str | Path) -> Profile:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ProfileError(f"{path}: cannot read ({e.strerror or e})") from e
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path}: invalid TOML ({e})") from e
    return parse_profile(raw, path)


def list_profiles() -> dict[str, Profile]:
    """Every shipped and user profile by name; a user file overrides a shipped one of the same name."""
    out: dict[str, Profile] = {}
    for d in _profile_dirs():
        for f in sorted(d.glob("*.toml")):
            out[f.stem] = load_profile_file(f)
    return dict(sorted(out.items()))


def get_profile(name: str) -> Profile:
    """"auto" (the live machine), a path to a .toml file, or the name of a shipped or user profile."""
    if name == "auto":
        return profile_from_probe(probe_machine())
    if name.endswith(".toml"):
        return load_profile_file(name)
    for d in reversed(_profile_dirs()):
        if (f := d / f"{name}.toml").is_file():
            return load_profile_file(f)
    known = sorted({f.stem for d in _profile_dirs() for f in d.glob("*.toml")})
    raise ProfileError(f"no hardware profile named {name!r}; known: auto, {', '.join(known)}")


def profile_from_probe(p: MachineProbe, device: int | None = None) -> Profile:
    """The live machine as a profile named "auto": free memory *now* is what is available.

    GPU: NVML device `device`, by default the one torch uses as cuda:0 (matched by uuid: NVML counts in
    PCI order, CUDA may not), else NVML's first; reserved = total - free, so the driver reservation, the
    desktop and every other process are counted. One GPU is planned for. An integrated GPU that only
    torch sees (Jetson) plans against RAM as "unified"; otherwise RAM total and available, as "cpu"
    (bandwidth unknown).
    """
    if p.gpus:
        if device is None:
            device = next((i for i, g in enumerate(p.gpus) if g.uuid and g.uuid == p.torch_gpu_uuid), 0)
        g = p.gpus[device]
        others = f"; other processes hold {g.other_processes_bytes / GIB:.2f} GiB" if g.processes else ""
        if len(p.gpus) > 1:
            others += f"; planning for 1 of {len(p.gpus)} GPUs"
        return Profile(
            name="auto", description=f"live: GPU {g.index} {g.name}", kind="cuda",
            memory_bytes=g.total_bytes, memory_bandwidth_gbps=g.memory_bandwidth_gbps,
            compute_capability=g.compute_capability, reserved_bytes=g.total_bytes - g.free_bytes,
            notes="; ".join([f"free now {g.free_bytes / GIB:.2f} of {g.total_bytes / GIB:.2f} GiB{others}",
                             *p.notes]),
            source=f"NVML (driver {p.driver_version}, memory info v{g.memory_info_version})",
        )
    ram = f"available now {p.ram_available_bytes / GIB:.2f} of {p.ram_total_bytes / GIB:.2f} GiB RAM"
    if p.torch_cuda and p.torch_gpu_integrated and p.torch_gpu_capability is not None:
        return Profile(
            name="auto", description=f"live: {p.torch_gpu_name} (integrated)", kind="unified",
            memory_bytes=p.ram_total_bytes, memory_bandwidth_gbps=None,
            compute_capability=p.torch_gpu_capability,
            reserved_bytes=p.ram_total_bytes - p.ram_available_bytes,
            notes="; ".join([ram, *p.notes]), source="torch.cuda + psutil",
        )
    bw = [] if p.ram_read_gbps is None else [f"RAM read {p.ram_read_gbps:.1f} GB/s measured now"]
    return Profile(
        name="auto", description=f"live: CPU ({p.cpu_physical_cores} cores)", kind="cpu",
        memory_bytes=p.ram_total_bytes, memory_bandwidth_gbps=p.ram_read_gbps,
        reserved_bytes=p.ram_total_bytes - p.ram_available_bytes, cpu_kernels=p.cpu_kernels,
        notes="; ".join([ram, *bw, *p.notes]), source="psutil",
    )


def render_profiles(profiles: dict[str, Profile]) -> str:
    """One line per profile: name, memory (total and usable), compute capability, bandwidth, where from."""
    rows = [("name", "kind", "memory", "usable", "sm", "GB/s", "description / source")]
    for name, p in profiles.items():
        bw = "-" if p.memory_bandwidth_gbps is None else f"{p.memory_bandwidth_gbps:g}"
        rows.append((name, p.kind, f"{p.memory_bytes / GIB:.1f} GiB", f"{p.available_bytes / GIB:.1f} GiB",
                     p.sm or "-", bw, f"{p.description}; {p.source or p.path}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(" ".join(v.ljust(w) for v, w in zip(r, widths)) + " " + r[-1] for r in rows)
