"""The `elastic-local` command: a thin layer over the library; every subcommand is a few lines.

Each command is a function whose docstring is its help text, ending with an example. Commands that run
a model take the same options (`add_model_options`) and load through one call (`load_from_args`).
Command modules elsewhere in the package expose `register(sub)` and are listed in `COMMAND_MODULES`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import ElasticModel
    from .progress import Progress

# What `elastic-local --help` tells a user (the docstring above is for who reads this file).
USAGE = """Run elastic reasoning models locally: one checkpoint holds several nested budgets (submodels), and
generation thinks on one and answers on another.

start here:
  elastic-local fit                                  what this machine runs (budget, precision, memory)
  elastic-local generate --prompt "What is 3 + 4?"   one answer from the embedded demo model
  elastic-chat                                       the terminal chat app
  elastic-local batch prompts.jsonl out.jsonl        a file of prompts, offline

`elastic-local COMMAND --help` says what each command does, with an example."""

# Modules with a `register(sub)` that adds their subcommands: one line per module.
COMMAND_MODULES: list[str] = [
    "elastic_local.batch.cli",
    "elastic_local.train.cli",
    "elastic_local.evaluate.cli",
]
DTYPES = ("float32", "bfloat16", "float16")
OVERWRITE_HELP = "replace OUT if it exists (it is replaced only once the new one is complete)"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def whole(lo: int = 0) -> Callable[[str], int]:
    """An argparse type: a whole number >= `lo` ("1e20", "-5" or "ten" are usage errors naming the option)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < lo:
            raise argparse.ArgumentTypeError(f"{n} must be >= {lo}")
        return n

    parse.__name__ = "whole number"
    return parse


def add_command(sub, name: str, func: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
    """A subcommand whose long help is `func`'s docstring (what it does, then an example); `func(args)`
    returns the exit status."""
    p = sub.add_parser(name, help=help, description=func.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=func)
    return p


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The options of every command that runs a model: where, in what dtype, which precision and budget."""
    g = parser.add_argument_group("model")
    g.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default auto: cuda when torch sees a GPU)")
    g.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="compute dtype (default auto: bfloat16 on a GPU or with a planned budget, else float32)")
    g.add_argument("--precision", choices=("auto", "bf16", "fp8", "nvfp4"),
                   help="weights: auto = the fit planner's pick; fp8/nvfp4 from a BF16 file quantize while "
                        "loading (default: auto on a GPU, else as stored)")
    g.add_argument("--activations", choices=("float", "nvfp4"), default="float",
                   help="nvfp4: NVFP4 weights round their inputs to NVFP4 too (W4A4, as Blackwell computes "
                        "them); on a CPU integer products, faster than the exact float ones (default: float)")
    g.add_argument("--budget", metavar="NAME",
                   help="resident budget, or auto = the largest the fit planner fits on this machine "
                        "(default: auto on a GPU, else the largest)")
    g.add_argument("--compile", action="store_true",
                   help="decode through torch.compile: seconds to a minute once per budget, then faster "
                        "where per-op overhead dominates. On x86 CPUs one sequence already decodes in C "
                        "(faster still), so it matters for batch files (several rows at a time); needs a "
                        "C++ compiler")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="on a GPU, replay each decode step from a CUDA graph (one per budget and "
                        "conversation): one launch per token instead of hundreds (default: on a GPU, "
                        "unless --compile)")


def resolve_device(device: str) -> str:
    """--device as torch names it: auto is cuda when torch sees a GPU; cuda without one is an error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch {torch.__version__} sees no CUDA GPU "
                         f"({'a CPU-only build' if torch.version.cuda is None else 'no device visible'}); "
                         "use --device cpu")
    return device


def add_offline_device(parser: argparse.ArgumentParser, what: str, holds: str = "the parent in float32") -> None:
    parser.add_argument("--device", default="auto",
                        help=f"where {what}: cpu, cuda or cuda:N (default auto: the GPU when {holds} fits "
                             "it, else the CPU)")


def offline_device(device: str, src: str, bytes_per_param: int = 4, holds: str = "the parent in float32") -> str:
    """--device of the offline tools (`nest`, `quantize`, `train`), which hold whole models in float32: auto
    takes the GPU only when `holds` (`bytes_per_param` per parameter of SRC) fits its free memory with a
    fifth to spare for activations, else the CPU, saying why."""
    import torch

    from .checkpoint.files import checkpoint_tensors

    if device != "auto" or not torch.cuda.is_available():
        return resolve_device(device)
    need = bytes_per_param * sum(math.prod(t.shape) for t in checkpoint_tensors(Path(src)).values())
    free = torch.cuda.mem_get_info()[0]
    if need * 1.2 <= free:
        return "cuda"
    print(f"--device auto: {holds} takes {need / 2**30:.1f} GiB, the GPU has {free / 2**30:.1f} GiB free; "
          "running on the CPU (--device cuda to try anyway)", file=sys.stderr)
    return "cpu"


