"""Write elastic_local/catalog/star-elastic/config.json: the Star Elastic family as a config-only directory.

    .venv/bin/python packaging/make_star_elastic_config.py [--check]

`elastic-local fit` plans against this file when no checkpoint directory is given, so a user can ask
"what can this machine run?" before downloading 60 GB. It holds no weights: the planner takes exact byte
counts from the config and the budget table (quant/scheme.py `weight_bytes`).

What is published and what is derived:
- The parent config is NVIDIA-Nemotron-3-Nano-30B-A3B's (SPEC section 3), copied field by field below.
- The budget sizes of the 23B and 12B submodels are not published. They are derived here with
  elastic-local's own budget search (elastic/search.py), the same search `elastic-local nest` runs:
  targets are the paper's nominal sizes as fractions of the parent (23/30 and 12/30 of the parent's counted
  total), cut on the default axes (hidden, Mamba heads, experts, expert and shared-expert channels; all 52
  layers kept, as in the release). Without weights there are no importance scores, so a prior stands in:
  *rank-linear* scores, unit k of an axis of n scores (n - k) / n (importance falls with rank, so a cut
  costs more the deeper it goes, and the greedy search spreads cuts over the axes in proportion to the
  parameters each holds). The prior was chosen against the one other published number, the active
  parameters (paper: 2.8B and 2.0B):
      prior      23B total / active     12B total / active    12B hidden, experts, expert channels
      linear     24.61B / 3.15B         12.82B / 2.24B        1856, 94, 1408     <- used
      uniform    24.06B / 2.73B         12.78B / 1.45B        1088, 128, 1856
  Uniform scores make every cut of an axis cost the same share, so the search cuts only the hidden size
  (it holds the most parameters per unit) down to 1088, and 12B's active count lands 27% below the paper;
  the linear prior is within +12% for both. Total bytes, which decide a fit, are pinned by the parameter
  targets (within 2%) whatever the prior; the split over axes moves KV-free memory very little and the
  decode-speed ceiling (active bytes) by up to the differences above.
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
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic_local.elastic.importance import Importance  # noqa: E402
from elastic_local.elastic.search import DEFAULT_AXES, search_budget  # noqa: E402
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
NOTE = ("Config-only description of NVIDIA Star Elastic (30B/23B/12B nested in one Nemotron-3-Nano-30B-A3B "
        "checkpoint) for planning with `elastic-local fit`; it holds no weights. The parent config is NVIDIA's. "
        "The 23B and 12B axis sizes are NOT published by NVIDIA: they are derived by elastic-local's own budget "
        "search (elastic/search.py) for 23/30 and 12/30 of the parent's counted parameters on the default axes, "
        "with a rank-linear importance prior (no weights to score), by packaging/make_star_elastic_config.py. "
        "Total bytes (what decides a fit) are pinned by the parameter targets within 2%; how they split over "
        "axes (and so active parameters and decode speed) may differ from the release.")


PRIORS = {
    "linear": lambda n: (n - torch.arange(n, dtype=torch.float32)) / n,  # unit k of n scores (n - k) / n
    "uniform": lambda n: torch.ones(n),
}


def prior_importance(cfg: NemotronHConfig, prior: str = "linear") -> Importance:
    """Scores for a model without weights, already in nested (descending) order on every axis."""
    f = PRIORS[prior]
    imp = Importance(hidden=f(cfg.hidden_size), source=f"{prior} prior (config only, no weights to score)")
    for i, kind in enumerate(cfg.pattern):
        if kind == "M":
            imp.layers[i] = {"mamba_heads": f(cfg.mamba_num_heads)}
        elif kind == "*":
            imp.layers[i] = {"attention_heads": f(cfg.num_attention_heads)}
        elif kind == "E":
            imp.layers[i] = {"experts": f(cfg.n_routed_experts),
                             "expert_channels": f(cfg.moe_intermediate_size).expand(cfg.n_routed_experts, -1),
                             "shared_channels": f(cfg.moe_shared_expert_intermediate_size)}
        else:
            imp.layers[i] = {"mlp_channels": f(cfg.intermediate_size)}
    return imp


def build(prior: str = "linear") -> tuple[dict, list[Budget], NemotronHConfig]:
    cfg = NemotronHConfig.from_dict(PARENT, source="Nemotron-3-Nano-30B-A3B parent config")
    imp = prior_importance(cfg, prior)
    parent = count_params(cfg, Budget.full(cfg))[0]
    chosen = [Budget.full(cfg, "30B")]
    for name in ("23B", "12B"):
        target = round(parent * NOMINAL[name] / NOMINAL["30B"])
        chosen.append(search_budget(cfg, imp, chosen[-1], name, target, DEFAULT_AXES, heterogeneous=False))
    config = dict(PARENT)
    config["elastic"] = {
        "format_version": FORMAT_VERSION,
        "axes": list(DEFAULT_AXES),
        "heterogeneous": False,
        "calibration": {"source": imp.source, "tokens": 0},
        "note": NOTE,
        "budgets": [budget_entry(cfg, b) for b in chosen],
    }
    return config, chosen, cfg


def release(cfg: NemotronHConfig) -> dict:
    keep = nano_keep(cfg)
    return {
        "name": "NVIDIA Star Elastic (Nemotron-3-Nano-30B-A3B parent; 30B, 23B, 12B nested)",
        "note": "Precisions NVIDIA publishes the family in. exclude_modules (kept in BF16) is assumed, not "
                "published: the Nemotron-3-Nano NVFP4 recipe (attention layers and the Mamba layers feeding "
                "them), the larger and so the safer estimate. Written by packaging/make_star_elastic_config.py.",
        "precisions": {"bf16": {"exclude_modules": []}, "fp8": {"exclude_modules": keep},
                       "nvfp4": {"exclude_modules": keep}},
    }


def render(config: dict) -> str:
    return json.dumps(config, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed file differs")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--prior", choices=list(PRIORS), default="linear",
                    help="importance prior (the shipped file uses linear; uniform for comparison)")
    args = ap.parse_args(argv)
    config, chosen, cfg = build(args.prior)
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
