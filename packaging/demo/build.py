"""Rebuild the embedded demo model from scratch: corpus -> tokenizer -> parent -> nested budgets ->
budgets retrained by elastic distillation (when the recipe has an [elastic] section).

    .venv/bin/python packaging/demo/build.py [--recipe packaging/demo/recipe.toml] [--out packaging/demo/build]
    .venv/bin/python packaging/demo/build.py --ship     # and copy the final model into elastic_local/catalog/demo
    .venv/bin/python packaging/demo/build.py --independent small   # baseline: the small shape trained from scratch
    .venv/bin/python packaging/demo/build.py --naive               # baseline: budgets as first-k slices

Every stage writes its output atomically and is skipped when that output exists, so running the command
again resumes (training itself resumes from its last saved step); OUT keeps the recipe it was built from
(recipe.json) and refuses to resume under another. Everything follows from the recipe's seed: the corpus,
the tokenizer, the initial weights and the data order.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
CATALOG = HERE.parent.parent / "elastic_local" / "catalog" / "demo"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# recipe keys that do not change what a stage computes, so OUT may be resumed with them changed: the
# trainer's own (pretrain.RESUMABLE_CHANGES) and the elastic stage's checkpoint interval
ELASTIC_RESUMABLE = {"elastic.checkpoint_every"}


def flat(recipe: dict, prefix: str = "") -> dict:
    """{"section.key": value} of a nested recipe."""
    return {k: v for key, value in recipe.items()
            for k, v in (flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value}).items()}


def check_recipe(recipe: dict, out: Path) -> None:
    """Tie OUT to the recipe that built it (OUT/recipe.json). Every stage skips an output that exists, so
    a changed recipe would otherwise mix silently with the old one's parent, nest or budgets."""
    stamp = out / "recipe.json"
    if not stamp.is_file():
        out.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps(recipe, indent=1) + "\n")
        return
    from elastic_local.train.pretrain import RESUMABLE_CHANGES

    free = ELASTIC_RESUMABLE | {f"train.{k}" for k in RESUMABLE_CHANGES}
    old, new = flat(json.loads(stamp.read_text())), flat(recipe)
    changed = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys())
               if k not in free and old.get(k) != new.get(k)]
    if changed:
        raise SystemExit(f"{out} was built from another recipe ({'; '.join(changed)}); give another --out, "
                         f"or remove {out} to rebuild")


def model_config(recipe: dict, tokenizer_dir: Path) -> dict:
    """The parent's Nemotron-H config.json: the recipe's sizes plus the tokenizer's special ids."""
    gen = json.loads((tokenizer_dir / "generation_config.json").read_text())
    m = recipe["model"]
    return {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
            "vocab_size": recipe["corpus"]["vocab_size"], **m,
            "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "use_conv_bias": True, "use_bias": False,
            "mamba_proj_bias": False, "attention_bias": False, "mlp_bias": False, "norm_topk_prob": True,
            "n_group": 1, "topk_group": 1, "layer_norm_epsilon": 1e-5, "time_step_limit": [0.0, float("inf")],
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "num_hidden_layers": len(m["hybrid_override_pattern"]),
            "bos_token_id": gen["bos_token_id"], "eos_token_id": gen["eos_token_id"],
            "pad_token_id": gen["pad_token_id"]}


def train_from_scratch(recipe: dict, config: dict, init_dir: Path, work: Path, target: Path, tok_dir: Path) -> None:
    """Train the random checkpoint in `init_dir` on the recipe's corpus with the recipe's schedule and
    write it to `target` in BF16; `work` keeps the resumable state."""
    import torch
    from tokenizers import Tokenizer

    from elastic_local.tasks.corpus import chat_text
    from elastic_local.train import pretrain

    seed, corpus = recipe["seed"], recipe["corpus"]
    log(f"corpus: {corpus['train_items']} training conversations (seed {seed})")
    pairs = [chat_text(c.item, c.earlier) for c in train_conversations(recipe, corpus["train_items"], seed)]
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    examples = pretrain.encode_examples(pairs, tok)
    tc = pretrain.TrainConfig(seed=seed, **{k: (tuple(v) if isinstance(v, list) else v)
                                            for k, v in recipe["train"].items()})
    net, params = pretrain.train(init_dir, examples, work, tc, pad_id=tok.token_to_id("<pad>"), log=log)
    pretrain.write_checkpoint(target, config, pretrain.hub_tensors(net, params), tok_dir, dtype=torch.bfloat16)
    log(f"written to {target}")