def load_from_args(args: argparse.Namespace, path: str | None = None,
                   progress: Progress | None = None) -> ElasticModel:
    """Load the checkpoint `path` (default: `args.dir`) with the options `add_model_options` added."""
    import torch

    from .engine import load

    device = resolve_device(args.device)
    gpu = torch.device(device).type == "cuda"
    return load(args.dir if path is None else path, budget=args.budget or ("auto" if gpu else None),
                precision=args.precision or ("auto" if gpu else None), device=device,
                dtype=None if args.dtype == "auto" else getattr(torch, args.dtype), progress=progress,
                compile=args.compile, cuda_graphs=args.cuda_graphs, activations=args.activations)


def cmd_info(args: argparse.Namespace) -> int:
    """What a checkpoint directory holds, from its config and safetensors headers (no weights are read):
    layers, parameters, bytes on disk, every budget's sizes and bytes at each precision, and which
    kernels would run here.

    elastic-local info             (the embedded demo model)
    elastic-local info ./ckpt
    elastic-local info ./ckpt --json"""
    from .elastic.inspect import describe
    from .paths import default_model

    d = describe(args.dir if args.dir is not None else default_model())
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"{d['path']}: Nemotron-H, {len(d['pattern'])} layers "
          + ", ".join(f"{n} {kind}" for kind, n in d["layers"].items()))
    print(f"  pattern   {d['pattern']}")
    c = d["config"]
    print(f"  hidden    {c['hidden_size']}, vocab {c['vocab_size']}")
    print(f"  params    {_count(d['params'])} total, {_count(d['active_params'])} active per token")
    w = d["weights"]
    if w is None:
        print(f"  weights   none ({d['weights_note']})")
    else:
        dtypes = ", ".join(f"{k} {_gib(v)}" for k, v in w["tensor_bytes_by_dtype"].items())
        print(f"  on disk   {_gib(w['bytes_on_disk'])} in {w['files']} file(s) ({dtypes})")
    stored = d["precision"].upper() if d["precision"] != "bf16" else (w or {}).get("stored_dtype") or "BF16"
    loads = ", ".join(f"{p} ({src})" for p, src in d["offers"].items())
    print(f"  precision {stored}{' (unquantized)' if d['precision'] == 'bf16' else ''}; loads as {loads}")
    print("  budgets   name       params    active      bf16       fp8     nvfp4  sizes (resident bytes as fit plans)")
    for b in d["budgets"]:
        sizes = " ".join(f"{k}={v if not isinstance(v, list) else 'per-layer'}" for k, v in b["sizes"].items())
        by = " ".join(f"{'-' if n is None else _gib(n):>9}" for n in b["bytes"].values())
        print(f"            {b['name']:<8} {_count(b['params']):>8} {_count(b['active_params']):>9} {by}  {sizes}")
    k = d["kernels"]
    print(f"  kernels   on {k['device']}: scan {k['mamba_scan']}, conv {k['mamba_conv']}, linear {k['linear']}")
    print(f"            decode step: {k['decode_step']}")
    if "weights" in k:
        print(f"            weights (the largest budget, as stored) in {k['weights']}")
    if "note" in k:
        print(f"            {k['note']}")
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    """What fits: every (budget, precision) of DIR on a machine, with its memory breakdown, and the pick.

    elastic-local fit --profile rtx5080 --context 32768
    elastic-local fit ./ckpt --json"""
    from .hardware import fit, get_profile, render_plan

    if args.margin_gib is not None and not 0 <= args.margin_gib < 2**20:
        raise ValueError(f"--margin-gib {args.margin_gib}: expected a size in GiB >= 0")
    margin = None if args.margin_gib is None else int(args.margin_gib * 2**30)
    profile = get_profile(args.profile)
    p = fit.plan_checkpoint(args.dir, profile, context=args.context, caches=args.caches, margin_bytes=margin)
    if args.json:
        print(json.dumps(fit.fit_report(args.dir, p), indent=2))
    else:
        print(f"{fit.summary(p)}\n\n{render_plan(p)}")
        steps = fit.next_steps(args.dir, p)
        if steps:
            print("\nnext:\n" + "\n".join(f"  {line}" for line in steps))
    if args.profile == "auto" and profile.kind == "cpu":
        _build_cpu_kernels()
    return 0


