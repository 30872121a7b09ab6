"""Batch-1 greedy prefill and decode speed: our engine vs transformers vs llama.cpp, in one process.

    .venv/bin/python benchmarks/bench_decode.py [--configs tiny,30m,100m] [--new-tokens N]

For each config a random-weight Nemotron-H checkpoint is built with `NemotronHForCausalLM(config)` (fixed
seed) and saved in the hub layout under benchmarks/_work/<config>/; every engine loads those same files,
float32, and runs the same prompt (random token ids, fixed seed) greedily for exactly --new-tokens tokens:

    ours          elastic_local.load(...).forward(ids, cache=cache, last_only=True), prompt in one call,
                  then one token per call, under torch.inference_mode(); float32 weights kept [in, out],
                  decode steps in C (model/step.c, one call per block, on the kernels of model/gemv.c)
    ours-torch    the same with the kernels off (ELASTIC_LOCAL_CPU_GEMV=0): torch's layers and matmul
    ours-rows     ELASTIC_LOCAL_CPU_LAYOUT=rows: weights kept [out, in], decode steps in C
    ours-compiled load(compile=True); on an x86 CPU the C step still takes one-sequence decode steps
    ours-generate the whole engine (m.generate's loop: phases, sampling, detokenizing, events), timed by
                  its Token events, sampled tokens only; against transformers' generate()
    ours-fp8, ours-nvfp4  `ours` on the same weights quantized while loading (load(precision=...)),
                  decode steps in C, float32 compute, lm_head kept float32;
                  against llama.cpp-q8_0 / -q4_0
    ours-fp8-bf16, ours-nvfp4-bf16  the same loaded in bfloat16 (activations, caches and lm_head bf16:
                  the CPU's load where float32 does not fit; prompts on the CPU's bf16 dot products where
                  it has them), against llama.cpp-q8_0 / -q4_0, which round activations to 8-bit integers: their
                  prompts compare, their decode does not (the lm_head, a large part of the bytes a small
                  model's token reads, is bf16 here and f32 in llama.cpp's quantized files)
    transformers-loop  the same bare loop on transformers: model(ids, cache=cache, use_cache=True,
                  logits_to_keep=1) + argmax (like for like with ours: neither has generate()'s overhead)
    transformers  NemotronHForCausalLM.generate(greedy, use_cache, min_new_tokens = max_new_tokens): the
                  independent reference for `match`; ours / transformers compares a bare loop with a
                  full generate() and is printed only as that
    llama.cpp     llama-cpp-python on an f32 GGUF converted by llama.cpp's convert_hf_to_gguf.py
    llama.cpp-q8_0, llama.cpp-q4_0  that GGUF quantized by llama.cpp itself (output tensor kept f32)

Timing (wall clock): prefill = prompt forward + first token (prompt_len / seconds); decode = the other
new_tokens - 1 tokens (tokens / seconds). Each engine runs once to warm up, then at least --reps times
(more on short configs, until the slowest engine has run --min-seconds), the engines interleaved within
each rep because the machine is noisy, the first engine rotating from rep to rep (at 100m a 1 GiB copy
probe opens each rep: no engine always follows it). The table shows medians, `spread` = (max - min) /
median of the decode samples, and the 1-minute load average (other processes on a 2-core box stall
OpenMP barriers, llama.cpp's most of all). `match` is the fraction of generated tokens equal to transformers' (the
independent reference). All engines use --threads threads (default: the cores available). For the 100m
config the script also prints the weight bytes a decode step reads (from the config) per second against
the memory-copy bandwidth sampled in every rep.

Transformers' config is built with a tiny `time_step_min`: transformers >= 5.3 clamps dt at
time_step_min, the shipped model (and our engine, and llama.cpp) do not (SPEC §3).
The last line of output is one JSON object with every number in the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp  # noqa: E402  (benchmarks/llamacpp.py, next to this file)

WORK_DIR = Path(__file__).resolve().parent / "_work"
SEED = 0

# ---------------------------------------------------------------------------------------------- configs
# NemotronHConfig kwargs. Pattern letters: M Mamba2, E MoE, * attention, - dense MLP (SPEC §3).

_COMMON = dict(
    conv_kernel=4, expand=2, use_conv_bias=True, mamba_hidden_act="silu", layer_norm_epsilon=1e-5,
    mlp_hidden_act="relu2", n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    n_group=1, topk_group=1, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)

CONFIGS: dict[str, dict] = {
    # every block type once or twice; llama.cpp skips it (no '-' layers in its MoE graph)
    "tiny": dict(
        _COMMON, vocab_size=512, hidden_size=64, hybrid_override_pattern="MEM*E-",
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=16,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64,
    ),
    # ~30M params, the llama.cpp comparison point
    "30m": dict(
        _COMMON, vocab_size=16384, hidden_size=384, hybrid_override_pattern="MEMEM*EMEM*E",
        mamba_num_heads=12, mamba_head_dim=64, n_groups=4, ssm_state_size=64, chunk_size=128,
        num_attention_heads=6, num_key_value_heads=2, head_dim=64, intermediate_size=1024,
        n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=160,
        moe_shared_expert_intermediate_size=384,
    ),
    # ~100M params (~55M read per decoded token)
    "100m": dict(
        _COMMON, vocab_size=32000, hidden_size=768, hybrid_override_pattern="MEMEM*EMEM*E",
        mamba_num_heads=24, mamba_head_dim=64, n_groups=4, ssm_state_size=64, chunk_size=128,
        num_attention_heads=12, num_key_value_heads=2, head_dim=64, intermediate_size=2048,
        n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=128,
        moe_shared_expert_intermediate_size=512,
    ),
}


def hf_config(name: str):
    """transformers config for a preset; `time_step_min` is set tiny after init (see build_checkpoint)."""
    from transformers import NemotronHConfig

    return NemotronHConfig(**CONFIGS[name])


# ---------------------------------------------------------------------------------------------- weight bytes


@dataclass
class ParamCount:
    total: int  # every weight in the checkpoint
    decode: int  # weights one decode step reads: embedding row, non-expert weights, top-k + shared, lm_head


def param_count(cfg) -> ParamCount:
    """Count parameters from a NemotronHConfig (hub layout, mtp excluded)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    d_inner = cfg.mamba_num_heads * cfg.mamba_head_dim
    conv_dim = d_inner + 2 * cfg.n_groups * cfg.ssm_state_size
    mamba = (
        H * (2 * d_inner + 2 * cfg.n_groups * cfg.ssm_state_size + cfg.mamba_num_heads)  # in_proj
        + conv_dim * cfg.conv_kernel + (conv_dim if cfg.use_conv_bias else 0)  # conv1d
        + 3 * cfg.mamba_num_heads  # dt_bias, A_log, D
        + d_inner  # gated norm
        + d_inner * H  # out_proj
    )
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attention = 2 * H * q + 2 * H * kv
    mlp = 2 * H * cfg.intermediate_size
    router = cfg.n_routed_experts * H + cfg.n_routed_experts  # gate.weight + e_score_correction_bias
    expert = 2 * H * cfg.moe_intermediate_size
    shared = 2 * H * cfg.moe_shared_expert_intermediate_size
    per_layer = {  # (total, read per decode step); + H for each block's norm
        "M": (mamba, mamba),
        "*": (attention, attention),
        "-": (mlp, mlp),
        "E": (router + cfg.n_routed_experts * expert + shared,
              router + cfg.num_experts_per_tok * expert + shared),
    }
    pattern = cfg.hybrid_override_pattern
    total = V * H + sum(per_layer[c][0] + H for c in pattern) + H + V * H
    decode = H + sum(per_layer[c][1] + H for c in pattern) + H + V * H
    return ParamCount(total, decode)