def independent(recipe: dict, out: Path, budget: str) -> Path:
    """A plain model with exactly the shape of the nested model's `budget`, trained from scratch with
    the parent's recipe (corpus, steps, seed, optimizer): the baseline nested budgets are measured against."""
    from elastic_local.model.budget import Budget, count_params
    from elastic_local.model.config import NemotronHConfig
    from elastic_local.train import pretrain

    nested = json.loads((out / "nested" / "config.json").read_text())
    found = {b["name"]: b for b in nested["elastic"]["budgets"]}
    if budget not in found:
        raise SystemExit(f"budget {budget!r} is not in {out / 'nested' / 'config.json'} (it has {', '.join(found)});"
                         " build the nested model first")
    sizes, tok_dir = found[budget]["sizes"], out / "tokenizer"
    config = model_config(recipe, tok_dir) | {
        "hidden_size": sizes["hidden"], "mamba_num_heads": sizes["mamba_heads"],
        "num_attention_heads": sizes["attention_heads"], "n_routed_experts": sizes["experts"],
        "moe_intermediate_size": sizes["expert_channels"],
        "moe_shared_expert_intermediate_size": sizes["shared_channels"], "intermediate_size": sizes["mlp_channels"]}
    cfg = NemotronHConfig.from_dict(config)
    params = count_params(cfg, Budget.full(cfg))[0]
    if params != found[budget]["params"]:
        raise SystemExit(f"independent {budget!r} would have {params} parameters, the nested budget has "
                         f"{found[budget]['params']}: its sizes do not describe a plain model")
    work, target = out / f"independent-{budget}", out / f"independent-{budget}" / "model"
    init_dir = work / "init"
    if not (init_dir / "config.json").is_file():
        log(f"init: random {budget}-shaped model, {params} parameters")
        pretrain.write_checkpoint(init_dir, config, pretrain.init_tensors(cfg, recipe["seed"]), tok_dir)
    if not (target / "config.json").is_file():
        train_from_scratch(recipe, config, init_dir, work / "train", target, tok_dir)
    return target


def naive(recipe: dict, out: Path) -> Path:
    """The [nest] budgets as first-k slices of the parent: `nest` with every axis scored in its stored order
    (scores that fall with the index), so nothing is permuted. The baseline importance ordering is
    measured against (`elastic-local eval OUT/naive`)."""
    import torch
    from safetensors.torch import load_file

    from elastic_local.elastic.importance import Importance
    from elastic_local.elastic.nest import nest

    target = out / "naive"
    if (target / "config.json").is_file():
        return target
    if not (out / "nested" / "importance.safetensors").is_file():
        raise SystemExit(f"{out / 'nested'} is missing; build the nested model first")

    def falling(t: torch.Tensor) -> torch.Tensor:  # the first unit ranks highest along the last axis
        return torch.arange(t.shape[-1], 0, -1, dtype=torch.float32).expand(t.shape).clone()

    scores = load_file(out / "nested" / "importance.safetensors")  # its shapes; the values are not used
    imp = Importance(hidden=falling(scores["hidden"]), source="first-k slices (no importance)")
    for key, t in scores.items():
        if key.startswith("layers."):
            _, layer, axis = key.split(".", 2)
            imp.layers.setdefault(int(layer), {})[axis] = falling(t)
    log(f"naive: budgets {recipe['nest']} as first-k slices of the parent")
    nest(out / "parent", target, dict(recipe["nest"]), importance=imp, dtype=torch.float32)
    return target


def train_conversations(recipe: dict, n: int, seed: int) -> list:
    """`n` training conversations, the recipe's share of them multi-turn (`[corpus] multi_turn`, 0 if unset)."""
    from elastic_local.tasks.corpus import conversations

    return list(conversations("train", n, seed, recipe["corpus"].get("multi_turn", 0.0)))


def texts(recipe: dict, n: int, seed: int) -> list[str]:
    from elastic_local.tasks.corpus import conversation_text

    return [conversation_text(c) for c in train_conversations(recipe, n, seed)]


