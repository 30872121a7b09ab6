"""FP8 and NVFP4 nested checkpoints: bytes per parameter, logit agreement with BF16, CPU decode speed, load memory.

    .venv/bin/python benchmarks/bench_quant.py [--reps 5] [--skip decode,rss]

A small random Nemotron-H (hidden 384, vocab 8192, 12 layers `M*EM-EM*E-ME`: 4 Mamba, 2 attention, 4 MoE
with 16 experts, 2 dense MLP; 17.4M parameters) is built with transformers, its weights given a scale at which
every block matters (weights ~ N(0, 1/fan_in), as tests/tiny.py does), stored in BF16 (router, A_log, D,
dt_bias fp32), nested by `elastic_local.elastic.nest.nest` into full / p60 / p35 (60% and 35% of the
parameters; every cut a multiple of 16, the NVFP4 block), and quantized with
`elastic_local.ptq.quantize.quantize_checkpoint` to FP8 and to NVFP4 (Model Optimizer layout, SPEC §5).
Cached under benchmarks/_work/quant/. Then:

  a. bytes   file bytes / parameters of every budget's extract (`slice_budget`) at each precision, for the
             whole file and for the quantized Linears alone (weights + scales), next to Star Elastic's sizes.
  b. logits  KL(bf16 || q) and next-token (argmax) agreement of FP8 and NVFP4 against BF16, per budget, on
             --positions positions of two kinds of text: uniform random token ids, and the BF16 full model's
             own greedy continuations of random 16-token prompts. All three load with dtype=float32.
  c. decode  batch-1 greedy decode (--prompt-len prompt, --new-tokens tokens) of FP8 and NVFP4 against BF16,
             per budget, interleaved reps, medians, ratios; once per --decode-dtypes compute dtype. On an
             x86 CPU the decode steps of every precision and both dtypes run in model/step.c on gemv.c's
             kernels (quantized weights decoded in registers, a BF16 file's Linear weights in bf16 panels;
             a bfloat16 load keeps its embedding and caches in bf16, model/step.py);
             `ELASTIC_LOCAL_CPU_GEMV=0` shows torch's path (quantized weights dequantized tile by tile).
             `--decode-model gen`: on bench_generate.py's 136M nested model instead, FP8 / NVFP4 made
             while loading (`load(dir, precision=...)`, the same numbers as a stored file); `gen16`: the
             same model stored in BF16, as published files are (a float32 load keeps its Linear weights in
             bf16 panels: 2 bytes a weight where `gen`'s float32 file reads 4); `demo`: the embedded demo
             model (5.6M parameters, BF16). `--fp8-rows` adds the FP8
             model with its codes put back into [out, in] rows (`fp8_as_rows`; everything else as loaded)
             beside the column panels a CPU load keeps them in (quant/fp8.py FP8Panels), and their ratio.
             `--nvfp4-a4` adds the NVFP4 model with its inputs rounded to NVFP4 too (`nvfp4-a4`:
             `load(..., activations="nvfp4")`, W4A4 as Blackwell computes it; on the CPU integer products).
  d. rss     on bench_nesting.py's ~107M-parameter nested checkpoint (built if missing) and its FP8 / NVFP4
             quantizations: memory of loading one budget (--rss-budget, default full) with dtype=bfloat16 from
             the BF16 file as BF16, with load-time FP8 / NVFP4 quantization (`load(bf16_dir, precision=...)`),
             and from the stored FP8 / NVFP4 files, then one forward pass; peak RSS (VmHWM) after each, RssAnon
             and the checkpoint's mapped pages; one fresh process per case (bench_nesting.rss_child), above a
             process that only imports.

Random-weight models exaggerate quantization error: no trained weight or activation structure, and nearly
flat next-token distributions, so argmax flips on tiny logit changes. Read (b) as a check that the formats
work and as a relative ordering (FP8 vs NVFP4, budget vs budget), not as the accuracy of a real model.
The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F

import elastic_local

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny.randomize
import bench_nesting  # noqa: E402  (benchmarks/bench_nesting.py: the 100M checkpoint and the RSS child)

WORK = Path(__file__).resolve().parent / "_work" / "quant"
SEED = 0
PRECISIONS = ("bf16", "fp8", "nvfp4")
BUDGETS = {"p60": 0.60, "p35": 0.35}
STAR_ELASTIC_GB = {"bf16": 58.9, "fp8": 31.4, "nvfp4": 18.7}  # the 30B model's file (SPEC §2)

CONFIG = dict(
    vocab_size=8192, hidden_size=384, hybrid_override_pattern="M*EM-EM*E-ME",
    mamba_num_heads=12, mamba_head_dim=32, n_groups=2, ssm_state_size=32, chunk_size=64,
    num_attention_heads=6, num_key_value_heads=2, head_dim=64, intermediate_size=768,
    n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, moe_shared_expert_intermediate_size=256,
    conv_kernel=4, expand=2, use_conv_bias=True, mamba_hidden_act="silu", layer_norm_epsilon=1e-5,
    mlp_hidden_act="relu2", n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    n_group=1, topk_group=1, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


# ---------------------------------------------------------------------------------------------- checkpoints


def build_tiny(rebuild: bool = False) -> dict[str, Path]:
    """WORK/{bf16,fp8,nvfp4}: the tiny model nested, and its nested file quantized."""
    from tiny import randomize  # the tests' recipe: every block matters, routing varies
    from transformers import NemotronHConfig, NemotronHForCausalLM
    from transformers.utils import logging as hf_logging

    from elastic_local.elastic.nest import nest
    from elastic_local.ptq.quantize import quantize_checkpoint

    dirs = {p: WORK / p for p in PRECISIONS}
    stamp = json.dumps({"config": CONFIG, "budgets": BUDGETS, "init": "randomize-v1"}, sort_keys=True)
    if not rebuild and (WORK / "stamp.json").is_file() and (WORK / "stamp.json").read_text() == stamp \
            and all((d / "config.json").is_file() for d in dirs.values()):
        return dirs
    print(f"building {WORK} ...", file=sys.stderr)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    model = NemotronHForCausalLM(NemotronHConfig(**CONFIG))
    randomize(model, SEED)
    model.config.time_step_min = 1e-9  # transformers clamps dt at time_step_min, the shipped model does not
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not bench_nesting.FP32_TENSORS.search(name):
            t.data = t.data.to(torch.bfloat16)
    model.save_pretrained(str(WORK / "parent"))
    nest(WORK / "parent", dirs["bf16"], BUDGETS, max_tokens=4096)
    shutil.rmtree(WORK / "parent")
    for p in ("fp8", "nvfp4"):
        quantize_checkpoint(dirs["bf16"], dirs[p], p)
    (WORK / "stamp.json").write_text(stamp)
    return dirs


# ---------------------------------------------------------------------------------------------- a. bytes


def linear_part(name: str) -> str | None:
    """The Linear weight a stored tensor belongs to (itself or one of its scales), if it is a quantizable one."""
    from elastic_local.checkpoint.files import canonical
    from elastic_local.quant.scheme import is_quantized

    name = canonical(name)
    for suffix in (".weight_scale_2", ".weight_scale", ".input_scale", ".weight"):
        if name.endswith(suffix):
            w = name[: -len(suffix)] + ".weight"
            return w if is_quantized(w) else None
    return None


def bytes_per_param(dirs: dict[str, Path], budgets: list[str]) -> dict:
    """Extract every budget at every precision; file bytes over parameters, whole and quantized Linears only."""
    from elastic_local.checkpoint.files import index_tensors
    from elastic_local.elastic.slice import slice_budget

    out: dict = {}
    for prec, d in dirs.items():
        for b in budgets:
            path, _ = slice_budget(d, WORK / "slices" / f"{prec}-{b}", b, overwrite=True)
            tensors = index_tensors(path)
            lin_bytes = sum(t.nbytes for k, t in tensors.items() if linear_part(k))
            # parameters of the quantizable Linears: counted on the BF16 extract, where each is one tensor
            lin_params = sum(math.prod(t.shape) for k, t in tensors.items() if linear_part(k) == k) \
                if prec == "bf16" else 0
            out.setdefault(prec, {})[b] = {"file_bytes": sum(f.stat().st_size for f in path.glob("*.safetensors")),
                                           "linear_bytes": lin_bytes, "linear_params_bf16": lin_params}
            shutil.rmtree(path)
    return out


def print_bytes(res: dict, params: dict[str, int]) -> dict:
    print("\na. bytes per parameter of each budget's extract (slice_budget); whole = every model*.safetensors "
          "byte / every parameter,\n   linears = the quantizable Linears' bytes (codes + scales) / their parameters")
    print(f"{'budget':<8}{'params':>9}" + "".join(f"{p + ' MB':>10}{'B/param':>9}{'linears':>9}" for p in PRECISIONS)
          + f"{'fp8/bf16':>10}{'nvfp4/bf16':>12}")
    for b in params:
        lin_params = res["bf16"][b]["linear_params_bf16"]
        row = f"{b:<8}{params[b] / 1e6:>8.2f}M"
        for p in PRECISIONS:
            r = res[p][b]
            r["bytes_per_param"] = r["file_bytes"] / params[b]
            r["linear_bytes_per_param"] = r["linear_bytes"] / lin_params
            row += f"{r['file_bytes'] / 1e6:>10.2f}{r['bytes_per_param']:>9.3f}{r['linear_bytes_per_param']:>9.3f}"
        bf = res["bf16"][b]["file_bytes"]
        print(row + f"{res['fp8'][b]['file_bytes'] / bf:>10.3f}{res['nvfp4'][b]['file_bytes'] / bf:>12.3f}")
    first = next(iter(params))
    share = res["bf16"][first]["linear_params_bf16"] / params[first]
    s = STAR_ELASTIC_GB
    print(f"quantizable Linears hold {share:.0%} of the {first} parameters here (embeddings and lm_head stay BF16); "
          f"Star Elastic 30B: FP8 / BF16 = {s['fp8']} / {s['bf16']} GB = {s['fp8'] / s['bf16']:.3f}, "
          f"NVFP4 / BF16 = {s['nvfp4']} / {s['bf16']} = {s['nvfp4'] / s['bf16']:.3f}")
    return res


# ---------------------------------------------------------------------------------------------- b. logits


def noise_controls(dirs: dict[str, Path]) -> tuple[dict[str, float], dict[str, Path]]:
    """Per precision: the relative RMS error of the quantized Linears, sqrt(sum (deq(q(W)) - W)^2 / sum W^2),
    and a control checkpoint: the BF16 nested file with every quantizable Linear given Gaussian noise of the
    same RMS as its own quantization error. If a format's logit error matches its control's, the format adds
    nothing worse than noise of its size, and the model's own sensitivity sets the numbers."""
    from safetensors.torch import load_file, save_file

    from elastic_local.checkpoint.files import canonical
    from elastic_local.quant.scheme import quantize

    tensors = load_file(dirs["bf16"] / "model.safetensors")
    errors, controls = {}, {}
    for prec in ("fp8", "nvfp4"):
        g = torch.Generator().manual_seed(SEED + 2)
        err2 = w2 = 0.0
        noisy = {}
        for name, t in tensors.items():
            if linear_part(name) != canonical(name):  # not a quantizable Linear weight
                noisy[name] = t
                continue
            w = t.float()
            e = quantize(t, prec, name).dequantize(torch.float32) - w
            err2, w2 = err2 + float(e.square().sum()), w2 + float(w.square().sum())
            noisy[name] = (w + torch.randn(w.shape, generator=g) * e.square().mean().sqrt()).to(t.dtype)
        errors[prec] = math.sqrt(err2 / w2)
        controls[prec] = WORK / f"noise-{prec}"
        shutil.rmtree(controls[prec], ignore_errors=True)
        shutil.copytree(dirs["bf16"], controls[prec])
        save_file(noisy, controls[prec] / "model.safetensors", metadata={"format": "pt"})
    return errors, controls


