"""The training recipe: sizes, steps and rates in one TOML file; the command line overrides them.

    [train]                       # every key optional; these are the defaults
    steps = 200
    batch_size = 8
    seq_len = 256                 # stage 2 (long context); stage 1 uses stage1_seq_len
    ...
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import tomllib

from .router import DEFAULT_AXES, ROUTED_AXES


@dataclass
class Recipe:
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    stage1_seq_len: int = 64
    stage1_fraction: float = 0.5  # share of the steps in stage 1 (short context, budgets uniform)
    stage2_weights: list[float] = field(default_factory=lambda: [0.5, 0.3, 0.2])  # largest budget first
    lr: float = 1e-4
    router_lr: float = 1e-2
    warmup_steps: int = 10
    grad_clip: float = 1.0
    router_hidden: int = 64
    router_axes: list[str] = field(default_factory=lambda: list(DEFAULT_AXES))  # the axes the router sizes
    autocast: str = "auto"  # forwards in bf16 autocast (fp32 master weights): auto = on a GPU, bf16, off
    max_choices: int = 8
    heterogeneous: bool = True
    tau_start: float = 1.0
    tau_end: float = 0.05
    scale_start: float = 1.0
    scale_end: float = 10.0
    cost_lambda: float = 1.0
    dead_zone: float = 0.05
    # what the size penalty prices: "argmax", the configuration that ships (straight-through, router.shipped);
    # "samples", the Gumbel samples the distillation runs (saturates late in the anneal; the demo's third build)
    cost_on: str = "argmax"
    heldout_fraction: float = 0.05
    checkpoint_every: int = 50
    seed: int = 0

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides) -> Recipe:
        data: dict = {}
        if path is not None:
            try:
                doc = tomllib.loads(Path(path).read_text())
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"{path}: not valid TOML: {e}") from None
            data = doc.get("train", doc)
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(data) - known)
            if unknown:
                raise ValueError(f"{path}: unknown recipe key(s) {unknown}; known: {sorted(known)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        r = cls(**data)
        r.check(str(path or "recipe"))
        return r

    def check(self, where: str) -> None:
        for name in ("steps", "batch_size", "seq_len", "stage1_seq_len", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{where}: {name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.stage1_fraction <= 1:
            raise ValueError(f"{where}: stage1_fraction must be in 0..1, got {self.stage1_fraction}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"{where}: heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if self.cost_on not in ("argmax", "samples"):
            raise ValueError(f"{where}: cost_on must be argmax or samples, got {self.cost_on!r}")
        if self.autocast not in ("auto", "bf16", "off"):
            raise ValueError(f"{where}: autocast must be auto, bf16 or off, got {self.autocast!r}")
        unknown = sorted(set(self.router_axes) - set(ROUTED_AXES))
        if unknown:
            raise ValueError(f"{where}: router_axes {unknown} unknown; choose from {list(ROUTED_AXES)}")
        if any(w < 0 for w in self.stage2_weights) or not sum(self.stage2_weights) > 0:
            raise ValueError(f"{where}: stage2_weights must be non-negative and not all zero")

    def autocast_on(self, device: str) -> bool:
        """bf16 autocast for this device: a GPU's tensor cores want it; on a CPU it is opt-in (slower here)."""
        return self.autocast == "bf16" or (self.autocast == "auto" and device.startswith("cuda"))

    def stage1_steps(self) -> int:
        return round(self.steps * self.stage1_fraction)

    def to_dict(self) -> dict:
        return asdict(self)
