"""Nested checkpoints: file size, slicing throughput and load memory of one file that holds every budget.

    .venv/bin/python benchmarks/bench_nesting.py [--reps 5] [--fsync] [--skip throughput,rss]

A ~107M-parameter random Nemotron-H parent (bench_decode.py's `100m` preset: hidden 768, vocab 32000,
`MEMEM*EMEM*E`, 32 experts) is built with transformers, stored as a BF16 release stores it (bf16; router,
A_log, D, dt_bias fp32) and nested by `elastic_local.elastic.nest.nest` into budgets full / p77 / p40 (77%
and 40% of the parameters, mirroring Star Elastic's 30B / 23B / 12B). Everything is cached under
benchmarks/_work/nesting/ (rebuilt when the preset changes, or with --rebuild). Then:

  a. size   the nested file against the sum of the checkpoints `slice_budget` extracts for every budget
            (full included), next to the same arithmetic for Star Elastic's 58.9 GB vs 126.1 GB (SPEC §2).
  b. slice  `slice_budget(nested, out, budget)` for each budget against `shutil.copyfile` of a file of the
            same size as the budget's output weights; MB/s of output weights written; interleaved reps,
            medians. The slice runs with --threads torch threads and with 1 (its .contiguous() copies of cut
            tensors are torch ops). Twice: "warm" (the source file in the page cache) and "cold" (evicted
            before every run with fsync + posix_fadvise(DONTNEED), checked with mincore; bytes read from
            storage from /proc/self/io). Outputs go to the page cache (no fsync) unless --fsync, which fsyncs
            every output file inside the timed region, for both.
  c. rss    memory of `elastic_local.load(nested, budget=b, dtype=...)` followed by one forward pass, in a
            fresh process per (budget, dtype), above a process that only imports torch and elastic_local:
            peak RSS after loading and after the forward (the loader keeps zero-copy views of the
            memory-mapped file, paged in when first used), RssAnon, and the checkpoint's mapped resident
            pages (/proc/self/smaps); the ratio of the smallest budget to the full one, next to the ratio of
            the weight bytes the network holds. Peaks are VmHWM from /proc/self/status: ru_maxrss survives
            execve on Linux, so a child started from this benchmark process would report the parent's RSS
            at fork time whenever that is the larger.

The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from statistics import median

import torch

import elastic_local

WORK = Path(__file__).resolve().parent / "_work" / "nesting"
SEED = 0
BUDGETS = {"p77": 0.77, "p40": 0.40}  # Star Elastic: 23B / 30B = 0.77, 12B / 30B = 0.40
STAR_ELASTIC_GB = {"nested": 58.9, "separate": 126.1}  # one BF16 file for 30B+23B+12B vs three files (SPEC §2)

# bench_decode.py's `100m` preset: every cut axis (hidden, expert and shared channels) is a multiple of 64
CONFIG = dict(
    vocab_size=32000, hidden_size=768, hybrid_override_pattern="MEMEM*EMEM*E",
    mamba_num_heads=24, mamba_head_dim=64, n_groups=4, ssm_state_size=64, chunk_size=128,
    num_attention_heads=12, num_key_value_heads=2, head_dim=64, intermediate_size=2048,
    n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=128, moe_shared_expert_intermediate_size=512,
    conv_kernel=4, expand=2, use_conv_bias=True, mamba_hidden_act="silu", layer_norm_epsilon=1e-5,
    mlp_hidden_act="relu2", n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    n_group=1, topk_group=1, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
FP32_TENSORS = re.compile(r"(gate\.weight|e_score_correction_bias|A_log|\.D|dt_bias)$")  # kept fp32 in a release


# ---------------------------------------------------------------------------------------------- checkpoints


def build_parent(out: Path, config: dict = CONFIG) -> Path:
    """A random Nemotron-H in the hub layout, saved by transformers in BF16 (router, A_log, D, dt_bias fp32)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    model = NemotronHForCausalLM(NemotronHConfig(**config))  # default init keeps activations sane
    model.config.time_step_min = 1e-9  # transformers clamps dt at time_step_min, the shipped model does not
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not FP32_TENSORS.search(name):
            t.data = t.data.to(torch.bfloat16)
    model.save_pretrained(str(out))
    return out


