"""Generation with elastic budget control on a CPU: decode speed per budget, the cost of a catch-up,
batching, think/answer budget pairs, and what transplanting states (instead of catching up) costs.

    .venv/bin/python benchmarks/bench_generate.py [--threads N] [--reps 3] [--rebuild]

The model: a ~125M-parameter Nemotron-H (hidden 768, vocab 8192, `MEMEM*EMEM*E`, 24 Mamba heads in 4
groups, 12 query / 2 KV heads, 32 experts top-4 of 384 channels, shared expert 768; ~45M active per token;
the vocabulary is kept small so that, as in the real 30B, the LM head is a minor part of a token's
work) with random weights (unit-variance init, fixed seed),
nested by `elastic_local.nest` into budgets full / mid / small (60% and 35% of the parameters), written
once under benchmarks/_work/gen/ with the embedded demo model's tokenizer. It loads through
`elastic_local.load` in float32 exactly as a released nested checkpoint would. Its `</think>` logit is
pinned at 0 (lm_head row zeroed) so that the random model never closes thinking by itself: every
thinking phase is ended by the think token budget and all lengths are fixed. Prompts are random token
ids; decoding is greedy with eos ignored.

1. speed: prefill (128 tokens) and decode (64 tokens) tokens/s of each budget, through `m.generate`, next
   to its share of the full budget's active parameters; plus the bare decode loop (`m.forward` one token
   at a time) of the full budget, so the engine's own per-token cost shows. (The CPU weight layout's
   effect per budget: bench_budgets.py.)
2. catch-up: a budget's cache that has seen 64 tokens consumes a gap of g tokens in one chunked prefill:
   ms per gap token, and how many decode steps the whole catch-up costs.
3. batch: 8 prompts of 16..128 tokens, 32 new tokens each, one `m.generate([...])` against 8 calls.
4. budget control: 4 prompts (64 tokens + `<think>`), 64 thinking tokens (closed by the think budget with
   `</think>` alone), 32 answer tokens, for think/answer pairs; latency of each phase (median).
5. transplant: at the think -> answer hand-over the answer budget either catches up exactly or starts
   from the think budget's states (caches.py `transplant`). Then the same 32 answer tokens are fed to
   both (teacher forcing) and their next-token distributions compared: KL(exact || transplant) and top-1
   agreement, next to the KL between the two budgets themselves (the scale of "different model"); and the
   cosine similarity of the transplanted states with the exact ones at the hand-over.

Random weights say nothing about answer quality; the quality numbers measure how far transplanted states
move the answer budget's distributions from its exact ones. Timings are wall clock, median of --reps
runs, interleaved. The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from statistics import median

import torch

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / "_work" / "gen"
SEED = 0
CONFIG = dict(
    model_type="nemotron_h", architectures=["NemotronHForCausalLM"], vocab_size=8192, hidden_size=768,
    hybrid_override_pattern="MEMEM*EMEM*E", mamba_num_heads=24, mamba_head_dim=64, n_groups=4,
    ssm_state_size=64, conv_kernel=4, chunk_size=128, use_conv_bias=True, num_attention_heads=12,
    num_key_value_heads=2, head_dim=64, intermediate_size=1024, n_routed_experts=32, num_experts_per_tok=4,
    moe_intermediate_size=384, moe_shared_expert_intermediate_size=768, n_shared_experts=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1, layer_norm_epsilon=1e-5,
    tie_word_embeddings=False, mamba_hidden_act="silu", mlp_hidden_act="relu2", bos_token_id=1, eos_token_id=2,
    pad_token_id=0, time_step_limit=[0.0, None],
)
BUDGETS = {"mid": 0.6, "small": 0.35}


# ---------------------------------------------------------------------------------------------- model


def build_bf16() -> Path:
    """benchmarks/_work/gen/nested-bf16: the same nested model with its Linear weights, embeddings and LM
    head stored in BF16, as published checkpoints store them (the float32 original keeps bench_decode's
    comparisons with llama.cpp's f32 GGUFs like for like). Rebuilt with `build`."""
    from safetensors.torch import load_file, save_file

    src = build()
    out = WORK / "nested-bf16"
    if (out / "model.safetensors").is_file() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*"))
    for f in src.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: t.bfloat16() if k.endswith(("proj.weight", "lm_head.weight", "embeddings.weight")) else t
                   for k, t in tensors.items()}, out / f.name, metadata={"format": "pt"})
    return out