def _build_cpu_kernels() -> None:
    """Build the CPU decode kernels if this install has not yet (model/gemv.py): `fit` is the README's first
    command, so the first chat after an install starts without the build's seconds (bench_cold_start.py).
    Said on stderr, which leaves `--json`'s output whole."""
    from .model import gemv

    if gemv.prebuild() is None:  # built before, or not for this CPU
        return
    print("\nbuilding the CPU decode kernels (once per install; the first chat then starts without it)",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    if gemv.library() is not None:  # waits; a failed build warns why (decode then runs on torch's matmul)
        print(f"built in {time.perf_counter() - start:.1f} s", file=sys.stderr)


def cmd_profiles(args: argparse.Namespace) -> int:
    """The hardware profiles `fit --profile` accepts: shipped ones, then the user's own .toml files.

    elastic-local profiles"""
    from .hardware.profiles import list_profiles, render_profiles

    profiles = list_profiles()
    if args.json:
        print(json.dumps({n: p.to_dict() for n, p in profiles.items()}, indent=2))
        return 0
    print(render_profiles(profiles) + "\n(auto = this machine, probed when used)")
    return 0


def cmd_paths(args: argparse.Namespace) -> int:
    """Where config, data (chat history) and user hardware profiles live.

    elastic-local paths"""
    from . import paths
    from .hardware.profiles import user_profile_dir

    where = {"config": paths.config_dir(), "data": paths.data_dir(), "profiles": user_profile_dir()}
    print("\n".join(f"{k:<9}{v}" for k, v in where.items()) + f"\n(set {paths.HOME_ENV} to move them all)")
    return 0


def _generation_options(args: argparse.Namespace) -> dict:
    return dict(think_budget=args.think_budget, answer_budget=args.answer_budget,
                max_think_tokens=args.max_think_tokens, max_answer_tokens=args.max_tokens,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                stop=tuple(args.stop), transplant=args.transplant,
                **({} if args.think_close is None else {"think_close": args.think_close}))


def _prompt_text(args: argparse.Namespace) -> str:
    """The user message: --prompt, --file (`-` = stdin), or stdin when it is piped and neither is given."""
    if args.prompt is not None and args.file is not None:
        raise ValueError("give the prompt once: --prompt TEXT or --file FILE, not both")
    if args.prompt is not None:
        text = args.prompt
    elif args.file is not None and args.file != "-":
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"--file {args.file}: no such file") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"--file {args.file}: not UTF-8 text (byte {e.start})") from None
    elif args.file == "-" or not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        raise ValueError('no prompt: pass --prompt "TEXT", --file FILE, or pipe it on stdin')
    if not text.strip():
        raise ValueError("the prompt is empty")
    return text.rstrip("\n")


def cmd_generate(args: argparse.Namespace) -> int:
    """Answer one prompt, streaming the thinking (stderr, dimmed) and the answer (stdout), then a stats line.
    With no DIR the embedded demo model answers; the prompt comes from --prompt, --file or stdin.

    elastic-local generate --prompt "What is 237 + 682?"
    echo "Put 5, 2, 9, 1 in order." | elastic-local generate
    elastic-local generate ./ckpt --file question.txt --think-budget half --max-think-tokens 256
    elastic-local generate ./ckpt --prompt "2+2?" --device cuda --precision fp8 --budget auto
    """
    from .engine.events import Token

    text = _prompt_text(args)  # before loading: a missing prompt costs nothing
    m = load_from_args(args, progress=_Bar("load") if sys.stderr.isatty() else None)
    prompt = m.chat_prompt(text, think=not args.no_think, system=args.system)
    stream = m.stream(prompt, **_generation_options(args))
    dim, undim = ("\x1b[2m", "\x1b[0m") if sys.stderr.isatty() else ("", "")
    phase = None
    try:
        for ev in stream:
            if isinstance(ev, Token) and ev.text and not args.json:
                if phase == "think" and ev.phase == "answer":
                    sys.stderr.write("\n")
                phase = ev.phase
                out = sys.stderr if ev.phase == "think" else sys.stdout
                out.write(f"{dim}{ev.text}{undim}" if ev.phase == "think" else ev.text)
                out.flush()
    except KeyboardInterrupt:
        stream.cancel()
    r = stream.result
    if args.json:
        print(json.dumps(r.to_dict()))
        return 0
    print()
    print(f"[{r.finish_reason} in {r.finish_phase}, thinking ended by {r.think_end or '-'}] {r.stats.line()}",
          file=sys.stderr)
    return 0


