"""Train a Nemotron-H from scratch as a plain causal LM: the demo parent.

It trains the project's own network (`elastic_local.model`), not a copy: a random checkpoint is written
in the hub layout, loaded by the ordinary loader in float32, and the loaded tensors themselves become
the trainable leaves (Mamba's A is trained through A_log, as the file stores it). Saving reverses the
loader's rank-major head order, so the result is an ordinary Nemotron-H directory that every loader reads.

Loss on assistant tokens only (the prompt is given), AdamW, linear warm-up then cosine decay. Training
state (weights, AdamW moments, step, data order seed) is a safetensors file plus a JSON file, replaced
atomically every `save_every` steps: a killed run resumes where its last save left it.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..checkpoint.load import load_network
from ..checkpoint.write import CheckpointWriter
from ..model.budget import Budget
from ..model.config import NemotronHConfig
from ..model.layout import head_channels, rank_major_heads
from ..model.nemotron_h import NemotronH
from ..model.schema import expected_shapes


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 100
    threads: int = 2


# ---------------------------------------------------------------------------------------------------------
# Initial weights


def _inv_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


def init_tensors(cfg: NemotronHConfig, seed: int) -> dict[str, torch.Tensor]:
    """Hub-named random weights (float32) for a config: normal(0, 1/sqrt(fan_in)) Linears, residual
    outputs scaled down by sqrt(2 * layers), Mamba's dt, A and D as mamba_ssm initialises them."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    residual_scale = 1 / math.sqrt(2 * cfg.num_layers)
    for name, shape in expected_shapes(cfg, Budget.full(cfg)).items():
        key = name.rsplit(".", 1)[0] if name.endswith(".weight") else name
        if key.endswith("norm") or name == "norm_f.weight":
            t = torch.ones(shape)
        elif name.endswith("A_log"):
            t = torch.log(torch.empty(shape).uniform_(1, 16, generator=g))
        elif name.endswith("dt_bias"):
            dt = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
            t = _inv_softplus(dt)
        elif name.endswith(".D"):
            t = torch.ones(shape)
        elif name.endswith("conv1d.bias") or name.endswith("e_score_correction_bias"):
            t = torch.zeros(shape)
        elif name.endswith("conv1d.weight"):
            bound = 1 / math.sqrt(shape[-1])
            t = torch.empty(shape).uniform_(-bound, bound, generator=g)
        elif name == "embeddings.weight" or name == "lm_head.weight":
            t = torch.randn(shape, generator=g) * (1 / math.sqrt(shape[-1]) if name == "lm_head.weight" else 1.0)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            if key.endswith(("out_proj", "o_proj", "down_proj")):
                t = t * residual_scale
        out[name] = t
    return out


def write_checkpoint(out: Path, config: dict, tensors: dict[str, torch.Tensor], tokenizer_dir: Path | None,
                     dtype: torch.dtype = torch.float32, overwrite: bool = True) -> Path:
    """A Nemotron-H directory in the hub layout (`backbone.` prefix), published atomically."""
    with CheckpointWriter(out, overwrite=overwrite) as w:
        for name, t in tensors.items():
            hub = name if name == "lm_head.weight" else f"backbone.{name}"
            keep_fp32 = name.endswith(("A_log", ".D", "dt_bias", "gate.weight", "e_score_correction_bias"))
            w.add(hub, t.detach().to(torch.float32 if keep_fp32 else dtype).contiguous())
        w.write_json("config.json", config)
        if tokenizer_dir is not None:
            w.carry(tokenizer_dir)
        return w.close()


# ---------------------------------------------------------------------------------------------------------
# The loaded network's tensors as trainable leaves, and back to the hub layout


