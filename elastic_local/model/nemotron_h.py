"""The Nemotron-H network: embeddings, a stack of pre-norm residual blocks (Mamba2, MoE, attention or
dense MLP, one letter each), a final norm and the LM head.

One resident copy of the weights, sized by the budget it was loaded for. `forward` runs any budget that
fits inside it by slicing prefixes of those weights (see budget.py); nothing is copied per budget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, fields
from functools import partial

import torch
import torch.nn.functional as F

from . import graphs, sample, step
from .attention import AttentionWeights, KVCache, attention
from .budget import Budget
from .config import NemotronHConfig
from .cost import PREFILL_CHUNK
from .linear import ExpertStack, Panels, Transposed, block, linear, rms_norm
from .mamba2 import MambaState, MambaWeights, mamba_mixer
from .moe import MLPWeights, MoEWeights, mlp, moe
from .soft import SoftLayer, SoftSize, unit_weights

log = logging.getLogger(__name__)

Observer = Callable[[int, str, torch.Tensor], None]


@dataclass
class Layer:
    kind: str  # block letter
    norm: torch.Tensor  # [D]
    mixer: MambaWeights | AttentionWeights | MoEWeights | MLPWeights | None  # None: not resident (layer off)


@dataclass
class HybridCache:
    """Per-sequence state of one budget: KV for attention layers, conv + SSM state for Mamba layers.
    `lengths[b]` counts the tokens row b has consumed. Its layers are fixed for its life (a tuple, not
    rebound; a MambaState is frozen): the C decode step binds a cache's Mamba states once (step.py), so
    an operation that changes them in any other way than in place builds a new cache."""

    budget: Budget
    layers: tuple[KVCache | MambaState | None, ...]
    lengths: list[int] = field(default_factory=list)
    dense: bool = field(default=False, repr=False, compare=False)  # states found contiguous (step.serves)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))

    def __setattr__(self, name: str, value) -> None:
        if name == "layers" and "layers" in self.__dict__:
            raise AttributeError("a HybridCache's layers are fixed for its life: build a new cache")
        object.__setattr__(self, name, value)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @classmethod
    def stack(cls, caches: list[HybridCache]) -> HybridCache:
        """One batch from caches of the same budget whose rows may sit at different positions."""
        budget = caches[0].budget
        if any(c.budget != budget for c in caches):
            raise ValueError("only caches of the same budget can be stacked")
        layers: list[KVCache | MambaState | None] = []
        for states in zip(*(c.layers for c in caches)):
            first = states[0]
            if isinstance(first, MambaState):
                layers.append(MambaState(torch.cat([s.conv for s in states]), torch.cat([s.ssm for s in states])))
            elif isinstance(first, KVCache):
                n = max(s.k.shape[2] for s in states)
                pad = [(0, 0, 0, n - s.k.shape[2]) for s in states]
                layers.append(KVCache(torch.cat([F.pad(s.k, q) for s, q in zip(states, pad)]),
                                      torch.cat([F.pad(s.v, q) for s, q in zip(states, pad)])))
            else:
                layers.append(None)
        return cls(budget, layers, [n for c in caches for n in c.lengths])

    def nbytes(self) -> int:
        total = 0
        for s in self.layers:
            if isinstance(s, KVCache):
                total += s.k.nbytes + s.v.nbytes
            elif isinstance(s, MambaState):
                total += s.conv.nbytes + s.ssm.nbytes
        return total


class NemotronH:
    def __init__(self, cfg: NemotronHConfig, resident: Budget, embed: torch.Tensor, layers: list[Layer],
                 norm_f: torch.Tensor, lm_head: torch.Tensor, prefill_chunk: int = PREFILL_CHUNK):
        self.cfg, self.resident = cfg, resident
        self.embed, self.layers, self.norm_f, self.lm_head = embed, layers, norm_f, lm_head
        self.prefill_chunk = prefill_chunk
        # observer(layer, what, tensor): sees each block's normed input ("input") and each Mamba layer's
        # per-head output before out_proj ("mamba_y"); importance scoring uses it, inference leaves it None
        self.observer: Observer | None = None
        self.compiled: dict[Budget, Callable | None] | None = None  # see compile_decode; None: runs eagerly
        self.graphs: dict[Budget, graphs.StepGraph | None] | None = None  # see capture_decode; None: off
        # per budget, the C decode step (model/step.py) built on its first one-token step; None: not covered
        self.c_steps: dict[Budget, step.DecodeStep | None] = {}
        # a bfloat16 network's small vectors (norms, convolution) as float32, one copy per tensor that every
        # budget's C step reads (step._floats)
        self.c_floats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._fitting: set[Budget] = set()  # budgets checked to fit the resident one

    def _float_weights(self, what: str) -> bool:
        """Whether every resident weight is a float tensor; else warns that `what` covers only those."""
        plain = (torch.Tensor, Transposed, Panels, int, float, type(None))
        if any(not isinstance(getattr(layer.mixer, f.name), plain) for layer in self.layers
               if layer.mixer is not None for f in fields(layer.mixer)):  # fields: not what layers cache on them
            log.warning("%s covers float weights; these quantized ones decode eagerly", what)
            return False
        return True

    def compile_decode(self) -> None:
        """Run one-token decode steps (inference, no observer) through `torch.compile`, one graph per budget,
        compiled on that budget's first step. Why: a decode step of a small model is a few thousand small
        ops whose Python and dispatch cost outweighs reading the weights (measured, docs/decode-speed.md "Compiled
        decode"). The step is the same layer code, with attention over the cache's whole capacity under
        a position mask so that no shape depends on the position. Float weights only: packed FP8 / NVFP4
        weights pick their expert blocks in Python, which the tracer cannot follow; those run eagerly."""
        if not self._float_weights("the compiled decode step"):
            return
        self.compiled = {}
        self._traced: dict[Budget, set[tuple[int, int]]] = {}  # per budget, the (rows, capacity) it has run

    def capture_decode(self, record: graphs.Recorder = graphs.cuda_record) -> None:
        """Replay one-token decode steps (inference, no observer) from CUDA graphs, one per budget, recorded
        on its first step and again for each new cache (graphs.py). Packed FP8 / NVFP4 experts are stacked
        first (linear.ExpertStack), so that the step can pick them by a device tensor. On CUDA this path
        is taken before the compiled one. `record`: tests record with a stand-in on the CPU."""
        if record is graphs.cuda_record and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs record GPU kernels; this model is on {self.device}: load it on a "
                             "CUDA device (--device cuda), or leave CUDA graphs off")
        self.c_steps.clear()  # a C step built before may read per-expert tensors the stacks below replace
        self.c_floats.clear()
        for i, layer in enumerate(self.layers):
            w = layer.mixer
            if isinstance(w, MoEWeights) and isinstance(w.up, list) and not isinstance(w.up, ExpertStack):
                try:
                    w.up, w.down = ExpertStack(w.up), ExpertStack(w.down)
                except ValueError as e:  # experts in several formats (a `keep` pattern that kept some)
                    log.warning("layer %d: %s; the decode step runs eagerly, without CUDA graphs", i, e)
                    return
        self.graphs, self._record = {}, record
        self._seen: dict[Budget, tuple] = {}  # per budget, the cache (graphs.bound_to) of its last eager step

    def _graphed_step(self, ids: torch.Tensor, b: Budget, cache: HybridCache) -> torch.Tensor:
        for s in cache.layers:
            if isinstance(s, KVCache):
                s.grow(max(cache.lengths) + 1)  # a new capacity (new tensors) records a new graph
        key, g = graphs.bound_to(ids, cache.layers), self.graphs.get(b)
        if b in self.graphs and g is None:  # its recording failed
            return self._forward(ids, b, cache, last_only=False)
        if g is None or g.key != key:
            if self._seen.get(b) != key:  # a cache's first step runs eagerly: one stepped once (a sub-batch
                self._seen[b] = key  # of the rows that decode) is never recorded
                return self._forward(ids, b, cache, last_only=False)
            self.graphs.pop(b, None)
            g = None  # the old graph (its memory) goes before the new one is recorded
            run = partial(self._layers, states=cache.layers, b=b, static=True, sync_free=True)
            lengths = torch.tensor(cache.lengths, device=ids.device)
            try:
                g = graphs.StepGraph.record(lambda i, n: run(i, lengths=n), ids, lengths, cache.layers, self._record)
            except RuntimeError as e:  # CUDA refused an op while capturing
                log.warning("recording the decode step of budget %r into a CUDA graph failed; it runs eagerly (%s)",
                            b.name, str(e).splitlines()[0] if str(e) else type(e).__name__)
                g = None
            self.graphs[b] = g
            if g is None:
                return self._forward(ids, b, cache, last_only=False)
        logits = g(ids, torch.tensor(cache.lengths, device=ids.device))
        cache.lengths = [n + 1 for n in cache.lengths]
        return logits

    def _compiled_step(self, ids: torch.Tensor, b: Budget, cache: HybridCache) -> torch.Tensor:
        capacity = 0
        for s in cache.layers:
            if isinstance(s, KVCache):
                s.grow(max(cache.lengths) + 1)  # a new capacity recompiles once, then the dimension is dynamic
                capacity = s.k.shape[2]
        if b not in self.compiled:
            self.compiled[b] = torch.compile(partial(self._layers, b=b, static=True))
            self._traced[b] = set()
        step = self.compiled[b]
        lengths = torch.tensor(cache.lengths, device=ids.device)
        logits = None
        if step is not None:
            # imported here: symbolic_shapes pulls in sympy, half a second of every launch that never compiles
            from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

            # A step is traced in pieces (graph breaks), each run as soon as it is traced: when a later piece
            # fails to trace, the earlier ones have advanced the Mamba states (KV writes are idempotent), and
            # the eager rerun below would advance them again. So a step that may trace (a batch size and
            # capacity this budget has not run yet) keeps a copy of them to put back.
            shape = (ids.shape[0], capacity)
            saved = None if shape in self._traced[b] else [
                (s, s.conv.clone(), s.ssm.clone()) for s in cache.layers if isinstance(s, MambaState)]
            try:
                # the MoE step reads its k expert ids as Python ints: traced as symbolic ints, not a graph
                # break; every budget and batch size is a variant of the one `_layers`, past dynamo's 8
                with torch._dynamo.config.patch(capture_scalar_outputs=True, recompile_limit=64):
                    logits = step(ids, cache.layers, lengths=lengths)
                self._traced[b].add(shape)
            except (torch._dynamo.exc.TorchDynamoException, GuardOnDataDependentSymNode) as e:  # while compiling
                log.warning("compiling the decode step of budget %r failed; it runs eagerly (%s)", b.name,
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
                self.compiled[b] = None
                for s, conv, ssm in saved or ():
                    s.conv.copy_(conv)
                    s.ssm.copy_(ssm)
        if logits is None:
            logits = self._layers(ids, cache.layers, b, lengths=lengths, static=True)
        cache.lengths = [n + 1 for n in cache.lengths]
        return logits

    def objects(self, into_dicts: bool = False) -> Iterator[object]:
        """Every object the resident weights hold, once each, tensors included, from the same roots; with
        `into_dicts`, also what their dicts hold (a weight's cached budget views). A loop, not a recursive
        closure: that made a reference cycle through `seen`, which kept every tensor alive until the cyclic
        collector ran (a load's replaced weights: 430 MiB more after loading bench_memory's model)."""
        seen: set[int] = set()
        todo: list = [self.embed, self.layers, self.norm_f, self.lm_head]
        while todo:
            obj = todo.pop()
            if id(obj) in seen or isinstance(obj, type):
                continue
            seen.add(id(obj))
            yield obj
            if isinstance(obj, torch.Tensor):
                continue
            if isinstance(obj, (list, tuple)):
                todo.extend(reversed(obj))
            elif isinstance(obj, dict):
                if into_dicts:
                    todo.extend(reversed(obj.values()))
            elif hasattr(obj, "__dict__"):
                todo.extend(reversed(vars(obj).values()))

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct tensor the resident weights hold, packed quantized ones included (for memory
        accounting: `sum(t.nbytes for t in net.tensors())` is what the weights occupy)."""
        seen: dict[int, torch.Tensor] = {}
        for obj in self.objects():
            if isinstance(obj, torch.Tensor) and obj.numel():
                seen.setdefault(obj.data_ptr(), obj)
        return list(seen.values())

    def transpose_weights(self, panels: bool = False) -> None:
        """Keep every float Linear weight in the CPU inference layout, in place (peak: one extra tensor):
        column panels for the decode kernels (`linear.Panels`; bf16 weights stay bf16, the kernels widen
        them as they read) with `panels`, else the plain transpose in the network's dtype
        (`linear.Transposed`, torch's matmul). With `panels` quantized weights take their format's CPU
        layout where it has one (`cpu_layout`: FP8's panels). The router gate and a tied LM head stay as
        they are; not for training (autograd and the optimizer hold the [out, in] tensors)."""
        def layout(w):
            if isinstance(w, torch.Tensor):
                return w if w.requires_grad else Panels.of(w) if panels else Transposed.of(w.to(self.dtype))
            if panels and hasattr(w, "cpu_layout"):
                return w.cpu_layout()
            if isinstance(w, list):  # a MoE layer's packed experts, one at a time
                return [layout(e) for e in w]
            return w

        for layer in self.layers:
            for name in ("in_proj", "out_proj", "qkv", "o_proj", "up", "down", "shared_up", "shared_down"):
                w = getattr(layer.mixer, name, None)
                if w is not None:
                    setattr(layer.mixer, name, layout(w))
        if isinstance(self.lm_head, torch.Tensor) and self.lm_head is not self.embed \
                and not self.lm_head.requires_grad:
            self.lm_head = layout(self.lm_head)
        self.c_steps.clear()  # they point at the weights just replaced
        self.c_floats.clear()

    def silence(self, token: int) -> None:
        """Pin `token`'s logit at 0 by zeroing its LM-head row (random-weight models in tests and benchmarks
        that must never close thinking by themselves)."""
        head = self.lm_head
        if isinstance(head, Panels):
            q, c = head.column(token)
            head.p[q, :, c].zero_()
        else:
            (head.t[:, token] if isinstance(head, Transposed) else head[token]).zero_()

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def _budget(self, budget: Budget | None) -> Budget:
        if budget is None or budget in self._fitting:  # checked once per budget: every decode step asks
            return self.resident if budget is None else budget
        if not budget.fits_in(self.resident):
            raise ValueError(f"budget {budget.name!r} is larger than the resident budget "
                             f"{self.resident.name!r}; load the checkpoint with a larger budget")
        self._fitting.add(budget)
        return budget

    def new_cache(self, batch_size: int = 1, budget: Budget | None = None, capacity: int = 0) -> HybridCache:
        """Zeroed states for `batch_size` rows. KV caches grow by doubling; a `capacity` (prompt plus
        tokens to generate) allocates them once, which keeps peak memory at what the planner predicts."""
        b, cfg = self._budget(budget), self.cfg
        G, p, N, K = cfg.n_groups, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.conv_kernel
        states: list[KVCache | MambaState | None] = []
        for s in b.layers:
            if s.kind == "M" and s.enabled:
                conv = torch.zeros(batch_size, s.mamba_heads * p + 2 * G * N, K, dtype=self.dtype, device=self.device)
                ssm = torch.zeros(batch_size, G, s.mamba_heads // G, p, N, dtype=torch.float32, device=self.device)
                states.append(MambaState(conv, ssm))
            elif s.kind == "*" and s.enabled:
                shape = (batch_size, cfg.num_key_value_heads, capacity, cfg.head_dim)
                kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
                states.append(KVCache(kv, kv.clone()))
            else:
                states.append(None)
        return HybridCache(b, states, [0] * batch_size)

    def forward(self, ids: torch.Tensor, budget: Budget | None = None, cache: HybridCache | None = None,
                last_only: bool = False, soft: list[SoftLayer | None] | None = None,
                soft_hidden: SoftSize | None = None) -> torch.Tensor:
        """Logits (float32) of `ids` [B, T]. With a cache, continues the cached sequences and advances them;
        long inputs are prefilled in chunks of `prefill_chunk` tokens to bound activation memory. It builds an
        autograd graph when weights require grad (training); runtime callers wrap it in inference_mode.
        `soft` (router training only, see soft.py): per layer, axes whose size is a mix of candidates;
        `soft_hidden` the same for the hidden width (embeddings, every norm, every block's output)."""
        b = self._budget(budget if cache is None else cache.budget)
        if cache is not None and budget is not None and budget != cache.budget:
            raise ValueError(f"this cache belongs to budget {cache.budget.name!r}, not {budget.name!r}")
        T = ids.shape[1]
        plain = cache is not None and soft is None and soft_hidden is None and self.observer is None
        rows = ids.shape[0]
        # the C step (CPU): a token of each row, or a short prompt of one sequence as the rows of one step
        if plain and rows == cache.batch_size and (T == 1 or (rows == 1 and 1 < T <= step.PREFILL_ROWS)):
            if (c_step := self._c_step(cache)) is not None:
                if T > 1:
                    return c_step.prefill(ids[0].tolist(), cache, last_only)
                if rows == 1:
                    return c_step(int(ids[0, 0]), cache)[:, None]
                return c_step.rows(ids[:, 0].tolist(), cache)[:, None]
        if plain and T == 1:
            if self.graphs is not None and torch.is_inference_mode_enabled():
                return self._graphed_step(ids, b, cache)
            if self.compiled is not None and torch.is_inference_mode_enabled():
                return self._compiled_step(ids, b, cache)
        if cache is None or T <= self.prefill_chunk:
            return self._forward(ids, b, cache, last_only, soft, soft_hidden)
        outs = [self._forward(ids[:, i:i + self.prefill_chunk], b, cache, last_only, soft, soft_hidden)
                for i in range(0, T, self.prefill_chunk)]
        return outs[-1] if last_only else torch.cat(outs, dim=1)

    def decode_token(self, token: int, cache: HybridCache) -> torch.Tensor:
        """Logits [1, V] of one sequence's next `token`, advancing `cache`: batch-1 decode without building a
        tensor of one id (the engine's loop; on a small model the ops around a step cost a fifth of it)."""
        if self.observer is None and cache.batch_size == 1 and (c_step := self._c_step(cache)) is not None:
            return c_step(token, cache)
        return self.forward(torch.tensor([[token]], device=self.device), cache=cache)[:, -1]

    def advance_rows(self, seqs: list[list[int]], cache: HybridCache, rows: list[int]) -> torch.Tensor | None:
        """Logits [len(rows), V] of `rows` of a batched cache, row rows[j] consuming seqs[j] (one token where
        it decodes, up to step.PREFILL_ROWS where it catches up), each its last token's, in place in one C
        step (the other rows' states stay as they are, none copied out and back), or None where only
        `forward` on those rows' own cache serves it."""
        if self.observer is None and (c_step := self._c_step(cache)) is not None:
            return c_step.sequences(seqs, cache, rows)
        return None

    def decode_ahead(self, token: int, cache: HybridCache, n: int, stops: Collection[int],
                     halt: torch.Tensor | None = None,
                     draw: tuple[sample.Params, torch.Generator | None] | None = None) -> list[int] | None:
        """Up to `n` tokens of one sequence after `token` in one call of the C step (`DecodeStep.ahead`:
        where the Python around a step costs a small model a third of its tokens), greedy or drawn with
        `draw`, or None where only `decode_token` serves this cache."""
        if self.observer is None and cache.batch_size == 1 and (c_step := self._c_step(cache)) is not None:
            return c_step.ahead(token, cache, n, stops, halt, draw)
        return None

    def _c_step(self, cache: HybridCache) -> step.DecodeStep | None:
        """The C step of the cache's budget where it can advance this cache: it computes no gradients, so
        only without grad mode (inference_mode, no_grad); built once per budget."""
        if torch.is_grad_enabled():
            return None
        c_step = self._step_of(cache.budget)
        return c_step if c_step is not None and step.serves(cache, self.dtype) else None

    def _step_of(self, b: Budget) -> step.DecodeStep | None:
        if b not in self.c_steps:
            self.c_steps[b] = step.build(self, b)
        return self.c_steps[b]

    def steps_rows_in_place(self, b: Budget) -> bool:
        """Whether some rows of a batched cache of budget `b` step where they lie (`advance_rows`: the C step),
        rather than on a copy of theirs (what the engine's sub-batches then hold: engine/cacheset.py)."""
        return self.observer is None and self._step_of(b) is not None

    def _forward(self, ids: torch.Tensor, b: Budget, cache: HybridCache | None, last_only: bool,
                 soft: list[SoftLayer | None] | None = None, soft_hidden: SoftSize | None = None) -> torch.Tensor:
        start, lengths = 0, None
        if cache is not None:
            if len(set(cache.lengths)) == 1:
                start = cache.lengths[0]
            else:
                lengths = torch.tensor(cache.lengths, device=ids.device)
        logits = self._layers(ids, None if cache is None else cache.layers, b, start, lengths, last_only, soft,
                              soft_hidden)
        if cache is not None:
            cache.lengths = [n + ids.shape[1] for n in cache.lengths]
        return logits

    def _layers(self, ids: torch.Tensor, states: list | None, b: Budget, start: int = 0,
                lengths: torch.Tensor | None = None, last_only: bool = False,
                soft: list[SoftLayer | None] | None = None, soft_hidden: SoftSize | None = None,
                static: bool = False, sync_free: bool = False) -> torch.Tensor:
        """The network over `ids` continuing `states` (a cache's layers, advanced in place): embeddings,
        every enabled block, the final norm and the LM head. `static`: no shape depends on the positions
        (attention covers the cache's capacity); `sync_free`: no value is read back to the host either
        (the MoE gathers its experts), so a CUDA graph can record the step (graphs.py)."""
        cfg, d = self.cfg, b.hidden
        eps = cfg.layer_norm_epsilon
        norm = rms_norm if soft_hidden is None else soft_hidden.rms_norm
        width = None if soft_hidden is None else soft_hidden.keep(d)  # channels past a candidate width stay 0
        h = torch.nn.functional.embedding(ids, self.embed[:, :d])
        if width is not None:
            h = h * width.to(h.dtype)
        for i, (layer, s) in enumerate(zip(self.layers, b.layers)):
            if not s.enabled:
                continue
            state = None if states is None else states[i]
            sl = (soft[i] if soft is not None else None) or {}
            x = norm(h, layer.norm[:d], eps)
            if self.observer is not None:
                self.observer(i, "input", x)
            if s.kind == "M":
                obs = None if self.observer is None else partial(self.observer, i, "mamba_y")
                x = mamba_mixer(x, layer.mixer, s.mamba_heads, cfg, state, obs, sl.get("mamba_heads"))
            elif s.kind == "*":
                x = attention(x, layer.mixer, s.attention_heads, cfg, state, start, lengths, sl.get("attention_heads"),
                              static)
            elif s.kind == "E":
                x = moe(x, layer.mixer, s.experts, s.expert_channels, s.shared_channels, cfg, sl, sync_free)
            else:
                keep = unit_weights(sl, "mlp_channels", s.mlp_channels)
                x = mlp(x, layer.mixer.up, layer.mixer.down, s.mlp_channels, keep)
            h = h + (x if width is None else x * width.to(x.dtype))
        if last_only:
            h = h[:, -1:]
        h = norm(h, self.norm_f[:d], eps)
        return linear(h, block(self.lm_head, 0, self.lm_head.shape[0], d)).float()