# ---------------------------------------------------------------------------------------------- checkpoints


def build_checkpoint(name: str, rebuild: bool = False) -> Path:
    """benchmarks/_work/<name>/: config.json, model.safetensors (hub layout), tokenizer.json."""
    from transformers import NemotronHForCausalLM

    out = WORK_DIR / name
    cfg = hf_config(name)
    stamp = json.dumps(CONFIGS[name], sort_keys=True)
    if not rebuild and (out / "model.safetensors").is_file() and (out / "bench_stamp.json").is_file():
        if (out / "bench_stamp.json").read_text() == stamp:
            llamacpp.ensure_tokenizer(out)
            return out
    torch.manual_seed(SEED)
    model = NemotronHForCausalLM(cfg).float()  # default init keeps activations sane
    n = sum(t.numel() for t in model.state_dict().values())  # the router's correction bias is a buffer
    assert n == param_count(cfg).total, f"param_count() is off: model has {n}, config says {param_count(cfg)}"
    model.config.time_step_min = 1e-9  # loaders then clamp dt at 1e-9 only: no clamp in practice
    model.save_pretrained(str(out))
    llamacpp.ensure_tokenizer(out)
    (out / "bench_stamp.json").write_text(stamp)
    return out


# ---------------------------------------------------------------------------------------------- engines
# Each engine: run(prompt_ids [1, P], n_new) -> (prefill seconds, decode seconds, generated ids).

