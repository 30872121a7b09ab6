"""The budget router (SPEC 2): a budget in, a configuration out.

Per elastic axis a 2-layer MLP (LeakyReLU) maps the budget's one-hot over the trained budgets to logits
over that axis's aligned candidate sizes, one set per layer (heterogeneous) or one for all layers of
the kind (homogeneous). Training samples the sizes with Gumbel-Softmax (temperature annealed, logits
scaled up); evaluation and export take the argmax. A budget between two trained ones feeds the router
the interpolation of their one-hots, so an unseen budget needs no retraining.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..elastic.table import ALIGN, LAYER_AXES
from ..model.budget import Budget, count_params
from ..model.config import NemotronHConfig
from ..model.soft import SoftLayer, SoftSize

# what the router can size: `hidden` (one width for the whole network), and per layer heads, experts (only
# with n_group == 1: group-limited routing fixes each group's experts) and channels. The default leaves the
# hidden width and the expert count out: on the demo, at equal steps, routing them too distilled every
# budget worse (held-out KD mid 0.136 against 0.040; README "Elastic training"); recipe `router_axes`
# turns them on.
ROUTED_AXES = ("hidden", "mamba_heads", "attention_heads", "experts", "expert_channels", "shared_channels",
               "mlp_channels")
DEFAULT_AXES = tuple(a for a in ROUTED_AXES if a not in ("hidden", "experts"))


def _full_size(cfg: NemotronHConfig, axis: str) -> int:
    return {"hidden": cfg.hidden_size, "mamba_heads": cfg.mamba_num_heads, "attention_heads": cfg.num_attention_heads,
            "experts": cfg.n_routed_experts, "expert_channels": cfg.moe_intermediate_size,
            "shared_channels": cfg.moe_shared_expert_intermediate_size,
            "mlp_channels": cfg.intermediate_size}[axis]


def _unit(cfg: NemotronHConfig, axis: str) -> int:
    """The smallest size step that keeps every input-dimension cut a multiple of 16 (and heads per group)."""
    if axis == "mamba_heads":
        per = cfg.n_groups * cfg.mamba_head_dim
        return cfg.n_groups * (ALIGN // math.gcd(ALIGN, per))
    if axis == "attention_heads":
        per = cfg.num_key_value_heads * cfg.head_dim
        return cfg.num_key_value_heads * (ALIGN // math.gcd(ALIGN, per))
    if axis == "experts":
        return 1
    return ALIGN


def candidate_sizes(cfg: NemotronHConfig, axis: str, max_choices: int) -> list[int]:
    """Aligned sizes an axis may take, ascending, ending at the full size; at most `max_choices`, spread
    evenly over the aligned ones."""
    full, unit = _full_size(cfg, axis), _unit(cfg, axis)
    # experts: at least top-k, and 2 (transformers and vLLM route through a top-2 per group)
    low = max(cfg.num_experts_per_tok, 2) if axis == "experts" else unit
    sizes = list(range(low, full, unit)) + [full]
    if len(sizes) > max_choices:
        picks = torch.linspace(0, len(sizes) - 1, max_choices).round().long().unique().tolist()
        sizes = [sizes[i] for i in picks]
    return sizes


class Router(nn.Module):
    def __init__(self, cfg: NemotronHConfig, budgets: dict[str, float], axes: tuple[str, ...] = DEFAULT_AXES,
                 hidden: int = 64, heterogeneous: bool = True, max_choices: int = 8,
                 choices: dict[str, list[int]] | None = None):
        super().__init__()
        self.cfg = cfg
        # trained budgets, largest first: the one-hot's order
        self.names = [n for n, _ in sorted(budgets.items(), key=lambda kv: -kv[1])]
        self.fractions = [budgets[n] for n in self.names]
        self.heterogeneous, self.hidden = heterogeneous, hidden
        self.axes = tuple(a for a in axes if a == "hidden" or (LAYER_AXES[a] in cfg.pattern
                                                                and (a != "experts" or cfg.n_group == 1)))
        self.choices = choices or {a: candidate_sizes(cfg, a, max_choices) for a in self.axes}
        # the layers each axis sizes; the hidden width is one size for all (no layer)
        self.layers = {a: [i for i, k in enumerate(cfg.pattern) if k == LAYER_AXES[a]] for a in self.axes
                       if a != "hidden"}
        nb = len(self.names)
        self.mlps = nn.ModuleDict({a: nn.Sequential(nn.Linear(nb, hidden), nn.LeakyReLU(),
                                                    nn.Linear(hidden, self._rows(a) * len(self.choices[a])))
                                   for a in self.axes})
        self.full = Budget.full(cfg)

    def _rows(self, axis: str) -> int:
        return len(self.layers[axis]) if self.heterogeneous and axis != "hidden" else 1

    # -- budgets in -----------------------------------------------------------------------------------
    def one_hot(self, fraction: float) -> torch.Tensor:
        """The router's input for a budget: its one-hot, or for a fraction between two trained budgets
        the linear interpolation of theirs."""
        fr = self.fractions
        x = torch.zeros(len(fr))
        for k, f in enumerate(fr):
            if math.isclose(fraction, f):
                x[k] = 1.0
                return x
        if not min(fr) < fraction < max(fr):
            raise ValueError(f"budget fraction {fraction:g} is outside the trained range "
                             f"{min(fr):g}..{max(fr):g}; the router interpolates only between trained budgets")
        hi = max(k for k, f in enumerate(fr) if f > fraction)  # the smallest larger budget
        t = (fr[hi] - fraction) / (fr[hi] - fr[hi + 1])
        x[hi], x[hi + 1] = 1 - t, t
        return x

    def logits(self, fraction: float) -> dict[str, torch.Tensor]:
        """axis -> [rows, choices] logits."""
        x = self.one_hot(fraction).to(next(self.parameters()).device)
        return {a: m(x).view(self._rows(a), len(self.choices[a])) for a, m in self.mlps.items()}

    # -- configurations out ---------------------------------------------------------------------------
    def sample(self, fraction: float, tau: float, scale: float, generator: torch.Generator | None) -> dict:
        """Gumbel-Softmax weights per axis [rows, choices] (differentiable)."""
        out = {}
        for a, lg in self.logits(fraction).items():
            u = torch.rand(lg.shape, generator=generator, dtype=lg.dtype).clamp_(1e-10, 1 - 1e-10).to(lg.device)
            out[a] = torch.softmax((scale * lg - torch.log(-torch.log(u))) / tau, dim=-1)
        return out

    def hard(self, fraction: float) -> dict:
        """One-hot weights of the argmax choice per axis and row (no noise)."""
        return {a: nn.functional.one_hot(lg.argmax(-1), lg.shape[-1]).to(lg.dtype)
                for a, lg in self.logits(fraction).items()}

    def shipped(self, fraction: float) -> dict:
        """`hard`'s one-hot weights, the configuration export takes, with the gradient of the router's plain
        softmax (straight-through): the size penalty prices what ships, and still moves the logits once the
        Gumbel samples have sharpened to one-hot (their softmax at temperature 0.05 and scale 10 passes
        almost no gradient, so a penalty on the samples froze wherever the router stood by then)."""
        out = {}
        for a, lg in self.logits(fraction).items():
            p = torch.softmax(lg, dim=-1)
            out[a] = nn.functional.one_hot(lg.argmax(-1), lg.shape[-1]).to(lg.dtype) + p - p.detach()
        return out

    def weights_of(self, b: Budget) -> dict:
        """One-hot weights [rows, choices] that select a hard configuration's sizes (training-mode masks
        of a budget from the table)."""
        out = {}
        for a in self.axes:
            if a == "hidden":
                out[a] = nn.functional.one_hot(torch.tensor([self.choices[a].index(b.hidden)]),
                                               len(self.choices[a])).float()
                continue
            rows = self.layers[a] if self.heterogeneous else self.layers[a][:1]
            idx = torch.tensor([self.choices[a].index(getattr(b.layers[i], a)) for i in rows])
            out[a] = nn.functional.one_hot(idx, len(self.choices[a])).float()
        return out

    def soft_layers(self, weights: dict) -> list[SoftLayer | None]:
        """The network's per-layer soft sizes for these weights."""
        out: list[SoftLayer | None] = [None] * self.cfg.num_layers
        for a, w in weights.items():
            if a == "hidden":
                continue
            sizes = torch.tensor(self.choices[a], device=w.device)
            for r, i in enumerate(self.layers[a]):
                out[i] = out[i] or {}
                out[i][a] = SoftSize(sizes, w[r if self.heterogeneous else 0])
        return out

    def soft_hidden(self, weights: dict) -> SoftSize | None:
        """The network's soft hidden width for these weights (None: the router does not size it)."""
        if "hidden" not in weights:
            return None
        w = weights["hidden"]
        return SoftSize(torch.tensor(self.choices["hidden"], device=w.device), w[0])

    def expected_params(self, weights: dict) -> torch.Tensor:
        """Expected parameter count of the configuration the weights mix (exact for one-hot weights): the
        count is multilinear in the sizes (hidden x channels x experts), and the axes are drawn
        independently, so it is the count at each axis's expected size."""
        mean = {a: (w * torch.tensor(self.choices[a], dtype=w.dtype, device=w.device)).sum(-1).double().cpu()
                for a, w in weights.items()}
        layers = list(self.full.layers)
        for a, m in mean.items():
            for r, i in enumerate(self.layers.get(a, [])):
                layers[i] = replace(layers[i], **{a: m[r if self.heterogeneous else 0]})
        hidden = mean["hidden"][0] if "hidden" in mean else self.cfg.hidden_size
        total = count_params(self.cfg, Budget("expected", hidden, tuple(layers)))[0]
        return torch.as_tensor(total, dtype=torch.float64)

    def budget(self, name: str, fraction: float, within: Budget | None = None, above: Budget | None = None) -> Budget:
        """The hard configuration for a budget, kept inside `within` (the next larger budget) and around
        `above` (the next smaller one) so that the table stays nested."""
        layers, hidden = list(self.full.layers), self.cfg.hidden_size
        for a, w in self.hard(fraction).items():
            if a == "hidden":
                hidden = self.choices[a][int(w[0].argmax())]
                hidden = min(hidden, within.hidden) if within is not None else hidden
                hidden = max(hidden, above.hidden) if above is not None else hidden
                continue
            for r, i in enumerate(self.layers[a]):
                size = self.choices[a][int(w[r if self.heterogeneous else 0].argmax())]
                if within is not None:
                    size = min(size, getattr(within.layers[i], a))
                if above is not None:
                    size = max(size, getattr(above.layers[i], a))
                layers[i] = replace(layers[i], **{a: size})
        return Budget(name, hidden, tuple(layers))

    def budgets(self) -> list[Budget]:
        """Hard configurations of the trained budgets, largest first, each nested in the one before."""
        out: list[Budget] = []
        for name, f in zip(self.names, self.fractions):
            out.append(self.budget(name, f, within=out[-1] if out else None))
        return out

    # -- files ----------------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()},
                  directory / "router.safetensors")
        meta = {"budgets": [{"name": n, "fraction": f} for n, f in zip(self.names, self.fractions)],
                "axes": {a: {"choices": self.choices[a], "layers": self.layers.get(a, [])} for a in self.axes},
                "hidden": self.hidden, "heterogeneous": self.heterogeneous,
                "input": "one-hot over budgets (largest first), interpolated between neighbours"}
        (directory / "router.json").write_text(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path, cfg: NemotronHConfig) -> Router:
        file = directory / "router.json"
        if not file.is_file():
            raise FileNotFoundError(f"{directory} has no router.json: it was not made by `elastic-local train`")
        meta = json.loads(file.read_text())
        router = cls(cfg, {b["name"]: b["fraction"] for b in meta["budgets"]}, tuple(meta["axes"]),
                     meta["hidden"], meta["heterogeneous"], choices={a: v["choices"] for a, v in meta["axes"].items()})
        router.load_state_dict(load_file(directory / "router.safetensors"))
        return router