class _Bar:
    """A one-line progress bar on stderr for long work (loading, scoring, writing)."""

    def __init__(self, label: str):
        self.label, self.start, self.last = label, time.monotonic(), 0.0

    def __call__(self, done: int, total: int, what: str) -> None:
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        frac = done / max(total, 1)
        eta = (now - self.start) / frac * (1 - frac) if frac > 0 else 0.0
        bar = "#" * int(24 * frac)
        print(f"\r{self.label} [{bar:<24}] {done}/{total} {what[:40]:<40} eta {eta:4.0f}s", end="", file=sys.stderr)
        if done >= total:
            print(file=sys.stderr)


def _budgets(values: list[str]) -> dict[str, float]:
    out = {}
    for v in values:
        name, sep, frac = v.partition("=")
        if name in out:
            raise ValueError(f"--budget {name} is given twice ({name}={out[name]:g} and {v}); give each budget once")
        try:
            out[name] = float(frac)
        except ValueError:
            raise ValueError(f"--budget {v!r}: expected NAME=FRACTION, e.g. 23B=0.77") from None
        if not sep or not name:
            raise ValueError(f"--budget {v!r}: expected NAME=FRACTION, e.g. 23B=0.77")
    return out


def cmd_nest(args: argparse.Namespace) -> int:
    """Turn a Nemotron-H checkpoint into a nested elastic one: score every axis on calibration tokens,
    permute into importance order (the full budget is the input model), size each budget for its
    parameter fraction, write the permuted weights with the budget table.

    elastic-local nest ./parent ./nested --budget 23B=0.77 --budget 12B=0.4 --calib calib.txt"""
    from .elastic.nest import nest

    axes = tuple(args.axes.split(",")) if args.axes else None
    out = nest(args.src, args.out, _budgets(args.budget), calib=args.calib, axes=axes,
               heterogeneous=args.heterogeneous, full_name=args.full_name,
               device=offline_device(args.device, args.src), progress=_Bar("nest"), overwrite=args.overwrite)
    print(f"wrote {out}")
    return cmd_info(argparse.Namespace(dir=out, json=False))


def cmd_slice(args: argparse.Namespace) -> int:
    """Extract one budget of a nested checkpoint as a standalone Nemotron-H checkpoint (zero-shot
    slicing); smaller budgets nested in it stay in its budget table.

    elastic-local slice ./nested ./12b --budget 12B"""
    from .elastic.slice import slice_budget

    out, portable = slice_budget(args.dir, args.out, args.budget, progress=_Bar("slice"), overwrite=args.overwrite)
    print(f"wrote {out}: budget {args.budget!r} as a standalone checkpoint")
    if not portable:
        print("  its sizes differ from layer to layer (block_configs): elastic-local loads it; transformers, "
              "vLLM and llama.cpp cannot")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    """Quantize a nested BF16 checkpoint to FP8 or NVFP4 in NVIDIA Model Optimizer's layout; every budget
    stays a prefix of the quantized weights. Activation scales come from one calibration pass.

    elastic-local quantize ./nested ./nested-nvfp4 --precision nvfp4 --calib calib.txt --preset nano"""
    from .ptq import quantize_checkpoint

    out = quantize_checkpoint(args.dir, args.out, args.precision, calib=args.calib, keep=tuple(args.keep),
                              preset=args.preset, device=offline_device(args.device, args.dir),
                              progress=_Bar("quantize"), overwrite=args.overwrite)
    print(f"wrote {out}")
    return cmd_info(argparse.Namespace(dir=out, json=False))