Timing = tuple[float, float, list[int]]


class Skip(Exception):
    """An engine that cannot run this config; the message is the reason printed in the table."""


class OursEngine:
    name = "ours"

    def __init__(self, ckpt: Path, compile: bool = False, precision: str | None = None,
                 layout: str | None = None, kernels: bool = True, dtype: torch.dtype = torch.float32) -> None:
        import elastic_local
        from elastic_local.engine.load import LAYOUT_ENV
        from elastic_local.model import gemv

        self.kernels = gemv.library() if kernels else None
        if layout is not None:
            os.environ[LAYOUT_ENV] = layout
        try:
            self.model = elastic_local.load(str(ckpt), device="cpu", dtype=dtype, compile=compile,
                                            precision=precision)
        finally:
            os.environ.pop(LAYOUT_ENV, None)
        self.note = ""
        if compile:  # the one-time cost: tracing and compiling the decode step (a short run, then timed ones)
            t0 = time.perf_counter()
            self.run(torch.tensor([[3, 4, 5, 6]]), 3)
            self.note = f"compiled in {time.perf_counter() - t0:.1f} s (cold)"

    def run(self, prompt_ids: torch.Tensor, n_new: int) -> Timing:
        from elastic_local.model import gemv

        kernels, gemv._library = gemv._library, self.kernels  # this engine's choice, for its own runs
        try:
            return self._run(prompt_ids, n_new)
        finally:
            gemv._library = kernels

    @torch.inference_mode()
    def _run(self, prompt_ids: torch.Tensor, n_new: int) -> Timing:
        t0 = time.perf_counter()
        cache = self.model.new_cache(batch_size=1)
        logits = self.model.forward(prompt_ids, cache=cache, last_only=True)  # [1, 1, V]
        tok = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        out = [int(tok)]
        t1 = time.perf_counter()
        for _ in range(n_new - 1):
            logits = self.model.forward(tok, cache=cache, last_only=True)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(tok))
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out


