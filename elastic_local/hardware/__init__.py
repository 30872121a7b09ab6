"""Hardware: probe the live machine, describe machines as profiles, plan what fits."""

from ..model.cost import ArchShape
from .planner import Candidate, Plan, WeightOption, Workload, compute_gate, plan, render_plan
from .probe import GpuInfo, MachineProbe, probe_machine
from .profiles import Profile, ProfileError, get_profile, list_profiles, load_profile_file, profile_from_probe

__all__ = [
    "ArchShape", "Candidate", "GpuInfo", "MachineProbe", "Plan", "Profile", "ProfileError", "WeightOption",
    "Workload", "compute_gate", "get_profile", "list_profiles", "load_profile_file", "plan", "probe_machine",
    "profile_from_probe", "render_plan",
]