def build(rebuild: bool = False) -> Path:
    """benchmarks/_work/gen/nested: random weights nested into full / mid / small, plus a tokenizer."""
    from random_model import write_random_parent

    from elastic_local.elastic.nest import nest
    from elastic_local.paths import DEMO_MODEL

    out, stamp = WORK / "nested", WORK / "stamp.json"
    key = json.dumps({"config": CONFIG, "budgets": BUDGETS, "seed": SEED, "tokenizer": "demo"}, sort_keys=True)
    if out.is_dir() and stamp.is_file() and stamp.read_text() == key and not rebuild:
        return out
    shutil.rmtree(WORK, ignore_errors=True)
    parent = WORK / "parent"
    write_random_parent(parent, CONFIG, SEED)
    print(f"nesting {parent} (random weights) ...", file=sys.stderr)
    nest(parent, out, BUDGETS, max_tokens=2048)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # <think> = 6, specials below 96
        shutil.copy(DEMO_MODEL / name, out / name)
    shutil.rmtree(parent)
    stamp.write_text(key)
    return out


def load(path: Path):
    import elastic_local

    m = elastic_local.load(path, dtype=torch.float32)
    m.net.silence(m.tokenizer.think_ids[1])  # the random model never writes </think> itself
    return m


def prompt_ids(n: int, seed: int, think: bool = False) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(96, CONFIG["vocab_size"], (n,), generator=g).tolist()  # no tokenizer (special) ids
    return ids + [6] if think else ids  # 6 = <think> in the demo tokenizer


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


# ---------------------------------------------------------------------------------------------- 1. speed


def bench_speed(m, args) -> dict:
    from elastic_local.model.budget import count_params

    prompt = prompt_ids(128, 1)
    full_active = count_params(m.config, m.budget(m.budgets[0]))[1]
    runs = {b: {"prefill": [], "decode": []} for b in m.budgets}
    raw = []
    for b in m.budgets:
        m.generate(prompt, answer_budget=b, max_answer_tokens=4, ignore_eos=True)  # warm-up
    for _ in range(args.reps):
        for b in m.budgets:
            st = m.generate(prompt, answer_budget=b, max_answer_tokens=64, ignore_eos=True).stats
            runs[b]["prefill"].append(st.prefill_tokens / st.prefill_s)
            runs[b]["decode"].append(st.answer_tokens / st.answer_s)
        raw.append(bare_decode(m, prompt, 64))
    rows = {}
    for b in m.budgets:
        total, active = count_params(m.config, m.budget(b))
        rows[b] = {"params": total, "active": active, "active_ratio": active / full_active,
                   "prefill_tok_s": median(runs[b]["prefill"]), "decode_tok_s": median(runs[b]["decode"])}
    full = rows[m.budgets[0]]["decode_tok_s"]
    for r in rows.values():
        r["speed_ratio"] = r["decode_tok_s"] / full
    print(f"\n1. speed per budget (float32, {args.threads} threads): prefill 128 tokens, decode 64, median of "
          f"{args.reps}")
    print(f"{'budget':<8}{'params':>10}{'active':>10}{'full/active':>13}{'prefill tok/s':>15}{'decode tok/s':>14}"
          f"{'speed/full':>12}")
    for b, r in rows.items():
        print(f"{b:<8}{r['params'] / 1e6:>9.1f}M{r['active'] / 1e6:>9.1f}M{1 / r['active_ratio']:>13.2f}"
              f"{r['prefill_tok_s']:>15.0f}{r['decode_tok_s']:>14.1f}{r['speed_ratio']:>12.2f}")
    bare = median(raw)
    print(f"bare decode loop of {m.budgets[0]} (m.forward + argmax, no engine): {bare:.1f} tok/s "
          f"(engine: {full / bare:.0%} of it)")
    return {"budgets": rows, "bare_decode_tok_s": bare}