def trainable(net: NemotronH) -> dict[str, torch.Tensor]:
    """Name -> leaf tensor of every trained weight of a float32 network (which now builds a graph).
    Mamba's A becomes an `A_log` leaf; call `refresh(net, params)` after each optimizer step."""
    params: dict[str, torch.Tensor] = {"embeddings.weight": net.embed, "norm_f.weight": net.norm_f}
    if net.lm_head is not net.embed:
        params["lm_head.weight"] = net.lm_head
    for i, layer in enumerate(net.layers):
        pre = f"layers.{i}."
        params[pre + "norm.weight"] = layer.norm
        m = layer.mixer
        if layer.kind == "M":
            a_log = torch.log(-m.A)
            params.update({pre + "in_proj": m.in_proj, pre + "conv_weight": m.conv_weight, pre + "dt_bias": m.dt_bias,
                           pre + "A_log": a_log, pre + "D": m.D, pre + "norm": m.norm, pre + "out_proj": m.out_proj})
            if m.conv_bias is not None:
                params[pre + "conv_bias"] = m.conv_bias
        elif layer.kind == "*":
            params.update({pre + "qkv": m.qkv, pre + "o_proj": m.o_proj})
        elif layer.kind == "E":
            params.update({pre + "gate": m.gate, pre + "up": m.up, pre + "down": m.down,
                           pre + "shared_up": m.shared_up, pre + "shared_down": m.shared_down})
        else:
            params.update({pre + "up": m.up, pre + "down": m.down})
    for t in params.values():
        t.requires_grad_(True)
    refresh(net, params)
    return params


def refresh(net: NemotronH, params: dict[str, torch.Tensor]) -> None:
    """Recompute what the network derives from a trained leaf: A = -exp(A_log)."""
    for i, layer in enumerate(net.layers):
        if layer.kind == "M":
            layer.mixer.A = -torch.exp(params[f"layers.{i}.A_log"])


