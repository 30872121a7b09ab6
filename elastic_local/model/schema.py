"""The network's tensor schema: which tensors a Nemotron-H checkpoint of given sizes holds, their shapes,
and which of them stay in float32. The loader checks files against it, the quantized formats and the
cost model count bytes with it, the writers and nest / slice produce it.

Names are canonical hub names without the `backbone.` prefix (`layers.3.mixer.in_proj.weight`);
safetensors spells dtypes as in `DTYPE_BYTES`.
"""

from __future__ import annotations

import re
from dataclasses import replace

from .budget import Budget
from .config import BLOCK_KINDS, ConfigError, NemotronHConfig

DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1,
               "I32": 4, "I64": 8, "BOOL": 1, "U16": 2, "I16": 2, "U32": 4}
# kept and computed in float32 at every precision (SPEC §3, §5): the router and the SSM's scalars
_FP32 = re.compile(r"(gate\.weight|e_score_correction_bias|A_log|\.D|dt_bias)$")


def keeps_fp32(name: str) -> bool:
    """Whether canonical tensor `name` is stored and used in float32 (router, A_log, D, dt_bias)."""
    return bool(_FP32.search(name))


def stored_budget(cfg: NemotronHConfig) -> Budget:
    """The sizes the file stores: the config's own, or per layer from `block_configs` (a heterogeneous
    slice, after the convention of NVIDIA's Puzzle checkpoints)."""
    blocks = cfg.raw.get("block_configs")
    if not blocks:
        return Budget.full(cfg)
    if len(blocks) != cfg.num_layers:
        raise ConfigError(f"config.json: block_configs has {len(blocks)} entries for {cfg.num_layers} layers")
    layers = []
    for i, (kind, bc) in enumerate(zip(cfg.pattern, blocks)):
        if bc.get("block_type") != BLOCK_KINDS[kind]:
            raise ConfigError(f"config.json: block_configs[{i}] is {bc.get('block_type')!r}, the pattern says "
                              f"{BLOCK_KINDS[kind]!r}")
        full = Budget.full(cfg).layers[i]
        layers.append(replace(full, mamba_heads=bc.get("mamba_num_heads", full.mamba_heads),
                              attention_heads=bc.get("num_attention_heads", full.attention_heads),
                              experts=bc.get("n_routed_experts", full.experts),
                              expert_channels=bc.get("moe_intermediate_size", full.expert_channels),
                              shared_channels=bc.get("moe_shared_expert_intermediate_size", full.shared_channels),
                              mlp_channels=bc.get("intermediate_size", full.mlp_channels)))
    return Budget("stored", cfg.hidden_size, tuple(layers))


def expected_shapes(cfg: NemotronHConfig, stored: Budget) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor a checkpoint with these stored sizes must hold."""
    D, V = stored.hidden, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"embeddings.weight": (V, D), "norm_f.weight": (D,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, D)
    G, N, p, K = cfg.n_groups, cfg.ssm_state_size, cfg.mamba_head_dim, cfg.conv_kernel
    hd, KV = cfg.head_dim, cfg.num_key_value_heads
    for i, s in enumerate(stored.layers):
        pre = f"layers.{i}."
        if not s.enabled:
            continue
        out[pre + "norm.weight"] = (D,)
        m = pre + "mixer."
        if s.kind == "M":
            n = s.mamba_heads
            conv = n * p + 2 * G * N
            out.update({m + "in_proj.weight": (2 * n * p + 2 * G * N + n, D), m + "conv1d.weight": (conv, 1, K),
                        m + "dt_bias": (n,), m + "A_log": (n,), m + "D": (n,), m + "norm.weight": (n * p,),
                        m + "out_proj.weight": (D, n * p)})
            if cfg.use_conv_bias:
                out[m + "conv1d.bias"] = (conv,)
        elif s.kind == "*":
            q = s.attention_heads * hd
            out.update({m + "q_proj.weight": (q, D), m + "k_proj.weight": (KV * hd, D),
                        m + "v_proj.weight": (KV * hd, D), m + "o_proj.weight": (D, q)})
        elif s.kind == "E":
            E, I, S = s.experts, s.expert_channels, s.shared_channels
            out.update({m + "gate.weight": (E, D), m + "gate.e_score_correction_bias": (E,),
                        m + "shared_experts.up_proj.weight": (S, D), m + "shared_experts.down_proj.weight": (D, S)})
            for j in range(E):
                out[m + f"experts.{j}.up_proj.weight"] = (I, D)
                out[m + f"experts.{j}.down_proj.weight"] = (D, I)
        else:
            out.update({m + "up_proj.weight": (s.mlp_channels, D), m + "down_proj.weight": (D, s.mlp_channels)})
    return out