class OursGenerateEngine(OursEngine):
    """Our whole generation engine, the work of `m.generate` (phases, sampling, stop checks, detokenizing,
    events), against transformers' generate(): like for like. Timed from its Token events (the same loop
    `m.generate` collects, running greedy tokens ahead in C: `run(ahead=True)`), counting sampled tokens
    only: none is forced here (the prompt opens no thinking), and a forced one would be prefill, not
    decode. A run ahead's tokens share one clock reading; the prefill step makes the first token alone,
    so every later token was made between the first token's time and the last's."""

    name = "ours-generate"

    def _run(self, prompt_ids: torch.Tensor, n_new: int) -> Timing:
        from elastic_local.engine.events import Token
        from elastic_local.engine.generate import Generation
        from elastic_local.engine.phases import Request

        t0 = time.perf_counter()
        gen = Generation(self.model, [prompt_ids[0].tolist()], Request(max_answer_tokens=n_new, ignore_eos=True))
        toks = [e for e in gen.run(ahead=True) if isinstance(e, Token) and not e.forced]
        t_first, t_last = gen.t0 + toks[0].t, gen.t0 + toks[-1].t
        return t_first - t0, t_last - t_first, [e.id for e in toks]


class _Stamps:
    """A generate() streamer that only records when each put() happens (first put = the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class TransformersEngine:
    name = "transformers"

    def __init__(self, ckpt: Path) -> None:
        from transformers import NemotronHForCausalLM

        self.model = NemotronHForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        assert self.model.config.time_step_min < 1e-6

    @torch.inference_mode()
    def run(self, prompt_ids: torch.Tensor, n_new: int) -> Timing:
        stamps = _Stamps()
        t0 = time.perf_counter()
        seq = self.model.generate(
            prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False, use_cache=True,
            max_new_tokens=n_new, min_new_tokens=n_new, streamer=stamps, pad_token_id=0,
        )
        t_first, t_last = stamps.times[1], stamps.times[-1]
        return t_first - t0, t_last - t_first, seq[0, prompt_ids.shape[1]:].tolist()


class TransformersLoopEngine(TransformersEngine):
    """transformers' network in the same bare prefill + argmax loop as OursEngine."""

    name = "transformers-loop"

    @torch.inference_mode()
    def run(self, prompt_ids: torch.Tensor, n_new: int) -> Timing:
        t0 = time.perf_counter()
        out = self.model(prompt_ids, use_cache=True, logits_to_keep=1)
        cache, tok = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        toks = [int(tok)]
        t1 = time.perf_counter()
        for _ in range(n_new - 1):
            out = self.model(tok, cache=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            toks.append(int(tok))
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, toks


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, ckpt: Path, n_ctx: int, threads: int, quant: str | None = None) -> None:
        if reason := llamacpp.import_error():
            raise Skip(f"llama_cpp not importable ({reason})")
        if reason := llamacpp.unsupported_reason(json.loads((ckpt / "config.json").read_text())):
            raise Skip(reason)
        gguf = llamacpp.convert_to_gguf(ckpt, ckpt / "model-f32.gguf")
        if quant is not None:
            gguf = llamacpp.quantize_gguf(gguf, quant)
        self.runner = llamacpp.LlamaCppRunner(gguf, n_ctx=n_ctx, threads=threads)

    def run(self, prompt_ids: torch.Tensor, n_new: int) -> Timing:
        return self.runner.run(prompt_ids[0].tolist(), n_new)


ENGINES: dict[str, Callable[..., object]] = {
    "ours": lambda ckpt, n_ctx, threads: OursEngine(ckpt),
    "ours-torch": lambda ckpt, n_ctx, threads: OursEngine(ckpt, kernels=False),
    "ours-rows": lambda ckpt, n_ctx, threads: OursEngine(ckpt, layout="rows"),
    "ours-compiled": lambda ckpt, n_ctx, threads: OursEngine(ckpt, compile=True),
    "ours-generate": lambda ckpt, n_ctx, threads: OursGenerateEngine(ckpt),
    "ours-fp8": lambda ckpt, n_ctx, threads: OursEngine(ckpt, precision="fp8"),
    "ours-nvfp4": lambda ckpt, n_ctx, threads: OursEngine(ckpt, precision="nvfp4"),
    "ours-fp8-bf16": lambda ckpt, n_ctx, threads: OursEngine(ckpt, precision="fp8", dtype=torch.bfloat16),
    "ours-nvfp4-bf16": lambda ckpt, n_ctx, threads: OursEngine(ckpt, precision="nvfp4", dtype=torch.bfloat16),
    "transformers-loop": lambda ckpt, n_ctx, threads: TransformersLoopEngine(ckpt),
    "transformers": lambda ckpt, n_ctx, threads: TransformersEngine(ckpt),
    "llama.cpp": LlamaCppEngine,
    "llama.cpp-q8_0": lambda ckpt, n_ctx, threads: LlamaCppEngine(ckpt, n_ctx, threads, "q8_0"),
    "llama.cpp-q4_0": lambda ckpt, n_ctx, threads: LlamaCppEngine(ckpt, n_ctx, threads, "q4_0"),
}


