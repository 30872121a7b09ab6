"""`elastic-local train`: elastic distillation of a Nemotron-H parent with a learnable budget router.

One loop (SPEC 2): each step samples a budget (the full model too), the router turns it into soft
sizes (Gumbel-Softmax), the student runs those soft prefix masks on the one network, and the loss is
forward KL from the frozen parent's logits plus lambda x the relative gap between the parameter count
of the configuration that would ship (the router's argmax; `Router.shipped`) and the target, outside a
dead zone. Stage 1: short sequences, budgets uniform; stage 2: full length, budgets weighted toward the
largest. Everything random is a function of (seed, step), the state is written atomically every N steps,
and the same command resumes. Under `torchrun` the student is wrapped in PyTorch's
DistributedDataParallel (gloo on CPUs, NCCL on GPUs) and each rank takes its slice of every batch.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..checkpoint.load import load_network
from ..elastic.table import read_budgets
from ..engine.tokenizer import Tokenizer
from ..model.budget import Budget, count_params
from ..model.config import NemotronHConfig
from ..model.nemotron_h import NemotronH
from ..quant.scheme import read_quant_config
from .data import batch_indices, pack, read_stream, split
from .export import stored_dtypes, write_trained
from .qad import fake_quantize
from .recipe import Recipe
from .router import Router
from .state import load_optimizer, load_state, optimizer_tensors, save_state
from .weights import make_trainable, restore

log = logging.getLogger(__name__)
CALIBRATION_TOKENS = 8192  # importance scoring and activation scales: the first tokens of the training data


def kd_sum(student_logits: torch.Tensor, teacher_logp: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """Forward KL(teacher || student) summed over the trained positions."""
    logp = F.log_softmax(student_logits.float(), dim=-1)
    kl = (teacher_logp.exp() * (teacher_logp - logp)).sum(-1)
    return (kl * trained).sum()


class Student(nn.Module):
    """The trainable network and the router as one module (what DDP wraps). The network is the plain
    NemotronH whose weights are these parameters."""

    def __init__(self, net: NemotronH, params: dict[str, nn.Parameter], router: Router,
                 fixed: dict[float, dict] | None = None, cost_on: str = "argmax"):
        super().__init__()
        self.weights = nn.ParameterList(params.values())
        self.router = router
        self.net = net
        self.fixed = fixed  # fraction -> one-hot weights: configurations kept as they are (QAD of a trained file)
        self.cost_on = cost_on  # Recipe.cost_on

    def forward(self, ids, trained, teacher_logp, fraction: float | None, target: float, tau: float, scale: float,
                noise: torch.Generator, norm: float, cost_lambda: float, dead_zone: float):
        soft, hidden, cost_loss, cost = None, None, torch.zeros((), dtype=torch.float64), None
        if fraction is not None:
            w = self.fixed[fraction] if self.fixed else self.router.sample(fraction, tau, scale, noise)
            soft, hidden = self.router.soft_layers(w), self.router.soft_hidden(w)
            priced = self.router.shipped(fraction) if self.cost_on == "argmax" and not self.fixed else w
            cost = self.router.expected_params(priced)
            cost_loss = cost_lambda * F.relu((cost / target - 1).abs() - dead_zone)
        kd = kd_sum(self.net.forward(ids, soft=soft, soft_hidden=hidden), teacher_logp, trained) / norm
        return kd + cost_loss.to(kd.dtype).to(kd.device), kd.detach(), cost


@dataclass
class Schedule:
    recipe: Recipe
    budgets: list[tuple[str, float | None]]  # (name, fraction); fraction None is the full model, first

    def stage(self, step: int) -> int:
        return 1 if step < self.recipe.stage1_steps() else 2

    def budget(self, step: int) -> int:
        """Index into `budgets` for this step: uniform in stage 1, recipe weights (largest first) in stage 2."""
        n = len(self.budgets)
        if self.stage(step) == 1:
            weights = torch.ones(n)
        else:
            given = list(self.recipe.stage2_weights)
            weights = torch.tensor((given + [given[-1]] * n)[:n], dtype=torch.float)
        g = torch.Generator().manual_seed(self.recipe.seed * 7_919 + step)
        return int(torch.multinomial(weights, 1, generator=g))

    def anneal(self, step: int) -> tuple[float, float]:
        """(Gumbel temperature, logit scale): temperature decays geometrically, scale ramps linearly."""
        r = self.recipe
        t = step / max(1, r.steps - 1)
        return r.tau_start * (r.tau_end / r.tau_start) ** t, r.scale_start + (r.scale_end - r.scale_start) * t

    def lr(self, step: int, base: float) -> float:
        return base * min(1.0, (step + 1) / max(1, self.recipe.warmup_steps))


@dataclass
class Progress:
    total: int
    every: int
    running: dict[str, float] = field(default_factory=dict)
    # budget -> the priced configuration's share of the full model: what ships (with cost_on = samples, the sample)
    sizes: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    first_step: int = 0
    tokens: int = 0

    def update(self, step: int, name: str, kd: float, tokens: int, size: float | None = None) -> None:
        prev = self.running.get(name)
        self.running[name] = kd if prev is None else 0.9 * prev + 0.1 * kd
        if size is not None:
            self.sizes[name] = size
        self.tokens += tokens
        if (step + 1) % self.every and step + 1 != self.total:
            return
        dt = max(time.monotonic() - self.started, 1e-9)
        done = step + 1 - self.first_step
        eta = dt / done * (self.total - step - 1)
        losses = " ".join(f"{k} {v:.4f}" for k, v in self.running.items())
        sizes = " ".join(f"{k} {v:.1%}" for k, v in self.sizes.items())
        end = "\r" if sys.stderr.isatty() and step + 1 != self.total else "\n"
        print(f"step {step + 1}/{self.total} | kd {losses} | {f'size {sizes} | ' if sizes else ''}"
              f"{self.tokens / dt:,.0f} tok/s | "
              f"ETA {int(eta) // 60}m{int(eta) % 60:02d}s", end=end, file=sys.stderr, flush=True)


def _distributed(device: str) -> tuple[int, int, str]:
    """(rank, world size, this process's device): NCCL with one GPU per process, gloo on CPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    cuda = torch.device(device).type == "cuda"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), world, f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else device


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def prepare_parent(src: Path, work: Path, calib_ids: list[int], rank: int, world: int) -> Path:
    """The teacher and starting point in importance order: SRC itself when it is already nested,
    otherwise SRC nested once (scores on the training data) into the work directory."""
    cfg = NemotronHConfig.from_dir(src)
    if read_quant_config(src)[0] != "bf16":
        raise ValueError(f"{src} is quantized; train from its BF16 original (QAD: --qad on the BF16 file)")
    if cfg.raw.get("elastic"):
        return src
    parent = work / "parent"
    if rank == 0 and not (parent / "config.json").is_file():
        from ..elastic.nest import nest

        work.mkdir(parents=True, exist_ok=True)
        calib = work / "calibration.json"
        calib.write_text(json.dumps(calib_ids))
        axes = ("hidden", "mamba_heads", "expert_channels", "shared_channels", "mlp_channels") + \
            (("experts",) if cfg.n_group == 1 else ())
        nest(src, parent, {}, calib=calib, axes=axes, overwrite=True)
    _barrier(world)
    return parent


def _job(src: Path, data: list[str], budgets: dict[str, float], recipe: Recipe, qad: str | None) -> dict:
    return {"src": str(src.resolve()), "data": [str(Path(d).resolve()) for d in data], "budgets": budgets,
            "recipe": recipe.to_dict(), "qad": qad}


def heldout_kd(net: NemotronH, teacher: NemotronH, seqs: torch.Tensor, trained: torch.Tensor,
               budgets: list[Budget], batch: int) -> dict[str, float]:
    """Mean forward KL per trained token on held-out sequences, per budget (hard prefix views)."""
    out = {}
    with torch.inference_mode():
        tlogp = [F.log_softmax(teacher.forward(seqs[i:i + batch]), -1) for i in range(0, len(seqs), batch)]
        for b in budgets:
            total = sum(float(kd_sum(net.forward(seqs[i:i + batch], budget=b), tl, trained[i:i + batch]))
                        for i, tl in zip(range(0, len(seqs), batch), tlogp))
            out[b.name] = total / max(1.0, float(trained.sum()))
    return out


def train(src: str | Path, out: str | Path, data: list[str], budgets: dict[str, float], recipe: Recipe,
          qad: str | None = None, full_name: str = "full", device: str = "cpu", overwrite: bool = False,
          max_steps: int | None = None) -> Path | None:
    """Train and export; returns OUT (on rank 0). `max_steps` stops early after that many steps of this
    invocation (the state is saved; running the command again continues), for tests and chunked runs."""
    src, out = Path(src), Path(out)
    for name, frac in budgets.items():
        if not 0 < frac < 1:
            raise ValueError(f"--budget {name}={frac}: a fraction of the parent's parameters must be in (0, 1)")
        if name == full_name:
            raise ValueError(f"--budget {name}: {full_name!r} is the full model's name; pick another")
    if not budgets:
        raise ValueError("give at least one --budget NAME=FRACTION")
    if qad not in (None, "fp8", "nvfp4"):
        raise ValueError(f"--qad {qad!r}: choose fp8 or nvfp4")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another output or remove it")
    rank, world, device = _distributed(device)
    if recipe.batch_size % world:
        raise ValueError(f"batch_size {recipe.batch_size} must be a multiple of the {world} processes")
    work = out.parent / f"{out.name}.train"
    job = _job(src, data, budgets, recipe, qad)
    if (work / "job.json").is_file() and json.loads((work / "job.json").read_text()) != job:
        raise ValueError(f"{work} holds a run with other settings (see its job.json); remove it to start over, "
                         "or rerun the same command to resume")

    tok = Tokenizer.from_dir(src)
    if tok is None:
        raise ValueError(f"{src} has no tokenizer.json; training data must be tokenized with the model's tokenizer")
    stream = read_stream(data, tok)
    train_s, held = split(stream, recipe.heldout_fraction, recipe.seq_len)
    parent = prepare_parent(src, work, train_s.ids[:CALIBRATION_TOKENS].tolist(), rank, world)
    if rank == 0:
        work.mkdir(parents=True, exist_ok=True)
        (work / "job.json").write_text(json.dumps(job, indent=1) + "\n")

    cfg = NemotronHConfig.from_dir(parent)
    teacher = load_network(parent, dtype=torch.float32, device=device)
    net = load_network(parent, dtype=torch.float32, device=device)
    params = make_trainable(net)
    torch.manual_seed(recipe.seed)  # the router's initial weights
    router = Router(cfg, budgets, tuple(recipe.router_axes), hidden=recipe.router_hidden,
                    heterogeneous=recipe.heterogeneous,
                    max_choices=recipe.max_choices).to(device)
    fixed = None
    if qad and (parent / "router.json").is_file():
        # QAD of a checkpoint `train` wrote: its router and budgets stay (the nested masks are kept)
        router = Router.load(parent, cfg).to(device)
        table = read_budgets(cfg, where=str(parent / "config.json"))
        if sorted(zip(router.names, router.fractions)) != sorted(budgets.items()) or set(router.names) - set(table):
            raise ValueError(f"--qad on {parent}: give the budgets it was trained with "
                             f"({', '.join(f'{n}={f:g}' for n, f in zip(router.names, router.fractions))})")
        fixed = {f: router.weights_of(table[n]) for n, f in zip(router.names, router.fractions)}
    if qad:
        fake_quantize(net, qad, stored_dtypes(parent))
    student = Student(net, params, router, fixed, recipe.cost_on)
    opt = torch.optim.AdamW(params.values(), lr=recipe.lr, weight_decay=0.0)
    ropt = torch.optim.AdamW(router.parameters(), lr=recipe.router_lr, weight_decay=0.0)

    start, progress_state = 0, {}
    saved = load_state(work / "state")
    if saved is not None:
        tensors, meta = saved
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(tensors[f"weights.{name}"])
        router.load_state_dict({k[len("router."):]: v for k, v in tensors.items() if k.startswith("router.")})
        load_optimizer(opt, "opt", tensors, meta["opt"])
        load_optimizer(ropt, "ropt", tensors, meta["ropt"])
        start, progress_state = meta["step"], meta["progress"]
        if rank == 0:
            print(f"resuming {work} at step {start}", file=sys.stderr)

    model: nn.Module = student
    if world > 1:
        model = nn.parallel.DistributedDataParallel(student, find_unused_parameters=True)

    sched = Schedule(recipe, [(full_name, None)] + [(n, budgets[n]) for n in router.names])
    full_params = count_params(cfg, Budget.full(cfg))[0]
    stages = {1: pack(train_s, recipe.stage1_seq_len), 2: pack(train_s, recipe.seq_len)}
    prog = Progress(recipe.steps, 1 if sys.stderr.isatty() else max(1, recipe.steps // 20),
                    dict(progress_state.get("running", {})), first_step=start)
    per_rank = recipe.batch_size // world
    last = recipe.steps if max_steps is None else min(recipe.steps, start + max_steps)

    def checkpoint(step: int) -> None:
        if rank == 0:
            tensors = {f"weights.{n}": p for n, p in params.items()}
            tensors.update({f"router.{k}": v for k, v in router.state_dict().items()})
            ot, om = optimizer_tensors(opt, "opt")
            rt, rm = optimizer_tensors(ropt, "ropt")
            save_state(work / "state", step, {**tensors, **ot, **rt},
                       {"opt": om, "ropt": rm, "progress": {"running": prog.running}})
        _barrier(world)

    bf16 = recipe.autocast_on(str(device))
    for step in range(start, last):
        seqs, trained = stages[sched.stage(step)]
        idx = batch_indices(len(seqs), recipe.batch_size, step, recipe.seed)
        ids, tr = seqs[idx].to(device), trained[idx].to(device).float()
        norm = float(tr.sum()) / world  # DDP averages over ranks: per rank, divide by the global count / world
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        ids, tr = ids[mine], tr[mine]
        autocast = torch.autocast(torch.device(device).type, torch.bfloat16, enabled=bf16)
        with torch.no_grad(), autocast:
            tlogp = F.log_softmax(teacher.forward(ids), dim=-1)
        k = sched.budget(step)
        name, fraction = sched.budgets[k]
        tau, scale = sched.anneal(step)
        for o, base in ((opt, recipe.lr), (ropt, recipe.router_lr)):
            for g in o.param_groups:
                g["lr"] = sched.lr(step, base)
        noise = torch.Generator().manual_seed(recipe.seed * 104_729 + step)
        with autocast:  # the forward only: backward follows autocast's casts, the optimizer steps fp32 weights
            loss, kd, cost = model(ids, tr, tlogp, fraction, (fraction or 1.0) * full_params, tau, scale, noise,
                                   max(norm, 1e-9), recipe.cost_lambda, recipe.dead_zone)
        opt.zero_grad(set_to_none=True)
        ropt.zero_grad(set_to_none=True)
        loss.backward()
        if recipe.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params.values(), recipe.grad_clip)
        opt.step()
        if fraction is not None and fixed is None:
            ropt.step()
        if rank == 0:
            size = None if cost is None else float(cost.detach()) / full_params
            prog.update(step, name, float(kd), ids.numel() * world, size)  # rank 0's share of the batch
        if (step + 1) % recipe.checkpoint_every == 0 or step + 1 == last:
            checkpoint(step + 1)
    if last < recipe.steps:
        return None

    if rank != 0:
        _barrier(world)
        return None
    restore(net, params)
    hard = router.budgets()
    full = Budget.full(cfg, full_name)
    held_seqs, held_tr = pack(held, recipe.seq_len)
    qnet = net
    if qad:  # held-out figures as the quantized file will run
        fake_quantize(qnet, qad, stored_dtypes(parent))
    figures = heldout_kd(qnet, teacher, held_seqs, held_tr.float(), [full] + hard, recipe.batch_size)
    restore(net, params)
    training = {"steps": recipe.steps, "tokens": recipe.steps * recipe.batch_size * recipe.seq_len,
                "data": [Path(d).name for d in data], "qad": qad, "heldout_tokens": int(held_tr.sum()),
                "heldout_kd": figures, "targets": {n: budgets[n] for n in router.names}}
    bf16_out = work / "export-bf16" if qad else out
    written = write_trained(net, parent, bf16_out, router, [full] + hard, training, overwrite=bool(qad) or overwrite)
    if qad:
        from ..ptq import quantize_checkpoint

        calib = work / "calibration.json"
        calib.write_text(json.dumps(train_s.ids[:CALIBRATION_TOKENS].tolist()))
        written = quantize_checkpoint(bf16_out, out, qad, calib=calib, overwrite=overwrite)
        for f in ("router.safetensors", "router.json"):
            shutil.copy2(bf16_out / f, written / f)
    _barrier(world)
    return written


def heldout_kd_of(path: Path, parent: Path, data: list[str], recipe: Recipe, names: list[str] | None = None) -> dict:
    """Held-out KD of a nested checkpoint's budgets against a parent, on the split `train` holds out
    (for comparing trained budgets with `nest`'s zero-shot ones)."""
    tok = Tokenizer.from_dir(path)
    _, held = split(read_stream(data, tok), recipe.heldout_fraction, recipe.seq_len)
    cfg = NemotronHConfig.from_dir(path)
    table = read_budgets(cfg, where=str(path / "config.json"))
    net = load_network(path, dtype=torch.float32)
    teacher = load_network(parent, dtype=torch.float32)
    seqs, tr = pack(held, recipe.seq_len)
    chosen = [b for n, b in table.items() if names is None or n in names]
    return heldout_kd(net, teacher, seqs, tr.float(), chosen, recipe.batch_size)
