"""Write elastic_local/catalog/star-elastic/config.json: the Star Elastic family as a config-only directory.

    .venv/bin/python packaging/make_star_elastic_config.py [--check]

`elastic-local fit` plans against this file when no checkpoint directory is given, so a user can ask
"what can this machine run?" before downloading 60 GB. It holds no weights: the planner takes exact byte
counts from the config and the budget table (quant/scheme.py `weight_bytes`).

What is published and what is derived:
- The parent config is NVIDIA-Nemotron-3-Nano-30B-A3B's (SPEC section 3), copied field by field below.
- Published for the 23B and 12B submodels (SPEC section 2): their total sizes (nominal 23/30 and 12/30 of
  the parent; the table's targets are those fractions of the parent's counted total), their active
  parameters (2.8B and 2.0B), all 52 layers kept, and the axes the public recipe nests: embedding channels,
  Mamba heads, experts, and expert / shared-expert channels. Not published: the size of each axis.
  Derived here: the sizes are found by a search (no weights, so no importance scores) that meets both
  published counts within 2% while cutting the axes as evenly as it can: for each hidden size (a multiple
  of 128), one width fraction for Mamba heads and expert / shared channels is bisected to the published
  active count, then the expert count is solved for the total; among the hidden sizes that meet both,
  the one with the smallest sum of squared log keep-fractions over the five axes wins. Mamba heads move
  in steps of 8 (one head per group), so 23B's small width cut keeps all 64 and 12B keeps 56.
  An earlier version of this file searched with elastic-local's greedy budget search and a rank-linear
  importance prior: it never cut the Mamba heads and came to 3.15B / 2.24B active against the paper's
  2.8B / 2.0B.
- Consistency check against the paper: three separate BF16 files are said to take 126.1 GB (GiB, as the
  58.9 figure for one file shows: 31.6e9 parameters x 2 bytes = 58.9 GiB); the derived sizes give the
  figure printed by this script (within 2%).

It also writes release.json beside config.json: the precisions NVIDIA publishes the family in (BF16, FP8,
NVFP4; SPEC section 1), so `fit` marks them "stored" (a download) rather than "load-time quantization".
Which modules the FP8 and NVFP4 files keep in BF16 is not published for Star Elastic; the description
assumes the recipe of NVIDIA's Nemotron-3-Nano NVFP4 release (attention layers and the Mamba layers feeding
them stay BF16, quant/scheme.py `nano_keep`), the larger and so the safer estimate. With it the 30B weighs
the figures printed below against the paper's 31.4 (FP8) and 18.7 (NVFP4), read as GiB like the 58.9.

The script is deterministic (no randomness, no weights): rerunning it rewrites the same bytes; `--check`
exits 1 if the committed file differs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic_local.elastic.table import FORMAT_VERSION, budget_entry, read_budgets  # noqa: E402
from elastic_local.model.budget import Budget, count_params  # noqa: E402
from elastic_local.model.config import NemotronHConfig  # noqa: E402
from elastic_local.quant.scheme import nano_keep, weight_bytes  # noqa: E402

OUT = ROOT / "elastic_local" / "catalog" / "star-elastic" / "config.json"  # release.json goes beside it

# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json (the Star Elastic parent), every field.
PARENT = {
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "chunk_size": 128,
    "conv_kernel": 4,
    "eos_token_id": 2,
    "expand": 2,
    "head_dim": 128,
    "hidden_dropout": 0.0,
    "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "initializer_range": 0.02,
    "intermediate_size": 1856,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 64,
    "mamba_proj_bias": False,
    "mamba_ssm_cache_dtype": "float32",
    "max_position_embeddings": 262144,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "n_group": 1,
    "n_groups": 8,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_eps": 1e-05,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 52,
    "num_key_value_heads": 2,
    "num_logits_to_keep": 1,
    "pad_token_id": 0,
    "partial_rotary_factor": 1.0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "sliding_window": None,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "time_step_floor": 0.0001,
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "topk_group": 1,
    "torch_dtype": "bfloat16",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
    "vocab_size": 131072,
}

NOMINAL = {"30B": 30, "23B": 23, "12B": 12}  # the paper's names; the parent is "30B"
PUBLISHED_ACTIVE = {"30B": 3.6e9, "23B": 2.8e9, "12B": 2.0e9}  # the paper's active counts, for comparison
AXES = ("hidden", "mamba_heads", "experts", "expert_channels", "shared_channels")  # what the public recipe nests
PUBLISHED = {
    "published": "parent config; budget names 30B/23B/12B (totals 23/30 and 12/30 of the parent); active "
                 "parameters 3.6B/2.8B/2.0B; all 52 layers kept; nested axes: embedding channels, Mamba heads, "
                 "experts, expert and shared-expert channels",
    "derived": "every axis size of 23B and 12B (and so their exact params / active_params below): a search "
               "meeting the published totals and active counts within 2% with the most even cuts",
}
NOTE = ("Config-only description of NVIDIA Star Elastic (30B/23B/12B nested in one Nemotron-3-Nano-30B-A3B "
        "checkpoint) for planning with `elastic-local fit`; it holds no weights. The parent config is NVIDIA's. "
        "The 23B and 12B axis sizes are NOT published by NVIDIA: they are derived by a search for the published "
        "total and active parameter counts (within 2%) on the axes the public recipe nests, cutting them as "
        "evenly as possible, by packaging/make_star_elastic_config.py. See \"published\" for what is which.")


def _aligned(full: int, fraction: float, step: int, cap: int) -> int:
    return min(cap, max(step, round(full * fraction / step) * step))


def _sized(cfg: NemotronHConfig, within: Budget, name: str, hidden: int, width: float, experts: int) -> Budget:
    """`within` cut to `hidden` channels, `width` of its Mamba heads and expert / shared channels, `experts`."""
    full = Budget.full(cfg)
    layers = []
    for s, w, f in zip(within.layers, within.layers, full.layers):
        if s.kind == "M":
            s = replace(s, mamba_heads=_aligned(f.mamba_heads, width, cfg.n_groups, w.mamba_heads))
        elif s.kind == "E":
            s = replace(s, experts=min(w.experts, experts),
                        expert_channels=_aligned(f.expert_channels, width, 64, w.expert_channels),
                        shared_channels=_aligned(f.shared_channels, width, 64, w.shared_channels))
        layers.append(s)
    return Budget(name, hidden, tuple(layers))


def _for_hidden(cfg: NemotronHConfig, within: Budget, name: str, hidden: int, total: float, active: float) -> Budget:
    """Width bisected to the active target (all experts kept: experts barely change active), then the
    expert count that brings the total nearest its target."""
    experts = next(s.experts for s in within.layers if s.kind == "E")
    lo, hi = 0.0, 1.0
    for _ in range(24):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if count_params(cfg, _sized(cfg, within, name, hidden, mid, experts))[1] > active \
            else (mid, hi)
    width = min((lo, hi), key=lambda w: abs(count_params(cfg, _sized(cfg, within, name, hidden, w, experts))[1]
                                            - active))
    k = cfg.num_experts_per_tok
    options = [_sized(cfg, within, name, hidden, width, e) for e in range(k, experts + 1)]
    return min(options, key=lambda b: abs(count_params(cfg, b)[0] - total))


def published_budget(cfg: NemotronHConfig, within: Budget, name: str, total: float, active: float) -> Budget:
    """The most evenly cut budget inside `within` whose total and active counts are within 2% of the
    published ones (see the module docstring)."""
    best, best_score = None, math.inf
    for hidden in range(within.hidden, cfg.hidden_size // 2 - 1, -128):
        b = _for_hidden(cfg, within, name, hidden, total, active)
        t, a = count_params(cfg, b)
        if abs(t / total - 1) > 0.02 or abs(a / active - 1) > 0.02:
            continue
        full, kept = Budget.full(cfg), []
        for s, f in zip(b.layers, full.layers):
            if s.kind == "M":
                kept.append(s.mamba_heads / f.mamba_heads)
            elif s.kind == "E":
                kept += [s.experts / f.experts, s.expert_channels / f.expert_channels,
                         s.shared_channels / f.shared_channels]
        score = math.log(hidden / cfg.hidden_size) ** 2 + sum(math.log(x) ** 2 for x in set(kept))
        if score < best_score:
            best, best_score = b, score
    if best is None:
        raise ValueError(f"no budget inside {within.name} meets {name}'s published counts within 2%")
    return best


def build() -> tuple[dict, list[Budget], NemotronHConfig]:
    cfg = NemotronHConfig.from_dict(PARENT, source="Nemotron-3-Nano-30B-A3B parent config")
    parent = count_params(cfg, Budget.full(cfg))[0]
    chosen = [Budget.full(cfg, "30B")]
    for name in ("23B", "12B"):
        total = parent * NOMINAL[name] / NOMINAL["30B"]
        chosen.append(published_budget(cfg, chosen[-1], name, total, PUBLISHED_ACTIVE[name]))
    config = dict(PARENT)
    config["elastic"] = {
        "format_version": FORMAT_VERSION,
        "axes": list(AXES),
        "heterogeneous": False,
        "calibration": {"source": "none (config only, no weights to score)", "tokens": 0},
        "note": NOTE,
        "published": PUBLISHED,
        "budgets": [budget_entry(cfg, b) for b in chosen],
    }
    return config, chosen, cfg


REPO = "nvidia/NVIDIA-Nemotron-Labs-3-Elastic-30B-A3B"  # + -BF16 / -FP8 / -NVFP4 on Hugging Face


def release(cfg: NemotronHConfig) -> dict:
    keep = nano_keep(cfg)
    return {
        "name": "NVIDIA Star Elastic (Nemotron-3-Nano-30B-A3B parent; 30B, 23B, 12B nested)",
        "note": "Precisions NVIDIA publishes the family in. exclude_modules (kept in BF16) is assumed, not "
                "published: the Nemotron-3-Nano NVFP4 recipe (attention layers and the Mamba layers feeding "
                "them), the larger and so the safer estimate. Written by packaging/make_star_elastic_config.py.",
        "precisions": {p: {"repo": f"{REPO}-{p.upper()}", "exclude_modules": [] if p == "bf16" else keep}
                       for p in ("bf16", "fp8", "nvfp4")},
    }


def render(config: dict) -> str:
    return json.dumps(config, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed file differs")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    config, chosen, cfg = build()
    text = render(config)
    checked = NemotronHConfig.from_dict(json.loads(text))
    assert list(read_budgets(checked)) == ["30B", "23B", "12B"]  # 16-aligned, nested, largest first
    parent = count_params(cfg, chosen[0])[0]
    for b in chosen:
        total, active = count_params(cfg, b)
        e = budget_entry(cfg, b)["sizes"]
        print(f"{b.name:>4}: {total / 1e9:6.2f}B total ({total / parent:.3f} of the parent), "
              f"{active / 1e9:5.2f}B active (paper: {PUBLISHED_ACTIVE[b.name] / 1e9:.1f}B); sizes {e}")
    three = sum(count_params(cfg, b)[0] for b in chosen) * 2 / 2**30
    print(f"three separate BF16 files: {three:.1f} GiB (paper: 126.1); one nested file: "
          f"{parent * 2 / 2**30:.1f} GiB (paper: 58.9)")
    rel = release(cfg)
    for p, paper in (("fp8", 31.4), ("nvfp4", 18.7)):
        n = weight_bytes(cfg, chosen[0], p, rel["precisions"][p]["exclude_modules"])
        print(f"30B {p}: {n / 2**30:.2f} GiB = {n / 1e9:.2f} GB (paper: {paper})")
    files = {args.out: text, args.out.parent / "release.json": render(rel)}
    if args.check:
        stale = [f for f, t in files.items() if not f.is_file() or f.read_text() != t]
        print("up to date" if not stale else f"DIFFER from what this script writes: {[str(f) for f in stale]}")
        return 1 if stale else 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for f, t in files.items():
        f.write_text(t)
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