def build_nested(work: Path = WORK, config: dict = CONFIG, budgets: dict = BUDGETS, rebuild: bool = False) -> Path:
    """work/nested/: the parent nested into `budgets` (importance scored on 4096 random token ids)."""
    from elastic_local.elastic.nest import nest

    nested, stamp = work / "nested", json.dumps({"config": config, "budgets": budgets}, sort_keys=True)
    if not rebuild and (work / "stamp.json").is_file() and (work / "stamp.json").read_text() == stamp \
            and (nested / "config.json").is_file():
        return nested
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"building {work} ...", file=sys.stderr)
    parent = build_parent(work / "parent", config)
    nest(parent, nested, budgets, max_tokens=4096)
    shutil.rmtree(parent)  # the nested file's full budget is the parent, permuted
    (work / "stamp.json").write_text(stamp)
    return nested


def weight_files(d: Path) -> list[Path]:
    return sorted(d.glob("model*.safetensors"))


def dir_bytes(d: Path) -> tuple[int, int]:
    """(bytes of the weight files, bytes of every file) of a checkpoint directory."""
    weights = sum(f.stat().st_size for f in weight_files(d))
    return weights, sum(f.stat().st_size for f in d.iterdir() if f.is_file())


# ---------------------------------------------------------------------------------------------- page cache

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def cached_fraction(paths: list[Path]) -> float:
    """Fraction of the files' pages in the page cache (mincore on a fresh mapping; touches nothing)."""
    page, resident, total = mmap.PAGESIZE, 0, 0
    for p in paths:
        size = p.stat().st_size
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            _libc.munmap(addr, size)
        finally:
            os.close(fd)
        resident += sum(v & 1 for v in vec)
        total += n
    return resident / max(total, 1)


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (written back first); needs no privileges."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_bytes() -> int:
    """Bytes this process has caused to be fetched from storage (/proc/self/io read_bytes)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def fsync_all(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


# ---------------------------------------------------------------------------------------------- a. size


def sizes(nested: Path, budgets: list[str]) -> dict:
    """Extract every budget once; bytes of the nested file and of each extracted checkpoint."""
    from elastic_local.elastic.slice import slice_budget

    out = {"nested": dir_bytes(nested), "slices": {}, "portable": {}}
    for b in budgets:
        path, portable = slice_budget(nested, WORK / "slices" / b, b, overwrite=True)
        out["slices"][b] = dir_bytes(path)
        out["portable"][b] = portable
    return out


def print_sizes(s: dict, params: dict[str, int]) -> dict:
    nested_w, nested_all = s["nested"]
    sep_w = sum(w for w, _ in s["slices"].values())
    sep_all = sum(a for _, a in s["slices"].values())
    print("\na. nested file vs one extracted checkpoint per budget (weights = model*.safetensors; "
          "all = + config, tokenizer, importance scores)")
    print(f"{'checkpoint':<22}{'params':>10}{'weights MB':>12}{'all files MB':>14}  plain Nemotron-H config")
    for b, (w, a) in s["slices"].items():
        print(f"{'slice ' + b:<22}{params[b] / 1e6:>9.1f}M{w / 1e6:>12.1f}{a / 1e6:>14.1f}  {s['portable'][b]}")
    print(f"{'sum of slices':<22}{sum(params.values()) / 1e6:>9.1f}M{sep_w / 1e6:>12.1f}{sep_all / 1e6:>14.1f}")
    print(f"{'nested (one file)':<22}{params[next(iter(params))] / 1e6:>9.1f}M{nested_w / 1e6:>12.1f}"
          f"{nested_all / 1e6:>14.1f}")
    ours, star = nested_w / sep_w, STAR_ELASTIC_GB["nested"] / STAR_ELASTIC_GB["separate"]
    print(f"ours:         nested / separate = {nested_w / 1e6:.1f} / {sep_w / 1e6:.1f} MB = {ours:.3f} "
          f"({1 - ours:.0%} saved; separate is {1 / ours:.2f}x; parameter ratio "
          f"{max(params.values()) / sum(params.values()):.3f})")
    print(f"Star Elastic: nested / separate = {STAR_ELASTIC_GB['nested']} / {STAR_ELASTIC_GB['separate']} GB "
          f"= {star:.3f} ({1 - star:.0%} saved; separate is {1 / star:.2f}x)")
    return {"nested_weight_bytes": nested_w, "nested_all_bytes": nested_all, "separate_weight_bytes": sep_w,
            "separate_all_bytes": sep_all, "ratio": ours, "star_elastic_ratio": star,
            "slices": {b: {"weight_bytes": w, "all_bytes": a, "portable": s["portable"][b]}
                       for b, (w, a) in s["slices"].items()}}


# ---------------------------------------------------------------------------------------------- b. slicing


def timed_slice(nested: Path, budget: str, out: Path, fsync: bool, threads: int) -> float:
    from elastic_local.elastic.slice import slice_budget

    shutil.rmtree(out, ignore_errors=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the writer's .contiguous() copies of cut tensors run on torch threads
    t0 = time.perf_counter()
    slice_budget(nested, out, budget)
    if fsync:
        fsync_all(weight_files(out))
    dt = time.perf_counter() - t0
    torch.set_num_threads(before)
    return dt


def timed_copy(src: Path, dst: Path, fsync: bool) -> float:
    dst.unlink(missing_ok=True)
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    if fsync:
        fsync_all([dst])
    return time.perf_counter() - t0


def throughput(nested: Path, out_bytes: dict[str, int], reps: int, fsync: bool, threads: int) -> dict:
    """Per mode (warm / cold), budget and operation: MB/s samples, source pages cached, bytes read from disk.
    Operations: slice_budget with `threads` torch threads, with 1, and a copy of a same-size file."""
    sources = weight_files(nested)
    copy_src = {}
    for b, n in out_bytes.items():  # a file of exactly the budget's output size (the nested file's first bytes)
        copy_src[b] = WORK / "copy" / f"{b}.src"
        if not copy_src[b].is_file() or copy_src[b].stat().st_size != n:
            copy_src[b].parent.mkdir(parents=True, exist_ok=True)
            with open(sources[0], "rb") as f, open(copy_src[b], "wb") as g:
                g.write(f.read(n))
    tmp = WORK / "tmp"
    tmp.mkdir(exist_ok=True)
    ops = {b: {f"slice {n}t": (sources, partial(timed_slice, nested, b, tmp / "slice", fsync, n))
               for n in dict.fromkeys((threads, 1))} for b in out_bytes}
    for b in out_bytes:
        ops[b]["copy"] = ([copy_src[b]], partial(timed_copy, copy_src[b], tmp / "copy", fsync))
    res: dict = {}
    for mode in ("warm", "cold"):
        for per in ops.values():  # warm-up (and, for "warm", bring the sources into the page cache)
            for _, run in per.values():
                run()
        for _ in range(reps):
            for b, per in ops.items():  # interleaved: every budget's operations, every rep
                for what, (src, run) in per.items():
                    if mode == "cold":
                        evict(src)
                    r = res.setdefault(mode, {}).setdefault(b, {}).setdefault(
                        what, {"mb_s": [], "cached": [], "disk_read": []})
                    r["cached"].append(cached_fraction(src))
                    before = disk_read_bytes()
                    r["mb_s"].append(out_bytes[b] / run() / 1e6)
                    r["disk_read"].append(disk_read_bytes() - before)
    shutil.rmtree(tmp, ignore_errors=True)
    return res


def print_throughput(res: dict, out_bytes: dict[str, int], reps: int, fsync: bool) -> dict:
    print(f"\nb. slice_budget vs shutil.copyfile of the same number of bytes: MB/s of output weights, median of "
          f"{reps} interleaved reps; outputs {'fsynced' if fsync else 'left in the page cache (no fsync)'}")
    print(f"{'mode':<6}{'budget':<8}{'out MB':>8}  {'operation':<10}{'src cached':>11}{'disk read MB':>14}"
          f"{'MB/s':>8}{'spread':>8}{'/ copy':>8}")
    summary: dict = {}
    for mode, per_budget in res.items():
        for b, per_op in per_budget.items():
            copy = median(per_op["copy"]["mb_s"])
            for what, r in per_op.items():
                m = median(r["mb_s"])
                spread = (max(r["mb_s"]) - min(r["mb_s"])) / m
                print(f"{mode:<6}{b:<8}{out_bytes[b] / 1e6:>8.1f}  {what:<10}{median(r['cached']):>11.0%}"
                      f"{median(r['disk_read']) / 1e6:>14.1f}{m:>8.0f}{spread:>8.0%}{m / copy:>8.2f}")
                summary.setdefault(mode, {}).setdefault(b, {})[what] = {"mb_s": m, "ratio_to_copy": m / copy, **r}
    print("src cached: fraction of the source file's pages in the page cache just before the timed run (mincore); "
          "disk read: bytes fetched from storage during the run (/proc/self/io read_bytes); spread: (max - min) / "
          "median")
    return summary


# ---------------------------------------------------------------------------------------------- c. peak RSS


def tensors_of(obj, seen: set | None = None):
    """Every distinct tensor reachable from a loaded network (dataclasses, lists, quantized weights)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = (obj.data_ptr(), obj.nbytes, obj.stride())
        if key not in seen and obj.nbytes:
            seen.add(key)
            yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_of(x, seen)
    elif hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            if not k.startswith("_") and k != "cfg":
                yield from tensors_of(v, seen)