# ---------------------------------------------------------------------------------------------- measure


@dataclass
class Result:
    config: str
    engine: str
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    match: float | None = None  # fraction of generated tokens equal to transformers'
    decode_spread: float | None = None  # (max - min) / median of the decode samples
    note: str = ""  # why it was skipped / failed
    prefill_samples: list[float] = field(default_factory=list)
    decode_samples: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list, repr=False)


def short_error(e: BaseException) -> str:
    if isinstance(e, Skip):
        return f"skipped: {e}"
    last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
    return f"failed: {type(e).__name__}: {last}"[:200]


class CopyProbe:
    """Memory-copy bandwidth in GB/s: torch copy_ of a `gib` GiB float32 buffer, best of `tries`.

    Counts bytes read + bytes written (the STREAM "Copy" convention). Sampled once per rep, between the
    engines' runs, so it sees the same machine state as they do.
    """

    def __init__(self, gib: float = 1.0, tries: int = 3) -> None:
        n = int(gib * 2**30) // 4
        self.src, self.dst, self.tries = torch.ones(n), torch.empty(n), tries
        self.dst.copy_(self.src)  # touch the pages

    def __call__(self) -> float:
        best = float("inf")
        for _ in range(self.tries):
            t0 = time.perf_counter()
            self.dst.copy_(self.src)
            best = min(best, time.perf_counter() - t0)
        return 2 * self.src.numel() * 4 / best / 1e9


def bench_config(name: str, args: argparse.Namespace) -> tuple[list[Result], ParamCount, list[float]]:
    """Results per engine, the parameter counts, and copy-bandwidth samples (100m only)."""
    ckpt = build_checkpoint(name, rebuild=args.rebuild)
    cfg = hf_config(name)
    gen = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(3, cfg.vocab_size, (1, args.prompt_len), generator=gen)  # skip pad/bos/eos
    n_ctx = args.prompt_len + args.new_tokens + 8

    results = {e: Result(name, e) for e in args.engines}
    engines = {}
    slowest = 0.0  # seconds of the slowest engine's warm-up run
    for e in args.engines:
        try:
            engines[e] = ENGINES[e](ckpt, n_ctx, args.threads)
            results[e].note = getattr(engines[e], "note", "")
            t0 = time.perf_counter()
            engines[e].run(prompt, args.new_tokens)  # warm-up, full length
            slowest = max(slowest, time.perf_counter() - t0)
        except Exception as err:  # noqa: BLE001 - report and keep benchmarking the others
            results[e].note = short_error(err)
            engines.pop(e, None)
            print(f"[{name}] {e}: {results[e].note}", file=sys.stderr)
            if args.verbose:
                traceback.print_exc()

    # at least --reps, and enough that the slowest engine runs about --min-seconds in all (short configs)
    reps = max(args.reps, min(50, math.ceil(args.min_seconds / max(slowest, 1e-3))))
    probe = CopyProbe() if name == "100m" else None
    copy_gb_s: list[float] = []
    for rep in range(reps):
        if probe is not None:
            copy_gb_s.append(probe())
        order = list(engines.items())  # interleaved, one run of each engine per rep, the first one rotating:
        order = order[rep % len(order):] + order[:rep % len(order)]  # none always follows the copy probe
        for e, engine in order:
            try:
                t_pre, t_dec, toks = engine.run(prompt, args.new_tokens)
            except Exception as err:  # noqa: BLE001
                results[e].note = short_error(err)
                engines.pop(e)
                print(f"[{name}] {e}: {results[e].note}", file=sys.stderr)
                continue
            results[e].prefill_samples.append(args.prompt_len / t_pre)
            results[e].decode_samples.append((args.new_tokens - 1) / t_dec)
            results[e].tokens = toks

    for e in engines:
        r = results[e]
        r.prefill_tok_s, r.decode_tok_s = median(r.prefill_samples), median(r.decode_samples)
        r.decode_spread = (max(r.decode_samples) - min(r.decode_samples)) / r.decode_tok_s
    ref = results.get("transformers")
    for r in results.values():
        if ref is not None and ref.tokens and r.tokens:
            r.match = sum(a == b for a, b in zip(r.tokens, ref.tokens, strict=False)) / len(ref.tokens)
    del engines, probe
    return list(results.values()), param_count(cfg), copy_gb_s


