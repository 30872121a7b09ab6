"""Nemotron-H configuration, read from a Hugging Face `config.json`.

Only the fields the network needs, with the defaults transformers uses, so that a config written by
NVIDIA's release, by transformers' `save_pretrained` or by this project all read the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

BLOCK_KINDS = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
_LAYER_TYPE_TO_LETTER = {"linear_attention": "M", "mamba": "M", "moe": "E", "full_attention": "*",
                         "attention": "*", "mlp": "-"}


class ConfigError(ValueError):
    """A config.json that this runner cannot use; the message names the file and the field."""


def _float(value: Any) -> float:
    # transformers writes infinity as {"__float__": "Infinity"}; plain JSON writers use a string or null.
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    if value is None:
        return math.inf
    return float(value)


def _fits_type(value: Any, default: Any) -> bool:
    """Whether a config.json value has the kind of its field's default (bool, whole number, number)."""
    if isinstance(default, bool):
        return isinstance(value, bool) or value in (0, 1)
    if isinstance(default, int):
        whole = isinstance(value, int) or isinstance(value, float) and value.is_integer()
        return not isinstance(value, bool) and (whole or isinstance(value, list))  # eos_token_id may be a list
    if isinstance(default, float):
        return not isinstance(value, bool) and isinstance(value, (int, float))
    return True


@dataclass(frozen=True)
class NemotronHConfig:
    vocab_size: int
    hidden_size: int
    pattern: str  # one letter per layer: M Mamba2, E MoE, * attention, - dense MLP
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 21504
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    n_groups: int = 8
    ssm_state_size: int = 128
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    eos_token_id: int | list[int] | None = 2
    bos_token_id: int | None = 1
    pad_token_id: int | None = 0
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> NemotronHConfig:
        def fail(msg: str) -> ConfigError:
            return ConfigError(f"{source}: {msg}")

        if d.get("model_type") not in (None, "nemotron_h"):
            raise fail(f"model_type is {d.get('model_type')!r}, expected 'nemotron_h'")
        if "hybrid_override_pattern" in d:
            pattern = d["hybrid_override_pattern"]
        elif "layers_block_type" in d:
            try:
                pattern = "".join(_LAYER_TYPE_TO_LETTER[t] for t in d["layers_block_type"])
            except KeyError as e:
                raise fail(f"layers_block_type has an unknown block type {e.args[0]!r}; "
                           f"known: {sorted(_LAYER_TYPE_TO_LETTER)}") from None
        else:
            raise fail("neither hybrid_override_pattern nor layers_block_type is set")
        bad = sorted({c for c in pattern if c not in BLOCK_KINDS})
        if bad:
            raise fail(f"hybrid_override_pattern has unknown block letter(s) {bad}; known: M E * -")
        for flag in ("use_bias", "mlp_bias", "attention_bias", "mamba_proj_bias"):
            if d.get(flag):
                raise fail(f"{flag}=true is not supported (Nemotron-H releases have no biases there)")
        if d.get("moe_latent_size") is not None:
            raise fail("moe_latent_size is not supported yet (no released Nemotron-H uses it)")
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if d.get(key, want) != want:
                raise fail(f"{key}={d[key]!r} is not supported, expected {want!r}")

        def get(name: str, *aliases: str) -> Any:
            for key in (name, *aliases):
                if key in d:
                    return d[key]
            return cls.__dataclass_fields__[name].default

        for name, f in cls.__dataclass_fields__.items():  # a number where the dataclass expects one
            if d.get(name) is not None and not _fits_type(d[name], f.default):
                raise fail(f"{name} is {d[name]!r}; expected {type(f.default).__name__} like {f.default!r}")
        for name in ("vocab_size", "hidden_size"):
            if name in d and (isinstance(d[name], bool) or not isinstance(d[name], int) or d[name] <= 0):
                raise fail(f"{name} is {d[name]!r}; expected a positive integer")
        limit = get("time_step_limit", "mamba_dt_limit")
        kwargs = {
            name: get(name) for name in cls.__dataclass_fields__
            if name not in ("vocab_size", "hidden_size", "pattern", "raw", "time_step_limit", "n_groups",
                            "conv_kernel", "chunk_size", "use_conv_bias")
        }
        try:
            cfg = cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                pattern=pattern,
                n_groups=int(get("n_groups", "mamba_n_groups")),
                conv_kernel=int(get("conv_kernel", "mamba_d_conv")),
                chunk_size=int(get("chunk_size", "mamba_chunk_size")),
                use_conv_bias=bool(get("use_conv_bias", "mamba_conv_bias")),
                time_step_limit=(_float(limit[0]), _float(limit[1])),
                raw=dict(d),
                **kwargs,
            )
        except KeyError as e:
            raise fail(f"missing required field {e.args[0]!r}") from None
        cfg.validate(fail)
        return cfg

    def validate(self, fail) -> None:
        if "M" in self.pattern and self.mamba_num_heads % self.n_groups:
            raise fail(f"mamba_num_heads={self.mamba_num_heads} is not a multiple of n_groups={self.n_groups}")
        if "*" in self.pattern and self.num_attention_heads % self.num_key_value_heads:
            raise fail(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                       f"num_key_value_heads={self.num_key_value_heads}")
        if "E" in self.pattern:
            if self.n_routed_experts % self.n_group:
                raise fail(f"n_routed_experts={self.n_routed_experts} is not a multiple of n_group={self.n_group}")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise fail("num_experts_per_tok is larger than n_routed_experts")

    @classmethod
    def from_dir(cls, path: str | Path) -> NemotronHConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConfigError(f"{file}: not found; a checkpoint directory needs config.json")
        try:
            d = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from None
        cfg = cls.from_dict(d, source=str(file))
        if cfg.tie_word_embeddings and _stores_lm_head(Path(path)):
            # transformers' NemotronH writes and runs its own lm_head even for a tied config: so do we
            cfg = replace(cfg, tie_word_embeddings=False)
        return cfg


def _stores_lm_head(path: Path) -> bool:
    """Whether the directory's weights hold an `lm_head.weight` (read from the index or the headers)."""
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            return "lm_head.weight" in json.loads(index.read_text()).get("weight_map", {})
        from safetensors import safe_open

        return any("lm_head.weight" in safe_open(f, "pt").keys() for f in sorted(path.glob("model*.safetensors")))
    except Exception:  # an unreadable file is the loader's to report, naming it
        return False