def file_ranges(under: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of files under the directory `under` (/proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if len(head) == 6 and head[5].startswith(under):
            lo, hi = head[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def weight_bytes(net, ckpt: str) -> tuple[int, int]:
    """(bytes of the tensors the network holds, bytes the ones that are views of the mapped checkpoint span).
    A strided view (a column prefix of a row-major weight) spans whole rows of the file: every page it
    touches must be resident when it is used."""
    ranges = file_ranges(str(Path(ckpt).resolve()))
    held = span = 0
    for t in tensors_of(net):
        held += t.nbytes
        if any(lo <= t.data_ptr() < hi for lo, hi in ranges):
            span += (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
    return held, span


def proc_status(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status (VmHWM, RssAnon, ...) in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[k] = int(v.split()[0]) * 1024
    return out


def mapped_rss(under: str) -> int:
    """Resident bytes of this process's mappings of files under the directory `under` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head[0]):  # a mapping's first line: range perms offset dev inode path
            inside = len(head) == 6 and head[5].startswith(under)
        elif inside and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


def memory_now(ckpt: str | None) -> dict[str, int]:
    """VmHWM (peak so far), RssAnon and the checkpoint's resident mapped pages, in bytes."""
    out = proc_status("VmHWM", "RssAnon")
    out["mapped"] = mapped_rss(str(Path(ckpt).resolve())) if ckpt else 0
    return out


def rss_child(spec: dict) -> dict:
    """Run in a fresh process: load (or, for the baseline, only import), then run one forward pass over
    `forward` random tokens so that weights that are zero-copy views of the file get paged in, and report
    the memory after each step. VmHWM rather than ru_maxrss: Linux keeps ru_maxrss across execve, so a
    child started from this (big) benchmark process reports the parent's RSS at fork time if larger."""
    ckpt = spec.get("dir")
    if not ckpt:
        return {**spec, "load": memory_now(None), "run": memory_now(None)}
    kw = {k: spec[k] for k in ("budget", "precision") if spec.get(k)}
    t0 = time.perf_counter()
    model = elastic_local.load(ckpt, dtype=getattr(torch, spec["dtype"]), **kw)
    spec["load_s"] = time.perf_counter() - t0
    spec["load"] = memory_now(ckpt)
    spec["weights"], spec["weights_in_file_span"] = weight_bytes(model.net, ckpt)
    n = spec.get("forward", 64)
    ids = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(SEED))
    with torch.inference_mode():
        model.forward(ids, model.new_cache(1), last_only=True)
    spec["run"] = memory_now(ckpt)
    spec["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux; see above
    return spec


def run_child(script: Path, spec: dict) -> dict:
    """`spec` through a fresh interpreter running this script with --child; its last line is the answer."""
    cmd = [sys.executable, str(script), "--child", json.dumps(spec)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"child {spec} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def peak_rss(nested: Path, budgets: list[str], dtypes: list[str], reps: int, forward: int) -> dict:
    """Each case's child result with the lowest final peak over `reps`; the baseline only imports."""
    script = Path(__file__).resolve()
    cases = [{}] + [{"dir": str(nested), "budget": b, "dtype": d, "forward": forward} for d in dtypes for b in budgets]
    runs: dict[str, list[dict]] = {}
    for _ in range(reps):
        for spec in cases:
            key = f"{spec.get('budget', 'baseline')}/{spec.get('dtype', '-')}"
            runs.setdefault(key, []).append(run_child(script, dict(spec)))
    return {k: min(v, key=lambda r: r["run"]["VmHWM"]) for k, v in runs.items()}


def above_baseline(r: dict, base: dict) -> dict:
    """Load peak, run peak and anon above the import-only baseline, and the mapped checkpoint pages, in bytes."""
    return {"load_peak": r["load"]["VmHWM"] - base["load"]["VmHWM"],
            "run_peak": r["run"]["VmHWM"] - base["run"]["VmHWM"],
            "anon": r["run"]["RssAnon"] - base["run"]["RssAnon"], "mapped": r["run"]["mapped"]}


RSS_HEAD = (f"{'weights MiB':>13}{'in file':>9}{'load peak':>11}{'run peak':>10}{'run/weights':>13}{'anon MiB':>10}"
            f"{'mapped MiB':>12}")
RSS_NOTE = """\
weights: bytes of the tensors the loaded network holds (a strided view counts only its elements); in file: the
  span of the file covered by those of them that are zero-copy views of the memory-mapped checkpoint (a column
  prefix of a row-major weight covers whole rows, so every page of it);
load peak: VmHWM after load(); run peak: VmHWM after one forward pass over {n} tokens (views of the file are paged
  in when first used); both minus the baseline's peak, MiB; anon: RssAnon after the forward minus the baseline's;
mapped: resident pages of the memory-mapped checkpoint after the forward (clean file pages: reclaimable, but the
  ones under "in file" are read from disk again when used)"""


def rss_row(r: dict, base: dict) -> str:
    m = above_baseline(r, base)
    r["above_baseline"] = m
    mib = {k: v / 2**20 for k, v in m.items()}
    return (f"{r['weights'] / 2**20:>13.1f}{r['weights_in_file_span'] / 2**20:>9.1f}{mib['load_peak']:>11.1f}"
            f"{mib['run_peak']:>10.1f}{m['run_peak'] / r['weights']:>13.2f}{mib['anon']:>10.1f}{mib['mapped']:>12.1f}")


def print_rss(rss: dict, budgets: list[str], dtypes: list[str], forward: int) -> dict:
    base = rss["baseline/-"]
    print(f"\nc. memory of elastic_local.load(nested, budget=b, dtype=d) and one forward pass, fresh process each, "
          f"above a process that only imports torch + elastic_local (peak {base['run']['VmHWM'] / 2**20:.0f} MiB)")
    print(f"{'dtype':<10}{'budget':<8}" + RSS_HEAD)
    out: dict = {"baseline": base}
    for d in dtypes:
        for b in budgets:
            r = rss[f"{b}/{d}"]
            print(f"{d:<10}{b:<8}" + rss_row(r, base))
            out.setdefault(d, {})[b] = r
        small, full = out[d][budgets[-1]], out[d][budgets[0]]
        ratios = {k: small["above_baseline"][k] / full["above_baseline"][k] for k in ("load_peak", "run_peak", "anon")}
        ratios["anon_plus_in_file"] = ((small["above_baseline"]["anon"] + small["weights_in_file_span"])
                                       / (full["above_baseline"]["anon"] + full["weights_in_file_span"]))
        ratios["weights"] = small["weights"] / full["weights"]
        print(f"{'':<10}{budgets[-1]} / {budgets[0]}: load peak x{ratios['load_peak']:.2f}, run peak "
              f"x{ratios['run_peak']:.2f}, anon x{ratios['anon']:.2f}, anon + in file "
              f"x{ratios['anon_plus_in_file']:.2f}, weights x{ratios['weights']:.2f}")
        out[d]["ratios"] = ratios
    print(RSS_NOTE.format(n=forward))
    return out


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5, help="timed runs of each slice and copy, per mode")
    p.add_argument("--rss-reps", type=int, default=1, help="fresh processes per RSS case (the minimum is kept)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="load dtypes for the RSS part")
    p.add_argument("--forward-tokens", type=int, default=64, help="tokens of the forward pass after loading (RSS)")
    p.add_argument("--fsync", action="store_true", help="fsync slice and copy outputs inside the timed region")
    p.add_argument("--skip", default="", help="comma-separated parts to skip, from: throughput, rss")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rebuild", action="store_true", help="rebuild the parent and the nested checkpoint")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: one RSS measurement, JSON spec
    args = p.parse_args()
    if args.child:
        print(json.dumps(rss_child(json.loads(args.child))))
        return
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    torch.set_num_threads(args.threads)
    load_avg = os.getloadavg()[0]

    nested = build_nested(rebuild=args.rebuild)
    cfg = elastic_local.NemotronHConfig.from_dir(nested)
    from elastic_local.elastic.table import read_budgets
    from elastic_local.model.budget import count_params

    table = read_budgets(cfg)
    budgets = list(table)  # largest first: full, p77, p40
    params = {b: count_params(cfg, table[b])[0] for b in budgets}
    print(f"nested checkpoint {nested}: budgets " + ", ".join(f"{b} {params[b] / 1e6:.1f}M" for b in budgets)
          + f"; load average before the run {load_avg:.2f}, {args.threads} threads")

    summary: dict = {"args": vars(args), "load_avg": load_avg, "params": params}
    summary["size"] = print_sizes(sizes(nested, budgets), params)
    out_bytes = {b: v["weight_bytes"] for b, v in summary["size"]["slices"].items()}
    if "throughput" not in skip:
        res = throughput(nested, out_bytes, args.reps, args.fsync, args.threads)
        summary["throughput"] = print_throughput(res, out_bytes, args.reps, args.fsync)
    if "rss" not in skip:
        rss = peak_rss(nested, budgets, dtypes, args.rss_reps, args.forward_tokens)
        summary["rss"] = print_rss(rss, budgets, dtypes, args.forward_tokens)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
