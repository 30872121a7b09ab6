"""What `elastic-chat` does before the chat opens: find the model, ask the fit planner what this machine
(or a profile) runs, and load that with progress. The planner and the loader are the library's.

Everything that needs torch (the device, the sampling flags' range, the plan, the load) runs on the
loading screen's worker, so the screen shows at once, not after torch's seconds of import."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from elastic_local.hardware.profiles import GIB
from elastic_local.paths import default_model

if TYPE_CHECKING:
    import torch

    from elastic_local.engine import ElasticModel
    from elastic_local.hardware import Plan
    from elastic_local.progress import Progress


@dataclass
class Options:
    dir: Path
    profile: str = "auto"
    context: int = 4096
    budget: str | None = None  # None: the planner's pick
    precision: str | None = None  # None: the planner's pick
    device: str = "auto"  # auto: cuda with a GPU torch sees, else cpu, as every command; `plan` resolves it
    activations: str = "float"  # nvfp4: NVFP4 weights round their inputs too (W4A4; elastic_local.load)


@dataclass
class Pick:
    """What will be loaded, and why (the planner's sentence and the memory it predicts)."""

    budget: str | None
    precision: str | None
    why: str
    memory: str
    dtype: torch.dtype | None = None  # compute dtype; None: the loader's default (bf16 on a GPU)
    activations: str = "float"  # nvfp4: NVFP4 weights' inputs rounded too (W4A4)

    @property
    def line(self) -> str:
        compute = "" if self.dtype is None else f", {str(self.dtype).removeprefix('torch.')} compute"
        rounded = ", inputs rounded to NVFP4 (W4A4)" if self.activations == "nvfp4" else ""
        return (f"budget {self.budget or 'stored'}, precision {self.precision or 'stored'}{rounded}{compute}, "
                f"{self.memory}")


def model_dir(arg: str | None) -> Path:
    """DIR, or the embedded demo model (`elastic_local.paths.default_model`); a clear error when it is not there."""
    if not arg:
        return default_model()
    path = Path(arg)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json; point elastic-chat at a checkpoint directory "
                                "(config.json, *.safetensors, tokenizer.json), or give no DIR for the demo model")
    return path


def check_sampling(session_options: dict) -> None:
    """The sampling flags among the chat's options, out of range: a ValueError before the load."""
    from elastic_local.engine.sampling import Sampling

    from .session import SAMPLING

    Sampling(**{k: v for k, v in session_options.items() if k in SAMPLING})


def plan(o: Options) -> tuple[Plan, Pick]:
    """The fit planner's view of the model on the machine, and the pick (options given win over it). With
    profile auto it plans for the device the model loads on: the GPU, or this machine's RAM for cpu. It
    resolves `o.device` first (cuda without a GPU is a ValueError naming the fix)."""
    import torch

    from elastic_local.cli import resolve_device
    from elastic_local.hardware import get_profile
    from elastic_local.hardware.fit import in_float32, live_profile, plan_checkpoint, summary

    o.device = resolve_device(o.device)
    profile = live_profile(o.device) if o.profile == "auto" else get_profile(o.profile)
    p = plan_checkpoint(o.dir, profile, context=o.context)
    c = p.pick
    if c is None and (o.budget is None or o.precision is None):
        raise ValueError(summary(p))
    budget = o.budget or c.budget
    precision = o.precision or c.precision
    chosen = next((x for x in p.candidates if x.budget == budget and x.precision == precision), None)
    dtype = None
    if o.device == "cpu":  # float32 where it fits (the C decode step, 2-3x bf16's speed here), else bf16
        wide = in_float32(o.dir, profile, budget, precision, context=o.context)
        dtype = torch.bfloat16 if wide is None else torch.float32
        chosen = wide or chosen
    memory = ("memory ? (not a candidate of the plan)" if chosen is None else
              f"memory {chosen.total_bytes / GIB:.2f} of {p.available_bytes / GIB:.2f} GiB")
    return p, Pick(budget, precision, summary(p), memory, dtype, o.activations)


def load(o: Options, pick: Pick, progress: Progress | None = None) -> ElasticModel:
    import elastic_local

    return elastic_local.load(o.dir, budget=pick.budget, precision=pick.precision, device=o.device,
                              dtype=pick.dtype, progress=progress, activations=pick.activations)