def build(recipe: dict, out: Path, stages: str = "all") -> Path:
    import torch

    from elastic_local.model.config import NemotronHConfig
    from elastic_local.tasks.tokenizer import save_tokenizer, train_tokenizer
    from elastic_local.train import pretrain

    seed, corpus = recipe["seed"], recipe["corpus"]
    out.mkdir(parents=True, exist_ok=True)

    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        log(f"tokenizer: BPE of {corpus['vocab_size']} tokens on {corpus['tokenizer_items']} conversations")
        tmp = out / "tokenizer.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        save_tokenizer(train_tokenizer(texts(recipe, corpus["tokenizer_items"], seed), corpus["vocab_size"]), tmp,
                       history="all" if corpus.get("multi_turn") else "latest")
        tmp.rename(tok_dir)

    init_dir = out / "init"
    config = model_config(recipe, tok_dir)
    if not (init_dir / "config.json").is_file():
        cfg = NemotronHConfig.from_dict(config)
        log("init: random parent " + cfg.pattern)
        pretrain.write_checkpoint(init_dir, config, pretrain.init_tensors(cfg, seed), tok_dir)

    parent = out / "parent"
    if not (parent / "config.json").is_file():
        train_from_scratch(recipe, config, init_dir, out / "train", parent, tok_dir)
    if stages == "parent":
        return parent

    calib = out / "calib.txt"
    if not calib.is_file():
        calib.with_suffix(".partial").write_text("\n".join(texts(recipe, corpus["calib_items"], seed + 1)))
        calib.with_suffix(".partial").rename(calib)

    nested = out / "nested"
    if not (nested / "config.json").is_file():
        from elastic_local.elastic.nest import nest

        log(f"nest: budgets {recipe['nest']} of the parent's parameters")
        nest(parent, nested, dict(recipe["nest"]), calib=calib, dtype=torch.float32)
        log(f"nested model written to {nested}")
    if "elastic" not in recipe:
        return nested
    return elastic(recipe, out)


def elastic(recipe: dict, out: Path) -> Path:
    """The final stage: the nest budgets retrained by elastic distillation from the parent
    (`elastic-local train`, its own resumable state in OUT/elastic/model.train)."""
    from elastic_local.train.cli import trained_report
    from elastic_local.train.loop import train
    from elastic_local.train.recipe import Recipe

    section = dict(recipe["elastic"])
    n_items = section.pop("items")
    work, model = out / "elastic", out / "elastic" / "model"
    corpus = work / "corpus.txt"
    if not corpus.is_file():
        work.mkdir(parents=True, exist_ok=True)
        corpus.with_suffix(".partial").write_text("\n".join(texts(recipe, n_items, recipe["seed"])) + "\n")
        corpus.with_suffix(".partial").rename(corpus)
    settings = Recipe.load(None, seed=recipe["seed"], **section)
    if not (model / "config.json").is_file():
        log(f"elastic: distilling budgets {recipe['nest']} from the parent, {section['steps']} steps")
        train(out / "parent", model, [str(corpus)], dict(recipe["nest"]), settings)
        log(f"elastic model written to {model}")
    lines, warnings = trained_report(model, settings)
    for line in lines + [f"warning: {w}" for w in warnings]:
        log(line.strip())
    return model


def ship(model: Path) -> None:
    """Replace the package's catalog/demo with the final model's files."""
    tmp = CATALOG.with_name("demo.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model, tmp)
    shutil.rmtree(CATALOG, ignore_errors=True)
    tmp.rename(CATALOG)
    log(f"shipped {sum(f.stat().st_size for f in CATALOG.iterdir()) / 2**20:.1f} MiB to {CATALOG}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", type=Path, default=HERE / "recipe.toml")
    ap.add_argument("--out", type=Path, default=HERE / "build")
    ap.add_argument("--stages", choices=["all", "parent"], default="all",
                    help="'parent' stops after training the parent")
    ap.add_argument("--ship", action="store_true", help="copy the final model into elastic_local/catalog/demo")
    ap.add_argument("--independent", metavar="BUDGET",
                    help="instead: train a plain model of the nested BUDGET's shape from scratch with the same "
                         "recipe, into OUT/independent-BUDGET/model (the baseline for `elastic-local eval --compare`)")
    ap.add_argument("--naive", action="store_true",
                    help="instead: the [nest] budgets as first-k slices of the parent (no importance order), into "
                         "OUT/naive (the baseline for importance-ordered nesting)")
    args = ap.parse_args(argv)
    recipe = tomllib.loads(args.recipe.read_text())
    check_recipe(recipe, args.out)
    if args.naive:
        naive(recipe, args.out)
        return 0
    if args.independent:
        if args.ship or args.stages != "all":
            ap.error("--independent builds only the baseline (drop --ship and --stages)")
        independent(recipe, args.out, args.independent)
        return 0
    result = build(recipe, args.out, args.stages)
    if args.ship:
        if args.stages != "all":
            ap.error("--ship needs every stage (drop --stages)")
        ship(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