# ---------------------------------------------------------------------------------------------- report


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def ratio(a: Result | None, b: Result | None, attr: str) -> float | None:
    if a is None or b is None or getattr(a, attr) is None or getattr(b, attr) is None:
        return None
    return getattr(a, attr) / getattr(b, attr)


COMPARISONS = [  # (engine, engine, what the ratio compares)
    *((mine, other, what) for mine in ("ours", "ours-compiled") for other, what in (
        ("transformers-loop", "bare loop vs bare loop"),
        ("llama.cpp", "bare loop vs bare loop (Llama.eval + argmax)"),
        ("transformers", "bare loop vs generate(): not the same work"))),
    ("ours-generate", "transformers", "m.generate vs generate(), sampled tokens only: like for like"),
    ("ours", "ours-torch", "C decode step vs torch's layers, both on [in, out]"),
    ("ours-rows", "ours", "C decode step on [out, in] vs on [in, out]"),
    ("ours-fp8", "llama.cpp-q8_0", "8-bit weights, lm_head float32 in both"),
    ("ours-nvfp4", "llama.cpp-q4_0", "4-bit weights, lm_head float32 in both"),
    ("ours-fp8-bf16", "llama.cpp-q8_0", "8-bit weights; ours bf16 activations, Q8_0 8-bit ones; decode not "
     "like for like: our lm_head bf16, llama.cpp's f32"),
    ("ours-nvfp4-bf16", "llama.cpp-q4_0", "4-bit weights; ours bf16 activations, Q4_0 8-bit ones; decode not "
     "like for like: our lm_head bf16, llama.cpp's f32"),
    ("ours-fp8", "ours", "FP8 vs float32 weights"),
    ("ours-nvfp4", "ours", "NVFP4 vs float32 weights"),
]
QUANTIZED = ("ours-fp8", "ours-nvfp4", "ours-fp8-bf16", "ours-nvfp4-bf16", "llama.cpp-q8_0", "llama.cpp-q4_0")