@torch.inference_mode()
def bare_decode(m, prompt: list[int], n: int) -> float:
    cache = m.new_cache()
    tok = m.forward(torch.tensor([prompt]), cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
    t = time.perf_counter()
    for _ in range(n - 1):
        tok = m.forward(tok, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        int(tok)
    return (n - 1) / (time.perf_counter() - t)


# ---------------------------------------------------------------------------------------------- 2. catch-up


@torch.inference_mode()
def bench_catch_up(m, args, speed: dict) -> dict:
    gaps = (16, 64, 256, 1024)
    seen = torch.tensor([prompt_ids(64, 2)])
    out = {}
    print("\n2. catch-up: a cache that has seen 64 tokens consumes g more in one chunked prefill (median)")
    print(f"{'budget':<8}{'gap':>6}{'ms':>9}{'ms/tok':>9}{'= decode steps':>16}")
    for b in (m.budgets[0], m.budgets[-1]):
        decode_ms = 1000 / speed["budgets"][b]["decode_tok_s"]
        for gap in gaps:
            ids = torch.tensor([prompt_ids(gap, 3)])
            times = []
            for _ in range(args.reps):
                cache = m.new_cache(budget=b)
                m.forward(seen, cache, last_only=True)
                times.append(timed(lambda c=cache, i=ids: m.forward(i, c, last_only=True))[0])
            ms = 1000 * median(times)
            out[f"{b}/{gap}"] = {"budget": b, "gap": gap, "ms": ms, "ms_per_token": ms / gap,
                                 "decode_steps": ms / decode_ms}
            print(f"{b:<8}{gap:>6}{ms:>9.1f}{ms / gap:>9.3f}{ms / decode_ms:>16.1f}")
    return out


# ---------------------------------------------------------------------------------------------- 3. batch


def bench_batch(m, args) -> dict:
    prompts = [prompt_ids(16 * (i + 1), 10 + i) for i in range(8)]
    kw = dict(max_answer_tokens=32, ignore_eos=True)
    m.generate(prompts[:2], **kw)  # warm-up
    seq, bat, match = [], [], 0.0
    for _ in range(args.reps):
        s, singles = timed(lambda: [m.generate(p, **kw) for p in prompts])
        b, batch = timed(lambda: m.generate(prompts, **kw))
        seq.append(s)
        bat.append(b)
        match = sum(x.ids == y.ids for x, y in zip(singles, batch)) / len(prompts)
    n = 32 * len(prompts)
    s, b = median(seq), median(bat)
    print(f"\n3. batch: 8 prompts of 16..128 tokens, 32 new tokens each ({m.budgets[0]}), median of {args.reps}")
    print(f"  one at a time  {s:6.2f} s  {n / s:7.1f} tok/s")
    print(f"  batch of 8     {b:6.2f} s  {n / b:7.1f} tok/s   x{s / b:.2f}   (same tokens as one at a time: "
          f"{match:.0%} of rows)")
    return {"sequential_s": s, "batch_s": b, "sequential_tok_s": n / s, "batch_tok_s": n / b, "speedup": s / b,
            "rows_identical": match}


# ---------------------------------------------------------------------------------------------- 4. control


def bench_control(m, args) -> dict:
    full, mid, small = m.budgets[0], m.budgets[1], m.budgets[-1]
    pairs = [(small, small, False), (small, full, False), (small, full, True), (mid, full, False),
             (full, full, False)]
    prompts = [prompt_ids(64, 20 + i, think=True) for i in range(4)]
    kw = dict(max_think_tokens=64, max_answer_tokens=32, ignore_eos=True, think_close="")
    m.generate(prompts[0], think_budget=small, answer_budget=full, **{**kw, "max_think_tokens": 4})  # warm-up
    rows = {}
    samples: dict = {p: [] for p in pairs}
    for _ in range(args.reps):
        for p in prompts:
            for pair in pairs:
                think, answer, transplant = pair
                samples[pair].append(m.generate(p, think_budget=think, answer_budget=answer, transplant=transplant,
                                                **kw).stats)
    print(f"\n4. budget control: 4 prompts (64 tokens + <think>), 64 thinking + 32 answer tokens, median ms of "
          f"{args.reps * len(prompts)}")
    print(f"{'think/answer':<22}{'prefill':>9}{'think':>9}{'tok/s':>8}{'catch-up':>10}{'(tok)':>7}{'answer':>9}"
          f"{'tok/s':>8}{'total':>9}")
    for pair, st in samples.items():
        think, answer, transplant = pair
        name = f"{think}/{answer}" + (" transplant" if transplant else "")
        med = {k: 1000 * median(getattr(s, k) for s in st) for k in ("prefill_s", "think_s", "catch_up_s",
                                                                      "answer_s")}
        med["total_s"] = 1000 * median(s.prefill_s + s.think_s + s.answer_s for s in st)
        tokens = st[0].catch_up_tokens
        think_rate = median((s.think_tokens - s.think_inserted) / s.think_s for s in st)
        answer_rate = median(s.answer_tokens / s.answer_s for s in st)
        rows[name] = {**{k.replace("_s", "_ms"): v for k, v in med.items()}, "catch_up_tokens": tokens,
                      "think_tok_s": think_rate, "answer_tok_s": answer_rate}
        print(f"{name:<22}{med['prefill_s']:>9.1f}{med['think_s']:>9.1f}{think_rate:>8.1f}{med['catch_up_s']:>10.1f}"
              f"{tokens:>7}{med['answer_s']:>9.1f}{answer_rate:>8.1f}{med['total_s']:>9.1f}")
    print("  (think/answer ms include the catch-up done in that phase; total = prefill + think + answer)")
    return rows


# ---------------------------------------------------------------------------------------------- 5. transplant


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@torch.inference_mode()
def bench_transplant(m, args) -> dict:
    from elastic_local.engine.caches import transplant
    from elastic_local.model.attention import KVCache
    from elastic_local.model.mamba2 import MambaState

    full, mid, small = m.budgets[0], m.budgets[1], m.budgets[-1]
    out = {}
    print("\n5. transplant vs exact catch-up at the think -> answer hand-over (4 prompts, 64 thinking tokens, "
          "32 answer tokens teacher-forced)")
    print(f"{'think->answer':<15}{'KL 1st':>8}{'KL mean':>9}{'KL last8':>9}{'top-1':>7}{'| budgets KL':>12}"
          f"{'top-1':>7}{'| cos ssm':>10}{'cos kv':>8}{'exact ms':>10}{'transpl. ms':>12}")
    for src, dst in ((small, full), (mid, full), (full, small)):
        kl_first, kls, kl_late, agree, base, base_agree = [], [], [], [], [], []
        cos_ssm, cos_kv, t_exact, t_tr = [], [], [], []
        for i in range(4):
            p = prompt_ids(64, 20 + i, think=True)
            r = m.generate(p, think_budget=src, answer_budget=dst, max_think_tokens=64, max_answer_tokens=32,
                           ignore_eos=True, think_close="")
            seq = torch.tensor([r.ids])
            h = len(p) + len(r.think_ids)  # the first answer token's position
            # the engine's state at the hand-over: the think budget has consumed all but the last thinking
            # token and </think>; the answer budget has nothing (exact catch-up of h tokens) or starts from
            # the think budget's states and runs the last 2
            s_cache = m.new_cache(budget=src)
            m.forward(seq[:, : h - 2], s_cache)
            d_cache = m.new_cache(budget=dst)
            m.forward(seq[:, : h - 2], d_cache)
            t0 = time.perf_counter()
            m.forward(seq[:, :h], m.new_cache(budget=dst), last_only=True)
            t_exact.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tr = transplant(s_cache, m.budget(dst), m.net.new_cache)
            move_s = time.perf_counter() - t0
            for a, b in zip(d_cache.layers, tr.layers):  # the states the transplant gives vs the exact ones
                if isinstance(a, MambaState):
                    r_ = min(a.ssm.shape[2], b.ssm.shape[2])
                    cos_ssm.append(_cos(a.ssm[:, :, :r_], b.ssm[:, :, :r_]))
                elif isinstance(a, KVCache):
                    n = h - 2
                    cos_kv.append(_cos(a.k[:, :, :n], b.k[:, :, :n]) / 2 + _cos(a.v[:, :, :n], b.v[:, :, :n]) / 2)
            t1 = time.perf_counter()
            approx = m.forward(seq[:, h - 2:h], tr, last_only=True)[:, -1]
            t_tr.append(move_s + time.perf_counter() - t1)  # the similarity check above is not timed
            exact = m.forward(seq[:, h - 2:h], d_cache, last_only=True)[:, -1]
            src_next = m.forward(seq[:, h - 2:h], s_cache, last_only=True)[:, -1]
            steps = [(exact, approx, src_next)]
            for t in range(h, h + 31):
                nxt = seq[:, t:t + 1]
                steps.append(tuple(m.forward(nxt, c)[:, -1] for c in (d_cache, tr, s_cache)))
            for k, (e, a, s) in enumerate(steps):
                le, la, ls = e.log_softmax(-1), a.log_softmax(-1), s.log_softmax(-1)
                kl = float((le.exp() * (le - la)).sum())
                (kl_first if k == 0 else kls).append(kl)
                if k >= len(steps) - 8:
                    kl_late.append(kl)
                agree.append(float(e.argmax() == a.argmax()))
                base.append(float((le.exp() * (le - ls)).sum()))
                base_agree.append(float(e.argmax() == s.argmax()))
        row = {"kl_first": median(kl_first), "kl_mean": sum(kls) / len(kls), "kl_last8": sum(kl_late) / len(kl_late),
               "top1_agree": sum(agree) / len(agree), "kl_between_budgets": sum(base) / len(base),
               "top1_between_budgets": sum(base_agree) / len(base_agree), "cos_ssm": sum(cos_ssm) / len(cos_ssm),
               "cos_kv": sum(cos_kv) / len(cos_kv), "exact_ms": 1000 * median(t_exact),
               "transplant_ms": 1000 * median(t_tr)}
        out[f"{src}->{dst}"] = row
        print(f"{src + '->' + dst:<15}{row['kl_first']:>8.3f}{row['kl_mean']:>9.3f}{row['kl_last8']:>9.3f}"
              f"{row['top1_agree']:>7.2f}{row['kl_between_budgets']:>12.3f}{row['top1_between_budgets']:>7.2f}"
              f"{row['cos_ssm']:>10.3f}{row['cos_kv']:>8.3f}{row['exact_ms']:>10.1f}{row['transplant_ms']:>12.1f}")
    print("  KL in nats, exact || transplant: at the first answer token, mean over the next 31, mean over the last 8;"
          "\n  top-1: argmax agreement; budgets: the same between the answer budget (exact) and the think budget, "
          "the scale of 'another model';\n  cos: cosine similarity of the transplanted states with the exact ones "
          "(Mamba SSM state of the heads both budgets have; KV)")
    return out


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rebuild", action="store_true", help="rebuild the nested checkpoint")
    p.add_argument("--sections", default="speed,catch-up,batch,control,transplant")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sections = set(args.sections.split(","))
    path = build(args.rebuild)
    m = load(path)
    print(f"{path}: budgets {m.budgets}, {args.threads} threads, torch {torch.__version__}", file=sys.stderr)
    summary: dict = {"args": vars(args), "budgets": m.budgets}
    speed = bench_speed(m, args)
    summary["speed"] = speed
    if "catch-up" in sections:
        summary["catch_up"] = bench_catch_up(m, args, speed)
    if "batch" in sections:
        summary["batch"] = bench_batch(m, args)
    if "control" in sections:
        summary["control"] = bench_control(m, args)
    if "transplant" in sections:
        summary["transplant"] = bench_transplant(m, args)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
