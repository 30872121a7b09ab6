"""Budgets: the active size of every axis of every layer.

A budget is what makes one set of weights many models. Every size is a prefix: the first `hidden`
embedding channels, the first `mamba_heads / n_groups` heads of every Mamba group, the first
`attention_heads / kv_heads` query heads of every KV group, the first `experts` experts, the first
`*_channels` FFN channels. The network slices its resident weights with these numbers at run time,
so a budget is a view, never a copy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .config import NemotronHConfig


@dataclass(frozen=True)
class LayerSizes:
    kind: str  # block letter: M E * -
    enabled: bool = True
    mamba_heads: int = 0  # total heads, a multiple of n_groups (M)
    attention_heads: int = 0  # query heads, a multiple of num_key_value_heads (*)
    experts: int = 0  # routed experts kept (E)
    expert_channels: int = 0  # routed expert intermediate size (E)
    shared_channels: int = 0  # shared expert intermediate size (E)
    mlp_channels: int = 0  # dense MLP intermediate size (-)

    def fits_in(self, other: LayerSizes) -> bool:
        return self.kind == other.kind and all(
            getattr(self, f) <= getattr(other, f) for f in AXES if f != "enabled"
        ) and (other.enabled or not self.enabled)


AXES = ("enabled", "mamba_heads", "attention_heads", "experts", "expert_channels", "shared_channels",
        "mlp_channels")


@dataclass(frozen=True)
class Budget:
    name: str
    hidden: int
    layers: tuple[LayerSizes, ...]

    @classmethod
    def full(cls, cfg: NemotronHConfig, name: str = "full") -> Budget:
        return cls(name, cfg.hidden_size, tuple(full_layer(cfg, k) for k in cfg.pattern))

    def __hash__(self) -> int:  # budgets key per-budget state looked up on every decode step: hash once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.name, self.hidden, self.layers))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:  # str hashes are salted per process: a pickled budget carries no hash
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def fits_in(self, other: Budget) -> bool:
        """True when every axis of this budget is a prefix of `other`'s (so it can run on its weights)."""
        return (self.hidden <= other.hidden and len(self.layers) == len(other.layers)
                and all(a.fits_in(b) for a, b in zip(self.layers, other.layers)))

    def renamed(self, name: str) -> Budget:
        return replace(self, name=name)

    def to_dict(self) -> dict:
        return {"name": self.name, "hidden": self.hidden, "layers": [asdict(s) for s in self.layers]}


def full_layer(cfg: NemotronHConfig, kind: str) -> LayerSizes:
    if kind == "M":
        return LayerSizes(kind, mamba_heads=cfg.mamba_num_heads)
    if kind == "*":
        return LayerSizes(kind, attention_heads=cfg.num_attention_heads)
    if kind == "E":
        return LayerSizes(kind, experts=cfg.n_routed_experts, expert_channels=cfg.moe_intermediate_size,
                          shared_channels=cfg.moe_shared_expert_intermediate_size)
    return LayerSizes(kind, mlp_channels=cfg.intermediate_size)


def check_budget(cfg: NemotronHConfig, b: Budget, where: str = "budget") -> None:
    """Raise a ValueError naming the budget, layer and axis when a size cannot run on this config."""
    full = Budget.full(cfg)
    if not 0 < b.hidden <= cfg.hidden_size:
        raise ValueError(f"{where} {b.name!r}: hidden={b.hidden} must be in 1..{cfg.hidden_size}")
    if len(b.layers) != cfg.num_layers:
        raise ValueError(f"{where} {b.name!r}: {len(b.layers)} layers, the model has {cfg.num_layers}")
    for i, (s, f) in enumerate(zip(b.layers, full.layers)):
        if s.kind != f.kind:
            raise ValueError(f"{where} {b.name!r}: layer {i} is {s.kind!r}, the model has {f.kind!r}")
        if not s.fits_in(f):
            raise ValueError(f"{where} {b.name!r}: layer {i} sizes {s} exceed the model's {f}")
        if s.kind == "M" and (s.mamba_heads % cfg.n_groups or s.mamba_heads == 0) and s.enabled:
            raise ValueError(f"{where} {b.name!r}: layer {i} mamba_heads={s.mamba_heads} must be a positive "
                             f"multiple of n_groups={cfg.n_groups}")
        if s.kind == "*" and s.enabled and (s.attention_heads % cfg.num_key_value_heads or not s.attention_heads):
            raise ValueError(f"{where} {b.name!r}: layer {i} attention_heads={s.attention_heads} must be a "
                             f"positive multiple of num_key_value_heads={cfg.num_key_value_heads}")
        if s.kind == "E" and s.enabled and s.experts < cfg.num_experts_per_tok:
            raise ValueError(f"{where} {b.name!r}: layer {i} keeps {s.experts} experts, fewer than "
                             f"num_experts_per_tok={cfg.num_experts_per_tok}")


def count_params(cfg: NemotronHConfig, b: Budget) -> tuple[int, int]:
    """(total, active per token) parameters of a budget. Active counts only the routed experts a token
    uses (top-k) and includes embeddings, norms and lm_head."""
    d = b.hidden
    total = 2 * cfg.vocab_size * d + d  # embeddings, lm_head, norm_f
    if cfg.tie_word_embeddings:
        total -= cfg.vocab_size * d
    inactive = 0
    for s in b.layers:
        if not s.enabled:
            continue
        total += d  # block norm
        if s.kind == "M":
            n, p = s.mamba_heads, cfg.mamba_head_dim
            bc = 2 * cfg.n_groups * cfg.ssm_state_size
            conv = (n * p + bc) * (cfg.conv_kernel + int(cfg.use_conv_bias))
            total += d * (2 * n * p + bc + n) + conv + 3 * n + n * p + n * p * d
        elif s.kind == "*":
            kv = cfg.num_key_value_heads * cfg.head_dim
            total += d * (s.attention_heads * cfg.head_dim) * 2 + 2 * d * kv
        elif s.kind == "E":
            per_expert = 2 * d * s.expert_channels
            total += s.experts * (per_expert + d + 1) + 2 * d * s.shared_channels
            inactive += (s.experts - cfg.num_experts_per_tok) * per_expert
        else:
            total += 2 * d * s.mlp_channels
    return total, total - inactive