def print_table(results: list[Result], counts: dict[str, ParamCount], args: argparse.Namespace) -> None:
    print(f"\nbatch 1, float32, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens (greedy), "
          f"{args.threads} threads, median of >= {args.reps} interleaved runs, "
          f"load average before the run {args.load_avg:.2f}")
    head = f"{'config':<7}{'params':>9}{'read/tok':>10}  {'engine':<18}{'prefill tok/s':>15}" \
           f"{'decode tok/s':>14}{'spread':>8}{'ms/tok':>8}{'match':>7}  note"
    print(head)
    print("-" * len(head))
    for r in results:
        c = counts[r.config]
        ms = None if r.decode_tok_s is None else 1000 / r.decode_tok_s
        print(f"{r.config:<7}{c.total / 1e6:>8.1f}M{c.decode / 1e6:>9.1f}M  {r.engine:<18}"
              f"{fmt(r.prefill_tok_s):>15}{fmt(r.decode_tok_s):>14}{fmt(r.decode_spread, '.0%'):>8}{fmt(ms, '.2f'):>8}"
              f"{fmt(r.match, '.2f'):>7}  {r.note}")
    print()
    for name in dict.fromkeys(r.config for r in results):
        by = {r.engine: r for r in results if r.config == name}
        for mine, other, what in COMPARISONS:
            if by.get(mine) and by.get(other) and by[mine].decode_tok_s and by[other].decode_tok_s:
                pre = ratio(by[mine], by[other], "prefill_tok_s")
                dec = ratio(by[mine], by[other], "decode_tok_s")
                print(f"{name:<7}{mine + ' / ' + other:<34} prefill x{fmt(pre, '.2f')}   decode x{fmt(dec, '.2f')}"
                      f"   ({what})")


def bandwidth_report(results: list[Result], count: ParamCount, copy_samples: list[float]) -> dict:
    bytes_per_tok = count.decode * 4  # float32 (the quantized engines read fewer: not listed)
    copy_gb_s = median(copy_samples)
    print(f"\n100m decode reads {bytes_per_tok / 1e6:.0f} MB of weights per token; memory copy bandwidth "
          f"{copy_gb_s:.1f} GB/s (read + write, 1 GiB, median over reps of best of 3; "
          f"range {min(copy_samples):.1f}-{max(copy_samples):.1f})")
    out = {"weight_bytes_per_token": bytes_per_tok, "copy_gb_s": copy_gb_s, "copy_gb_s_samples": copy_samples}
    for r in results:
        if r.config == "100m" and r.decode_tok_s is not None and r.engine not in QUANTIZED:
            gb_s = bytes_per_tok * r.decode_tok_s / 1e9
            print(f"  {r.engine:<18} {gb_s:6.2f} GB/s of weights = {gb_s / copy_gb_s:5.1%} of copy bandwidth")
            out[f"{r.engine}_weight_gb_s"] = gb_s
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="tiny,30m,100m", help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--engines", default="ours,transformers-loop,transformers,llama.cpp", help=f"from {list(ENGINES)}")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=5, help="minimum timed runs per engine")
    p.add_argument("--min-seconds", type=float, default=3.0,
                   help="add reps until the slowest engine has run about this long (short configs)")
    p.add_argument("--threads", type=int, default=llamacpp.n_threads())
    p.add_argument("--rebuild", action="store_true", help="rebuild the random checkpoints and GGUFs")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of engines that fail")
    args = p.parse_args()
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for c in args.configs:
        if c not in CONFIGS:
            p.error(f"unknown config {c!r}; choose from {list(CONFIGS)}")
    for e in args.engines:
        if e not in ENGINES:
            p.error(f"unknown engine {e!r}; choose from {list(ENGINES)}")
    assert args.new_tokens >= 2, "--new-tokens must be >= 2 (decode time is measured after the first)"
    torch.set_num_threads(args.threads)
    args.load_avg = os.getloadavg()[0]
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # the "no mamba_ssm kernels, using the torch fallback" notices

    results: list[Result] = []
    counts: dict[str, ParamCount] = {}
    copy_samples: list[float] = []
    for name in args.configs:
        print(f"[{name}] building / loading ...", file=sys.stderr)
        res, counts[name], copies = bench_config(name, args)
        results += res
        copy_samples += copies

    print_table(results, counts, args)
    summary: dict = {"args": {k: v for k, v in vars(args).items()}, "llama_cpp": llamacpp.installed_version()}
    if copy_samples:
        summary["bandwidth_100m"] = bandwidth_report(results, counts["100m"], copy_samples)
    summary["params"] = {k: asdict(v) for k, v in counts.items()}
    summary["results"] = [{k: v for k, v in asdict(r).items() if k != "tokens"} for r in results]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