@torch.inference_mode()
def greedy_text(model, n_seq: int, seq_len: int, prompt_len: int = 16) -> torch.Tensor:
    """[n_seq, seq_len]: random prompts continued greedily by `model` (its largest budget)."""
    g = torch.Generator().manual_seed(SEED + 1)
    rows = []
    for _ in range(n_seq):
        ids = torch.randint(3, CONFIG["vocab_size"], (1, prompt_len), generator=g)
        cache = model.new_cache(1)
        tok = model.forward(ids, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        out = [ids, tok]
        for _ in range(seq_len - prompt_len - 1):
            tok = model.forward(tok, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
            out.append(tok)
        rows.append(torch.cat(out, 1))
    return torch.cat(rows)


@torch.inference_mode()
def agreement(models: dict, budgets: list[str], texts: dict[str, torch.Tensor]) -> dict:
    """Per text kind, budget and model other than "bf16": KL(bf16 || q), argmax agreement, relative logit error."""
    out: dict = {}
    for kind, ids in texts.items():
        for b in budgets:
            ref = models["bf16"].logits(ids, budget=b).flatten(0, 1)  # [positions, vocab]
            logp = F.log_softmax(ref, -1)
            entropy = float(-(logp.exp() * logp).sum(-1).mean())
            for p in models:
                if p == "bf16":
                    continue
                q = models[p].logits(ids, budget=b).flatten(0, 1)
                logq = F.log_softmax(q, -1)
                kl = (logp.exp() * (logp - logq)).sum(-1)
                out.setdefault(kind, {}).setdefault(b, {"bf16_entropy": entropy})[p] = {
                    "kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)),
                    "top1_agree": float((ref.argmax(-1) == q.argmax(-1)).float().mean()),
                    "rel_logit_err": float((q - ref).norm() / ref.norm()),
                }
    return out


def print_agreement(res: dict, texts: dict[str, torch.Tensor], errors: dict[str, float]) -> None:
    print("\nb. FP8 / NVFP4 logits against BF16 (all loaded with dtype=float32), per budget; KL in nats, mean and "
          "99th percentile over positions;\n   rel err = ||q - bf16|| / ||bf16|| of the logits; H = mean entropy of "
          "the BF16 next-token distribution (uniform: "
          f"{math.log(CONFIG['vocab_size']):.2f});\n   noise~X = BF16 weights plus Gaussian noise of X's per-tensor "
          "error RMS (relative RMS weight error of the quantized Linears: "
          + ", ".join(f"{p} {e:.2%}" for p, e in errors.items()) + ")")
    for kind, ids in texts.items():
        uniq = len(set(ids.flatten().tolist()))
        print(f"text: {kind} ({ids.shape[0]} x {ids.shape[1]} = {ids.numel()} positions, {uniq} distinct ids)")
        print(f"  {'budget':<8}{'H nats':>8}  {'precision':<10}{'KL mean':>10}{'KL p99':>10}{'top-1 agree':>13}"
              f"{'rel err':>9}")
        for b, r in res[kind].items():
            for p, x in r.items():
                if p == "bf16_entropy":
                    continue
                print(f"  {b:<8}{r['bf16_entropy']:>8.2f}  {p:<10}{x['kl_mean']:>10.5f}{x['kl_p99']:>10.5f}"
                      f"{x['top1_agree']:>13.1%}{x['rel_logit_err']:>9.4f}")


# ---------------------------------------------------------------------------------------------- c. decode


@torch.inference_mode()
def fp8_as_rows(m):
    """m with every FP8 weight's codes put back into [out, in] rows (quant.fp8.FP8Weight), in place: the layout
    a CPU load kept them in before their column panels (FP8Panels), and nothing else changed."""
    from elastic_local.model.linear import RowConcat
    from elastic_local.quant.fp8 import FP8Panels, FP8Weight

    def rows(w):
        if isinstance(w, FP8Panels):
            codes = w.weight.transpose(-1, -2).flatten(-3, -2)[w.skip:w.skip + w.n].contiguous()
            return FP8Weight(codes.view(torch.float8_e4m3fn), w.weight_scale, w.input_scale)
        if isinstance(w, RowConcat):
            return RowConcat([rows(p) for p in w.parts])
        return [rows(e) for e in w] if isinstance(w, list) else w

    for layer in m.net.layers:
        for name, w in vars(layer.mixer).items():
            setattr(layer.mixer, name, rows(w))
    m.net.c_steps.clear()  # they point at the panels
    return m


def decode_run(model, budget: str, prompt: torch.Tensor, n_new: int) -> tuple[float, float, list[int]]:
    """(prefill seconds incl. first token, decode seconds for the other n_new - 1, tokens), greedy, batch 1."""
    t0 = time.perf_counter()
    cache = model.new_cache(1, budget=budget)
    tok = model.forward(prompt, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
    out = [int(tok)]
    t1 = time.perf_counter()
    for _ in range(n_new - 1):
        tok = model.forward(tok, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        out.append(int(tok))
    return t1 - t0, time.perf_counter() - t1, out


def decode_speed(models: dict, budgets: list[str], args: argparse.Namespace) -> dict:
    vocab = min(m.config.vocab_size for m in models.values())  # the demo's is 512
    prompt = torch.randint(3, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(SEED))
    res = {b: {p: {"decode_tok_s": [], "prefill_tok_s": []} for p in models} for b in budgets}
    for b in budgets:  # warm-up, and the tokens each precision generates
        for p, m in models.items():
            res[b][p]["tokens"] = decode_run(m, b, prompt, args.new_tokens)[2]
    for _ in range(args.reps):
        for b in budgets:  # interleaved: every (budget, precision) once per rep
            for p, m in models.items():
                t_pre, t_dec, _ = decode_run(m, b, prompt, args.new_tokens)
                res[b][p]["prefill_tok_s"].append(args.prompt_len / t_pre)
                res[b][p]["decode_tok_s"].append((args.new_tokens - 1) / t_dec)
    return res


def print_decode(res: dict, args: argparse.Namespace, dtype: str) -> dict:
    print(f"\nc. CPU decode, batch 1, greedy, {dtype} compute, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"{args.threads} threads, median of {args.reps} interleaved reps")
    print(f"{'budget':<8}{'precision':<10}{'prefill tok/s':>15}{'decode tok/s':>14}{'spread':>8}{'ms/tok':>8}"
          f"{'x bf16':>8}{'same tokens':>13}")
    out: dict = {}
    for b, per in res.items():
        ref = median(per["bf16"]["decode_tok_s"])
        for p, r in per.items():
            dec, pre = median(r["decode_tok_s"]), median(r["prefill_tok_s"])
            spread = (max(r["decode_tok_s"]) - min(r["decode_tok_s"])) / dec
            same = sum(x == y for x, y in zip(r["tokens"], per["bf16"]["tokens"])) / len(r["tokens"])
            print(f"{b:<8}{p:<10}{pre:>15.1f}{dec:>14.1f}{spread:>8.0%}{1000 / dec:>8.2f}{dec / ref:>8.2f}"
                  f"{same:>13.0%}")
            out.setdefault(b, {})[p] = {"decode_tok_s": dec, "prefill_tok_s": pre, "ratio_to_bf16": dec / ref,
                                        "same_tokens": same, "decode_tok_s_all": r["decode_tok_s"],
                                        "prefill_tok_s_all": r["prefill_tok_s"]}
    print("same tokens: fraction of the greedy tokens equal to BF16's at the same position")
    for b, per in out.items():
        if "fp8-rows" in per:
            ratios = [p / r for p, r in zip(per["fp8"]["decode_tok_s_all"], per["fp8-rows"]["decode_tok_s_all"])]
            ratio = per["fp8"]["decode_tok_s"] / per["fp8-rows"]["decode_tok_s"]
            print(f"{b:<8}fp8 in column panels (a CPU load's layout) / fp8 in rows: {ratio:.2f}x "
                  f"(rep by rep {median(ratios):.2f}x)")
    return out


# ---------------------------------------------------------------------------------------------- d. RSS


def build_big_quantized(rebuild: bool = False) -> dict[str, Path]:
    """bench_nesting's ~107M nested BF16 checkpoint, and its FP8 and NVFP4 quantizations next to it."""
    from elastic_local.ptq.quantize import quantize_checkpoint

    bf16 = bench_nesting.build_nested(rebuild=rebuild)
    dirs = {"bf16": bf16}
    for p in ("fp8", "nvfp4"):
        dirs[p] = bf16.parent / f"nested-{p}"
        if rebuild or not (dirs[p] / "config.json").is_file() \
                or dirs[p].stat().st_mtime < (bf16 / "config.json").stat().st_mtime:
            print(f"quantizing {bf16} to {p} ...", file=sys.stderr)
            quantize_checkpoint(bf16, dirs[p], p, max_tokens=2048, overwrite=True)
    return dirs


def rss(dirs: dict[str, Path], budget: str, reps: int, forward: int) -> dict:
    """Each case's child result with the lowest final peak over reps; dtype=bfloat16 throughout (what the fit
    planner plans)."""
    cases = {"baseline": {},
             "bf16 file as bf16": {"dir": str(dirs["bf16"])},
             "bf16 file -> fp8 at load": {"dir": str(dirs["bf16"]), "precision": "fp8"},
             "bf16 file -> nvfp4 at load": {"dir": str(dirs["bf16"]), "precision": "nvfp4"},
             "stored fp8 file": {"dir": str(dirs["fp8"])},
             "stored nvfp4 file": {"dir": str(dirs["nvfp4"])}}
    script = Path(bench_nesting.__file__).resolve()
    runs: dict[str, list[dict]] = {}
    for _ in range(reps):
        for name, spec in cases.items():
            if spec:
                spec = {**spec, "budget": budget, "dtype": "bfloat16", "forward": forward}
            runs.setdefault(name, []).append(bench_nesting.run_child(script, spec))
    return {k: min(v, key=lambda r: r["run"]["VmHWM"]) for k, v in runs.items()}


def print_rss(res: dict, budget: str, dirs: dict[str, Path], forward: int) -> dict:
    base = res.pop("baseline")
    print(f"\nd. memory of elastic_local.load(..., budget={budget!r}, dtype=torch.bfloat16) of the ~107M model and one "
          f"forward pass, fresh process each, above a process that only imports torch + elastic_local "
          f"(peak {base['run']['VmHWM'] / 2**20:.0f} MiB)")
    files = {p: sum(f.stat().st_size for f in d.glob("model*.safetensors")) for p, d in dirs.items()}
    print("files: " + ", ".join(f"{p} {n / 2**20:.1f} MiB" for p, n in files.items()))
    print(f"{'case':<28}" + bench_nesting.RSS_HEAD + f"{'load s':>8}")
    for name, r in res.items():
        print(f"{name:<28}" + bench_nesting.rss_row(r, base) + f"{r['load_s']:>8.2f}")
    ref = res["bf16 file as bf16"]["above_baseline"]
    ratios = []
    for name, r in res.items():
        m = r["above_baseline"]
        r["ratio_to_bf16"] = {k: m[k] / ref[k] for k in ("load_peak", "run_peak")}
        ratios.append(f"{name} {r['ratio_to_bf16']['load_peak']:.2f} / {r['ratio_to_bf16']['run_peak']:.2f}")
    print("load peak / run peak relative to the bf16 file loaded as bf16: " + "; ".join(ratios[1:]))
    print(bench_nesting.RSS_NOTE.format(n=forward))
    return {"baseline": base, "files": files, **res}


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--positions", type=int, default=512, help="positions per text kind for the logit comparison")
    p.add_argument("--seq-len", type=int, default=128, help="length of each evaluated sequence")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=5, help="timed decode runs per (budget, precision)")
    p.add_argument("--decode-dtypes", default="float32,bfloat16", help="compute dtypes of the decode part")
    p.add_argument("--fp8-rows", action="store_true",
                   help="decode the FP8 model with its codes put back into [out, in] rows too (fp8_as_rows), "
                        "beside the column panels a CPU load keeps them in")
    p.add_argument("--nvfp4-a4", action="store_true",
                   help="decode the NVFP4 model with its inputs rounded to NVFP4 too (activations='nvfp4', W4A4)")
    p.add_argument("--decode-model", default="tiny", choices=("tiny", "gen", "gen16", "demo"),
                   help="decode part on the 17M model's stored files, or on bench_generate.py's 136M nested "
                        "model (53M active) quantized while loading")
    p.add_argument("--rss-reps", type=int, default=1, help="fresh processes per RSS case (the minimum is kept)")
    p.add_argument("--rss-budget", default="full", help="budget of the ~107M model the RSS part loads")
    p.add_argument("--forward-tokens", type=int, default=64, help="tokens of the forward pass after loading (RSS)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip, from: bytes, logits, decode, rss")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rebuild", action="store_true", help="rebuild every checkpoint")
    args = p.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    assert args.new_tokens >= 2, "--new-tokens must be >= 2 (decode time is measured after the first)"
    torch.set_num_threads(args.threads)
    load_avg = os.getloadavg()[0]

    dirs = build_tiny(args.rebuild)
    cfg = elastic_local.NemotronHConfig.from_dir(dirs["bf16"])
    from elastic_local.elastic.table import read_budgets
    from elastic_local.model.budget import count_params

    table = read_budgets(cfg)
    budgets = list(table)  # largest first: full, p60, p35
    params = {b: count_params(cfg, table[b])[0] for b in budgets}
    print(f"tiny nested model {WORK}: budgets " + ", ".join(f"{b} {params[b] / 1e6:.2f}M" for b in budgets)
          + f"; load average before the run {load_avg:.2f}, {args.threads} threads")
    summary: dict = {"args": vars(args), "load_avg": load_avg, "params": params, "seconds": {}}
    t = time.perf_counter()

    def lap(part: str) -> None:
        nonlocal t
        summary["seconds"][part] = time.perf_counter() - t
        print(f"[{part}: {summary['seconds'][part]:.0f} s]", file=sys.stderr)
        t = time.perf_counter()

    if "bytes" not in skip:
        summary["bytes"] = print_bytes(bytes_per_param(dirs, budgets), params)
        lap("bytes")

    models = {prec: elastic_local.load(d, dtype=torch.float32) for prec, d in dirs.items()}
    if "logits" not in skip:
        errors, controls = noise_controls(dirs)
        compared = {"bf16": models["bf16"], "fp8": models["fp8"],
                    "noise~fp8": elastic_local.load(controls["fp8"], dtype=torch.float32), "nvfp4": models["nvfp4"],
                    "noise~nvfp4": elastic_local.load(controls["nvfp4"], dtype=torch.float32)}
        n_seq = max(1, args.positions // args.seq_len)
        g = torch.Generator().manual_seed(SEED)
        texts = {"random ids": torch.randint(3, CONFIG["vocab_size"], (n_seq, args.seq_len), generator=g),
                 "bf16 greedy": greedy_text(models["bf16"], n_seq, args.seq_len)}
        res = agreement(compared, budgets, texts)
        print_agreement(res, texts, errors)
        # the same weights quantized while loading the BF16 file must give the stored files' logits
        ids = texts["random ids"][:1]
        same = {}
        for prec in ("fp8", "nvfp4"):
            live = elastic_local.load(dirs["bf16"], precision=prec, dtype=torch.float32)
            with torch.inference_mode():
                same[prec] = {b: float((live.logits(ids, budget=b) - models[prec].logits(ids, budget=b)).abs().max())
                              for b in budgets}
        print("load-time quantization of the BF16 file vs the stored file, max |logit difference|: "
              + "; ".join(f"{prec} " + ", ".join(f"{b} {v:.1e}" for b, v in d.items()) for prec, d in same.items()))
        summary["logits"] = {"results": res, "weight_rel_rms_error": errors, "load_time_vs_stored_max_abs": same}
        del compared
        lap("logits")

    if "decode" not in skip:
        summary["decode"] = {}
        sources, decode_budgets = {p: (d, None) for p, d in dirs.items()}, budgets
        if args.decode_model in ("gen", "gen16"):
            import bench_generate

            gen = bench_generate.build() if args.decode_model == "gen" else bench_generate.build_bf16()
            sources = {p: (gen, None if p == "bf16" else p) for p in dirs}
            decode_budgets = ["full", *bench_generate.BUDGETS]
        elif args.decode_model == "demo":  # the embedded demo model (a BF16 file), quantized while loading
            from elastic_local.paths import default_model

            sources = {p: (default_model(), None if p == "bf16" else p) for p in dirs}
            decode_budgets = ["full", "mid", "small"]
        for dtype in args.decode_dtypes.split(","):
            loaded = dict(models) if dtype == "float32" and args.decode_model == "tiny" else {
                prec: elastic_local.load(d, dtype=getattr(torch, dtype), precision=q)
                for prec, (d, q) in sources.items()}
            if args.nvfp4_a4:  # the same NVFP4 weights, their inputs rounded to NVFP4 too
                loaded["nvfp4-a4"] = elastic_local.load(sources["nvfp4"][0], dtype=getattr(torch, dtype),
                                                        precision=sources["nvfp4"][1], activations="nvfp4")
            if args.fp8_rows:  # the same FP8 weights as [out, in] rows, everything else as the load keeps it
                loaded["fp8-rows"] = fp8_as_rows(elastic_local.load(sources["fp8"][0], dtype=getattr(torch, dtype),
                                                                    precision=sources["fp8"][1]))
            summary["decode"][dtype] = print_decode(decode_speed(loaded, decode_budgets, args), args, dtype)
            del loaded
        lap("decode")
    del models

    if "rss" not in skip:
        big = build_big_quantized(args.rebuild)
        res = rss(big, args.rss_budget, args.rss_reps, args.forward_tokens)
        summary["rss"] = print_rss(res, args.rss_budget, big, args.forward_tokens)
        lap("rss")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