def _scatter(resident: torch.Tensor, index: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The file-order tensor whose entries `index` (along `dim`) are the resident ones, in order."""
    out = torch.empty_like(resident)
    if dim == 0:
        out[index] = resident
    else:
        out[:, index] = resident
    return out


def hub_tensors(net: NemotronH, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The network's weights under their hub names and in the file's head order (the loader's inverse)."""
    cfg = net.cfg
    G, p, KV, hd = cfg.n_groups, cfg.mamba_head_dim, cfg.num_key_value_heads, cfg.head_dim
    out = {"embeddings.weight": net.embed}
    with torch.no_grad():
        for i, layer in enumerate(net.layers):
            m, pre = layer.mixer, f"layers.{i}.mixer."
            out[f"layers.{i}.norm.weight"] = layer.norm
            if layer.kind == "M":
                n = m.heads
                heads = rank_major_heads(n, G)
                ch = head_channels(heads, p)
                bc = torch.arange(2 * n * p, 2 * n * p + 2 * G * cfg.ssm_state_size)
                rows = torch.cat([ch, n * p + ch, bc, 2 * n * p + len(bc) + heads])
                conv_rows = torch.cat([ch, bc - n * p])
                out.update({pre + "in_proj.weight": _scatter(m.in_proj, rows),
                            pre + "conv1d.weight": _scatter(m.conv_weight, conv_rows)[:, None],
                            pre + "dt_bias": _scatter(m.dt_bias, heads),
                            pre + "A_log": _scatter(params[f"layers.{i}.A_log"], heads),
                            pre + "D": _scatter(m.D, heads), pre + "norm.weight": _scatter(m.norm, ch),
                            pre + "out_proj.weight": _scatter(m.out_proj, ch, dim=1)})
                if m.conv_bias is not None:
                    out[pre + "conv1d.bias"] = _scatter(m.conv_bias, conv_rows)
            elif layer.kind == "*":
                nq = m.qkv.shape[0] // hd - 2 * KV
                ch = head_channels(rank_major_heads(nq, KV), hd)
                q, k, v = m.qkv.split([nq * hd, KV * hd, KV * hd])
                out.update({pre + "q_proj.weight": _scatter(q, ch), pre + "k_proj.weight": k,
                            pre + "v_proj.weight": v, pre + "o_proj.weight": _scatter(m.o_proj, ch, dim=1)})
            elif layer.kind == "E":
                out.update({pre + "gate.weight": m.gate, pre + "gate.e_score_correction_bias": m.bias,
                            pre + "shared_experts.up_proj.weight": m.shared_up,
                            pre + "shared_experts.down_proj.weight": m.shared_down})
                for j in range(m.up.shape[0]):
                    out[pre + f"experts.{j}.up_proj.weight"] = m.up[j]
                    out[pre + f"experts.{j}.down_proj.weight"] = m.down[j]
            else:
                out.update({pre + "up_proj.weight": m.up, pre + "down_proj.weight": m.down})
        out["norm_f.weight"] = net.norm_f
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = net.lm_head
    return {k: v.detach() for k, v in out.items()}


# ---------------------------------------------------------------------------------------------------------
# Data


@dataclass
class Example:
    ids: list[int]
    n_prompt: int  # the loss covers ids[n_prompt:]


def encode_examples(pairs: list[tuple[str, str]], tokenizer) -> list[Example]:
    """(prompt, completion) texts -> token ids, the prompt's length marking where the loss starts."""
    prompts = tokenizer.encode_batch([p for p, _ in pairs], add_special_tokens=False)
    completions = tokenizer.encode_batch([c for _, c in pairs], add_special_tokens=False)
    return [Example(p.ids + c.ids, len(p.ids)) for p, c in zip(prompts, completions)]


def batches(examples: list[Example], batch_size: int, seed: int, start_step: int = 0,
            pad_id: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(ids [B, T], targets [B, T] with -100 where no loss) for steps start_step, start_step + 1, ...

    Each epoch is a fixed shuffle (by seed and epoch); examples of similar length share a batch (sorted
    within windows of 32 batches), so little is padding. Step k's batch depends only on (seed, k)."""
    per_epoch = len(examples) // batch_size
    epoch, k = divmod(start_step, per_epoch)
    while True:
        order = list(range(len(examples)))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        window = 32 * batch_size
        groups = []
        for w in range(0, per_epoch * batch_size, window):
            chunk = sorted(order[w:w + window], key=lambda j: len(examples[j].ids))
            groups += [chunk[i:i + batch_size] for i in range(0, len(chunk) - batch_size + 1, batch_size)]
        random.Random(f"{seed}:{epoch}:batches").shuffle(groups)
        for group in groups[k:]:
            exs = [examples[j] for j in group]
            T = max(len(e.ids) for e in exs)
            ids = torch.full((len(exs), T), pad_id, dtype=torch.long)
            tgt = torch.full((len(exs), T), -100, dtype=torch.long)
            for r, e in enumerate(exs):
                ids[r, :len(e.ids)] = torch.tensor(e.ids)
                tgt[r, e.n_prompt - 1:len(e.ids) - 1] = torch.tensor(e.ids[e.n_prompt:])
            yield ids, tgt
        epoch, k = epoch + 1, 0


# ---------------------------------------------------------------------------------------------------------
# Training


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    t = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _no_decay(name: str) -> bool:
    return name.endswith(("norm.weight", "norm", "A_log", "D", "dt_bias", "conv_bias"))


def make_optimizer(params: dict[str, torch.Tensor], tc: TrainConfig) -> torch.optim.AdamW:
    decay = [t for n, t in params.items() if not _no_decay(n)]
    rest = [t for n, t in params.items() if _no_decay(n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=tc.lr, betas=tc.betas)


def loss_of(net: NemotronH, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = net.forward(ids)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-100)


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0
    seconds: float = 0.0
    losses: list[tuple[int, float]] = field(default_factory=list)


def save_state(path: Path, params: dict[str, torch.Tensor], opt: torch.optim.AdamW, state: TrainState,
               tc: TrainConfig) -> None:
    """Weights and AdamW moments (safetensors) + step and config (JSON), replaced as one directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    tensors = {f"param/{n}": t.detach().contiguous() for n, t in params.items()}
    index = {id(t): n for n, t in params.items()}
    for group in opt.param_groups:
        for t in group["params"]:
            s = opt.state.get(t)
            if s:
                n = index[id(t)]
                tensors[f"exp_avg/{n}"] = s["exp_avg"].contiguous()
                tensors[f"exp_avg_sq/{n}"] = s["exp_avg_sq"].contiguous()
    save_file(tensors, tmp / "state.safetensors")
    (tmp / "state.json").write_text(json.dumps({"train": asdict(tc), "state": asdict(state)}, indent=1) + "\n")
    old = path.with_name(path.name + ".old")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def load_state(path: Path, params: dict[str, torch.Tensor], opt: torch.optim.AdamW) -> TrainState:
    tensors = load_file(path / "state.safetensors")
    meta = json.loads((path / "state.json").read_text())["state"]
    state = TrainState(meta["step"], meta["tokens"], meta["seconds"], [tuple(x) for x in meta["losses"]])
    with torch.no_grad():
        for n, t in params.items():
            t.copy_(tensors[f"param/{n}"])
            if f"exp_avg/{n}" in tensors:
                opt.state[t] = {"step": torch.tensor(float(state.step)), "exp_avg": tensors[f"exp_avg/{n}"],
                                "exp_avg_sq": tensors[f"exp_avg_sq/{n}"]}
    return state


# settings a resumed run may change: they do not change what it computes
RESUMABLE_CHANGES = ("save_every", "threads")


def check_resumable(state_dir: Path, tc: TrainConfig) -> None:
    """Refuse to resume a run saved with another schedule: its weights and moments would go on under
    the new learning rate, steps or data order as if nothing had changed, and the result would match
    neither run."""
    saved = json.loads((state_dir / "state.json").read_text()).get("train", {})
    now = json.loads(json.dumps(asdict(tc)))  # tuples as JSON lists, as saved
    changed = [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in now.items()
               if k not in RESUMABLE_CHANGES and saved.get(k) != v]
    if changed:
        raise ValueError(f"{state_dir} holds a run saved with other settings ({'; '.join(changed)}); rerun with "
                         f"its settings to resume it, or remove {state_dir.parent} to start over")


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def train(init_dir: Path, examples: list[Example], work: Path, tc: TrainConfig, pad_id: int = 0,
          log: Callable[[str], None] = print) -> tuple[NemotronH, dict[str, torch.Tensor]]:
    """Train the network in `init_dir` on `examples`, keeping resumable state in `work/state`."""
    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    net = load_network(init_dir, dtype=torch.float32)
    net.prefill_chunk = 1 << 30
    params = trainable(net)
    opt = make_optimizer(params, tc)
    state_dir = work / "state"
    state = TrainState()
    if (state_dir / "state.json").is_file():
        check_resumable(state_dir, tc)
        state = load_state(state_dir, params, opt)
    if state.step:
        refresh(net, params)
        log(f"resuming at step {state.step}/{tc.steps}")
    n_params = sum(t.numel() for t in params.values())
    log(f"training {n_params / 1e6:.2f}M parameters on {len(examples)} examples, {tc.steps} steps of "
        f"{tc.batch_size}")
    data = batches(examples, tc.batch_size, tc.seed, state.step, pad_id)
    start, run_seconds = state.step, 0.0  # the ETA comes from this run's own pace
    window_t, window_tok, window_loss, window_n = time.perf_counter(), 0, 0.0, 0
    while state.step < tc.steps:
        ids, tgt = next(data)
        for g in opt.param_groups:
            g["lr"] = lr_at(state.step, tc)
        loss = loss_of(net, ids, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), tc.grad_clip)
        opt.step()
        refresh(net, params)
        state.step += 1
        n_tok = int((tgt != -100).sum())
        state.tokens += int(ids.numel())
        window_tok += int(ids.numel())
        window_loss += float(loss.detach()) * n_tok
        window_n += n_tok
        if state.step % 10 == 0 or state.step == tc.steps:
            now = time.perf_counter()
            dt = now - window_t
            state.seconds += dt
            run_seconds += dt
            rate = window_tok / dt
            per_step = run_seconds / (state.step - start)
            avg = window_loss / max(1, window_n)
            state.losses.append((state.step, round(avg, 4)))
            eta = _fmt_time(per_step * (tc.steps - state.step))
            log(f"step {state.step}/{tc.steps} loss {avg:.4f} lr {lr_at(state.step, tc):.2e} "
                f"{rate:.0f} tok/s elapsed {_fmt_time(state.seconds)} ETA {eta}")
            window_t, window_tok, window_loss, window_n = now, 0, 0.0, 0
        if state.step % tc.save_every == 0 or state.step == tc.steps:
            save_state(state_dir, params, opt, state, tc)
    return net, params