def build_parser() -> argparse.ArgumentParser:
    """Every command: the ones below, then those of `COMMAND_MODULES`."""
    parser = argparse.ArgumentParser(prog="elastic-local", description=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = add_command(sub, "info", cmd_info, "describe a checkpoint directory")
    p.add_argument("dir", nargs="?", default=None, help="checkpoint directory (default: the embedded demo model)")
    p.add_argument("--json", action="store_true", help="one JSON object")

    p = add_command(sub, "nest", cmd_nest, "turn a Nemotron-H checkpoint into a nested elastic one")
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--budget", action="append", required=True, metavar="NAME=FRACTION",
                   help="a nested budget at this fraction of the parent's parameters (repeatable)")
    p.add_argument("--calib", help="calibration text (tokenized with the checkpoint's tokenizer) or .json token ids")
    p.add_argument("--axes", help="axes to shrink, from: hidden, mamba_heads, attention_heads, experts, "
                                  "expert_channels, shared_channels, mlp_channels, depth (default: all but "
                                  "attention_heads and depth; experts only with n_group 1)")
    p.add_argument("--heterogeneous", action="store_true", help="allow per-layer sizes")
    p.add_argument("--full-name", default="full", help="name of the full model's budget")
    add_offline_device(p, "the model is scored")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    p = add_command(sub, "slice", cmd_slice, "extract one budget as a standalone checkpoint")
    p.add_argument("dir")
    p.add_argument("out")
    p.add_argument("--budget", required=True, help="the budget to extract")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    p = add_command(sub, "quantize", cmd_quantize,
                    "quantize a nested BF16 checkpoint to FP8 or NVFP4 (Model Optimizer layout)")
    p.add_argument("dir")
    p.add_argument("out")
    p.add_argument("--precision", required=True, choices=["fp8", "nvfp4"])
    p.add_argument("--calib", help="calibration text or .json token ids for the activation scales")
    p.add_argument("--keep", action="append", default=[], metavar="PATTERN",
                   help="module name pattern to leave in BF16, e.g. 'backbone.layers.5.mixer.*' (repeatable)")
    p.add_argument("--preset", choices=["nano"], help="nano: attention layers and the Mamba layers feeding them "
                                                     "stay BF16 (NVIDIA's conservative recipe)")
    add_offline_device(p, "calibration runs")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    p = add_command(sub, "generate", cmd_generate, "answer one prompt, streaming thinking and answer")
    p.add_argument("dir", nargs="?", default=None, help="checkpoint directory (default: the embedded demo model)")
    add_model_options(p)
    p.add_argument("--prompt", help="the user message (rendered with the chat template)")
    p.add_argument("--file", metavar="FILE", help="read the user message from FILE (- = stdin); with neither "
                                                  "option a piped stdin is read")
    p.add_argument("--system", help="a system message")
    p.add_argument("--no-think", action="store_true", help="open the answer at once (thinking off)")
    p.add_argument("--think-budget", metavar="NAME", help="budget of the thinking phase (default: largest)")
    p.add_argument("--answer-budget", metavar="NAME", help="budget of the answer phase (default: largest)")
    p.add_argument("--max-think-tokens", type=whole(0), default=1024, metavar="N",
                   help="think token budget: then the engine closes thinking (default 1024)")
    p.add_argument("--max-tokens", type=whole(0), default=1024, metavar="N",
                   help="answer token limit (default 1024; the model's context also ends a reply)")
    p.add_argument("--think-close", metavar="TEXT",
                   help="text appended before </think> when the think budget runs out ('' for none; "
                        "default: the checkpoint's generation_config.json think_close, else NVIDIA's sentence)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=whole(0), default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--transplant", action="store_true",
                   help="a budget taking over reuses the other's states instead of catching up (approximate)")
    p.add_argument("--json", action="store_true", help="no streaming; print the result as one JSON object")

    from .paths import STAR_ELASTIC

    p = add_command(sub, "fit", cmd_fit, "which budget and precision fit this machine (or a profile)")
    p.add_argument("dir", nargs="?", default=str(STAR_ELASTIC),
                   help="checkpoint directory, weights optional (default: the Star Elastic description)")
    p.add_argument("--profile", default="auto", help="hardware profile name or .toml file; auto = this machine")
    p.add_argument("--context", type=whole(1), default=32768, help="tokens each cache holds (default 32768)")
    p.add_argument("--caches", type=whole(1), default=2, help="hybrid caches kept (chat: think + answer = 2)")
    p.add_argument("--margin-gib", type=float, help="safety margin (default: max(1 GiB, 5%% of memory))")
    p.add_argument("--json", action="store_true", help="one JSON object, sizes in bytes")

    p = add_command(sub, "profiles", cmd_profiles, "list the hardware profiles")
    p.add_argument("--json", action="store_true", help="one JSON object")

    add_command(sub, "paths", cmd_paths, "print where config, data and user profiles live")

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    for p in sub.choices.values():  # accepted after the command too; SUPPRESS keeps the top-level value
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; errors are reported by `errors.report` (one line; a bug's traceback to a file)."""
    from .errors import report

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (Exception, KeyboardInterrupt) as e:
        return report(parser.prog, e, debug=getattr(args, "debug", False))


if __name__ == "__main__":
    sys.exit(main())
