"""The decode step on the CPU in C: one call per token (step.c), its arguments built once per budget; a
batch's rows in one call too (`DecodeStep.rows`: every product once for all of them), and a short prompt
as the rows of one call (`DecodeStep.prefill`).

Why: batch-1 decode of a small model is a few thousand small torch ops per token whose dispatch, not the
weights, sets the speed (docs/decode-speed.md, CPU decode kernels). step.c runs each block (norm, projections, the
mixer's state update, the residual add) in one function on gemv.c's products, and a token through every
block and the head in one call (a call per block cost about 6 us each). The budget's weights are the
same prefix views the torch path cuts (`linear.block`), described once as pointers and strides: no
copies, every format the decode kernels read.

It serves one token of each sequence of a float32 model (the CPU default) or a bfloat16 one, computing in
float32 either way: a bfloat16 model's embedding, convolution states and K / V caches stay bf16 (step.c
widens them as it reads them and rounds what it writes, as the torch path stores them; the planner's
memory holds), and its norm and convolution weights, a few KiB a layer, are read from float32 copies,
one per tensor for every budget (`_floats`). On the torch path a bf16 token was a few thousand bf16 ops,
2.4x (full budget) to 5x (small) slower than this step, and slower on a smaller budget (gen16; docs/decode-speed.md).
`build` returns None (and the torch path runs) for what step.c does not cover: another device or dtype,
group-limited routing (n_group > 1), a weight split across parts (a quantized q|k|v is cut into its
parts, so only a foreign weight type ends here), or a CPU without the decode kernels.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import gemv, sample
from .budget import Budget
from .linear import Panels, block
from .threads import ThreadCounts

if TYPE_CHECKING:
    from .moe import MoEWeights
    from .nemotron_h import HybridCache, NemotronH

log = logging.getLogger(__name__)

_I, _P, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# step.c's weight formats; NVFP4_A4: NVFP4 whose inputs are rounded to NVFP4 too (W4A4, quant/nvfp4.py)
PANELS_F32, ROWS_F32, ROWS_BF16, FP8, NVFP4, PANELS_BF16, PANELS_FP8, NVFP4_A4 = range(8)


class Unsupported(Exception):
    """A weight or layer step.c does not read."""


class Weight(ctypes.Structure):
    """step.c's `weight`: a [out, in] weight view, x @ W.T."""

    _fields_ = [("format", _I), ("out", _I), ("inp", _I), ("ld", _I), ("ld_scales", _I),
                ("w", _P), ("scales", _P), ("scale", _F), ("skip", _I), ("input_scale", _F)]


def packed(fmt: int, codes: Tensor, scales: Tensor | None, scale: float, inputs: int,
           input_scale: float = 0.0) -> Weight:
    """A packed FP8 (codes [out, in] bytes) or NVFP4 (codes [out, in/2], e4m3 block scales) view; the
    quantized formats (elastic_local.quant) describe themselves through this."""
    if codes.stride(1) != 1 or (scales is not None and scales.stride(1) != 1):
        raise Unsupported("packed weight rows are not contiguous")
    return Weight(fmt, codes.shape[0], inputs, codes.stride(0), 0 if scales is None else scales.stride(0),
                  codes.data_ptr(), None if scales is None else scales.data_ptr(), scale, 0, input_scale)


def weight(w) -> Weight:
    """The description of any weight view `linear()` takes, or Unsupported."""
    if isinstance(w, Panels):
        p = w.p
        formats = {torch.float32: PANELS_F32, torch.bfloat16: PANELS_BF16}
        if p.dtype in formats and p.ndim == 3 and p.stride(2) == 1 and p.stride(1) == p.shape[2]:
            return Weight(formats[p.dtype], w.n, p.shape[1], p.stride(0), 0, p.data_ptr(), None, 1.0, w.skip)
    elif isinstance(w, Tensor):
        formats = {torch.float32: ROWS_F32, torch.bfloat16: ROWS_BF16}
        if w.dtype in formats and w.ndim == 2 and w.stride(1) == 1:
            return Weight(formats[w.dtype], w.shape[0], w.shape[1], w.stride(0), 0, w.data_ptr(), None, 1.0)
    elif hasattr(w, "step_weight"):
        return w.step_weight()
    raise Unsupported(f"a {type(w).__name__} weight")


def _floats(net: NemotronH, t: Tensor | None, keep: list, part: slice = slice(None)) -> int | None:
    """Address of t[part], a contiguous float32 vector / matrix (norm weights, conv weights, router): of a
    bf16 tensor, of its float32 copy, made once per tensor for every budget (`net.c_floats`; a bfloat16
    network's norms and convolution, a few KiB a layer). `keep` holds what the step points into."""
    if t is None:
        return None
    if t.dtype == torch.bfloat16 and t.is_contiguous():
        if id(t) not in net.c_floats:
            net.c_floats[id(t)] = (t, t.float())  # t kept with its copy: its id stays its own
        t = net.c_floats[id(t)][1]
    t = t[part]
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise Unsupported(f"a {t.dtype} / non-contiguous vector")
    keep.append(t)
    return t.data_ptr()


class Mamba(ctypes.Structure):
    _fields_ = [("norm", _P), ("z", Weight), ("x", Weight), ("bc", Weight), ("dt", Weight), ("out", Weight),
                ("conv_x", _P), ("conv_bc", _P), ("conv_bias_x", _P), ("conv_bias_bc", _P),
                ("dt_bias", _P), ("A", _P), ("D", _P), ("gate_norm", _P),
                ("d", _I), ("heads", _I), ("groups", _I), ("head_dim", _I), ("state", _I), ("conv_k", _I),
                ("dt_min", _F), ("dt_max", _F), ("eps", _F), ("in_proj", Weight), ("bf16", _I)]


class Attention(ctypes.Structure):
    _fields_ = [("norm", _P), ("q", Weight), ("k", Weight), ("v", Weight), ("o", Weight),
                ("d", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("eps", _F), ("bf16", _I)]


class MoE(ctypes.Structure):
    _fields_ = [("norm", _P), ("gate", _P), ("bias", _P), ("up", ctypes.POINTER(Weight)),
                ("down", ctypes.POINTER(Weight)), ("shared_up", Weight), ("shared_down", Weight),
                ("d", _I), ("experts", _I), ("top_k", _I), ("ld_gate", _I), ("norm_top_k", _I), ("hidden", _I),
                ("scaling", _F), ("eps", _F)]


class MLP(ctypes.Structure):
    _fields_ = [("norm", _P), ("up", Weight), ("down", Weight), ("d", _I), ("eps", _F)]


def _in_proj(w, rows: int, d: int) -> Weight:
    """in_proj's z | x | B, C | dt as one product, for a budget that keeps every head: one pass over whole
    rows and one barrier, not four (1-6% of a decode step, bench_ab.py). Weight() (out 0) where its format
    does not read as one: the parts run one by one. (Attention's q | k | v the same way: no gain measured.)"""
    try:
        return weight(block(w, 0, rows, d))
    except Unsupported:
        return Weight()


def _mamba(net: NemotronH, i: int, k: int, d: int, keep: list) -> Mamba:
    cfg, w = net.cfg, net.layers[i].mixer
    G, p, N = cfg.n_groups, cfg.mamba_head_dim, cfg.ssm_state_size
    n, gn, ip = w.heads, G * N, w.in_proj
    o = 2 * n * p  # in_proj rows: z [n*p] | x [n*p] | B, C [2*G*N] | dt [n] (mamba2.py)
    lo, hi = cfg.time_step_limit
    return Mamba(
        _floats(net, net.layers[i].norm, keep, slice(d)),
        weight(block(ip, 0, k * p, d)), weight(block(ip, n * p, n * p + k * p, d)),
        weight(block(ip, o, o + 2 * gn, d)), weight(block(ip, o + 2 * gn, o + 2 * gn + k, d)),
        weight(block(w.out_proj, 0, d, k * p)),
        _floats(net, w.conv_weight, keep, slice(k * p)), _floats(net, w.conv_weight, keep, slice(n * p, None)),
        _floats(net, w.conv_bias, keep, slice(k * p)), _floats(net, w.conv_bias, keep, slice(n * p, None)),
        _floats(net, w.dt_bias, keep, slice(k)), _floats(net, w.A, keep, slice(k)), _floats(net, w.D, keep, slice(k)),
        _floats(net, w.norm, keep, slice(k * p)),
        d, k, G, p, N, w.conv_weight.shape[1], lo, hi, cfg.layer_norm_epsilon,
        _in_proj(ip, o + 2 * gn + n, d) if k == n else Weight(), net.dtype == torch.bfloat16)


def _attention(net: NemotronH, i: int, heads: int, d: int, keep: list) -> Attention:
    cfg, w = net.cfg, net.layers[i].mixer
    hd, KV = cfg.head_dim, cfg.num_key_value_heads
    q_res = w.q_heads(hd, KV) * hd
    return Attention(
        _floats(net, net.layers[i].norm, keep, slice(d)), weight(block(w.qkv, 0, heads * hd, d)),
        weight(block(w.qkv, q_res, q_res + KV * hd, d)), weight(block(w.qkv, q_res + KV * hd, q_res + 2 * KV * hd, d)),
        weight(block(w.o_proj, 0, d, heads * hd)), d, heads, KV, hd, cfg.layer_norm_epsilon,
        net.dtype == torch.bfloat16)


def _moe(net: NemotronH, i: int, experts: int, channels: int, shared: int, d: int, keep: list) -> MoE:
    cfg, w = net.cfg, net.layers[i].mixer
    if cfg.n_group > 1:
        raise Unsupported("group-limited routing (n_group > 1)")
    gate = w.gate[:experts, :d]
    if gate.dtype != torch.float32 or gate.stride(1) != 1:
        raise Unsupported("a router weight that is not float32 rows")
    up, down = expert_weights(w, experts, channels, d)
    keep += [up, down]  # the arrays the struct points into
    return MoE(_floats(net, net.layers[i].norm, keep, slice(d)), gate.data_ptr(),
               _floats(net, w.bias, keep, slice(experts)), up, down,
               weight(block(w.shared_up, 0, shared, d)), weight(block(w.shared_down, 0, d, shared)),
               d, experts, cfg.num_experts_per_tok, gate.stride(0), int(cfg.norm_topk_prob), max(channels, shared),
               cfg.routed_scaling_factor, cfg.layer_norm_epsilon)


def expert_weights(w: MoEWeights, experts: int, channels: int, d: int) -> tuple[ctypes.Array, ctypes.Array]:
    """The up [channels, d] and down [d, channels] views of a budget's first `experts` experts, as step.c
    reads them (arrays of `weight`), or Unsupported."""
    up = (Weight * experts)(*(weight(block(w.up[e], 0, channels, d)) for e in range(experts)))
    down = (Weight * experts)(*(weight(block(w.down[e], 0, d, channels)) for e in range(experts)))
    return up, down


def _mlp(net: NemotronH, i: int, channels: int, d: int, keep: list) -> MLP:
    w = net.layers[i].mixer
    return MLP(_floats(net, net.layers[i].norm, keep, slice(d)), weight(block(w.up, 0, channels, d)),
               weight(block(w.down, 0, d, channels)), d, net.cfg.layer_norm_epsilon)


class Block(ctypes.Structure):
    _fields_ = [("kind", _I), ("args", _P)]


class Step(ctypes.Structure):
    """step.c's `step`: what a budget's decode step reads that does not change from token to token."""

    _fields_ = [("blocks", _P), ("n", _I), ("state", _P), ("capacity", _P), ("h", _P), ("embed", _P),
                ("ld_embed", _I), ("norm", _P), ("lm_head", _P), ("d", _I), ("eps", _F), ("balance", _P),
                ("embed_bf16", _I)]


BALANCED = 64  # step.c's: the most threads whose shares of the products a step keeps
# The most prompt tokens `prefill` takes in one decode_rows call; a longer prompt takes the torch layers, whose
# products read each weight once for all its rows (two calls of 64 lost to one pass of 128 on a 136M model
# whose weights stream from memory: 0.87-0.92x; up to 64, 1.04-1.78x there and 1.4-6.6x on the demo).
PREFILL_ROWS = 64


class DecodeStep:
    """Budget `b`'s decode step of `net` for one sequence: `step(token, cache)` -> logits [1, V].

    Its Python is what a token costs beside the C step, on every budget alike (a small budget's step is a
    quarter of a millisecond on the demo model), so a call sets only what changes: the K / V caches (they
    are replaced as they grow) and, when the cache is another one, the Mamba states (a cache's layers and
    Mamba states cannot be rebound, HybridCache: they are updated in place for its life)."""

    def __init__(self, net: NemotronH, b: Budget, lib: ctypes.CDLL):
        d, keep = b.hidden, []
        self.blocks: list[tuple[int, str, ctypes.Structure]] = []
        for i, s in enumerate(b.layers):
            if not s.enabled:
                continue
            if s.kind == "M":
                args = _mamba(net, i, s.mamba_heads, d, keep)
            elif s.kind == "*":
                args = _attention(net, i, s.attention_heads, d, keep)
            elif s.kind == "E":
                args = _moe(net, i, s.experts, s.expert_channels, s.shared_channels, d, keep)
            else:
                args = _mlp(net, i, s.mlp_channels, d, keep)
            self.blocks.append((i, s.kind, args))
        embed = net.embed
        if embed.dtype != net.dtype or embed.stride(1) != 1:
            raise Unsupported("an embedding that is not rows of the network's dtype")
        self.lm_head = weight(block(net.lm_head, 0, net.lm_head.shape[0], d))
        self.embed, self.h = embed, torch.empty(d)
        self.logits = torch.empty(self.lm_head.out)  # where `ahead` has the head write (its tokens are its result)
        n = len(self.blocks)
        self.table = (Block * n)(*(Block(ord(kind), ctypes.addressof(args)) for _, kind, args in self.blocks))
        self.state, self.capacity = (_P * (2 * n))(), (_I * max(n, 1))()  # the cache's
        self.attention = [(j, i) for j, (i, kind, _) in enumerate(self.blocks) if kind == "*"]
        # per thread count, the threads' shares of the products, learned call by call (step.c's rebalance):
        # [0] the thread count they are for (0: none yet, equal shares), then one per thread
        self.balances: dict[int, ctypes.Array] = {}
        self.threads = ThreadCounts()  # how many threads a call runs on (threads.py)
        self.calls = 0  # the first is not timed: it runs on cold caches
        self.args = Step(ctypes.addressof(self.table), n, ctypes.addressof(self.state),
                         ctypes.addressof(self.capacity), self.h.data_ptr(), embed.data_ptr(), embed.stride(0),
                         _floats(net, net.norm_f, keep, slice(d)), ctypes.addressof(self.lm_head), d,
                         net.cfg.layer_norm_epsilon, None, embed.dtype == torch.bfloat16)
        self._args = ctypes.byref(self.args)
        self._bound: weakref.ref[HybridCache] | None = None  # the cache whose Mamba states `state` holds
        self.lib, self.keep = lib, keep
        # One call at a time: the residual `h`, the state table and `logits` are this step's, not a call's.
        # Two threads decoding the same budget at once (a Stream on the engine's thread, `generate` on the
        # caller's) read each other's caches through them: wrong tokens, or a crash where one's K / V cache
        # is shorter than the other's position.
        self._lock = threading.Lock()

    def __call__(self, token: int, cache: HybridCache) -> Tensor:
        logits = torch.empty(1, self.lm_head.out)
        with self._lock:
            pos = self._prepare([token], cache, cache.lengths[0] + 1)
            count, _ = self._threads(1)
            start = time.perf_counter()
            if self.lib.decode_token(self._args, token, pos, logits.data_ptr(), count):
                raise _out_of_memory(pos)
            self._timed(count, start, 1)
        cache.lengths = [pos + 1]
        return logits

    @property
    def shares(self) -> list[float] | None:
        """Each of torch's threads' share of the products as the last call on them left it (None: equal
        shares so far)."""
        balance = self.balance(torch.get_num_threads())
        team = int(balance[0])
        return list(balance[1:1 + team]) if team else None

    def _threads(self, n: int) -> tuple[int, int]:
        """The thread count for a call of up to n tokens, and its tokens (ThreadCounts.pick), its shares set."""
        count, n = self.threads.pick(torch.get_num_threads(), n, time.perf_counter())
        self.args.balance = ctypes.addressof(self.balance(count))
        return count, n

    def balance(self, count: int) -> ctypes.Array:
        """The shares step.c keeps for a team of `count` threads."""
        return self.balances.setdefault(count, (ctypes.c_double * (1 + BALANCED))())

    def _timed(self, count: int, start: float, tokens: int) -> None:
        end = time.perf_counter()
        if self.calls:
            self.threads.record(count, end - start, tokens, end)
        self.calls += 1

    def ahead(self, token: int, cache: HybridCache, n: int, stops: Collection[int], halt: Tensor | None = None,
              draw: tuple[sample.Params, torch.Generator | None] | None = None) -> list[int]:
        """Up to `n` tokens after `token` in one call (fewer where the call times another thread count:
        threads.py): each the first largest logit (numpy's argmax, the
        engine's greedy sampling), or with `draw` (parameters, generator) the token that the generator's
        next uniform number draws (sample.c), ending with the first of `stops`, or with the token during
        which `halt` (an int32 tensor another thread may set) became non-zero. The cache consumes `token`
        and every token returned but the last, as that many calls would, and the generator as many
        uniform numbers as tokens were drawn."""
        ends = (_I * max(len(stops), 1))(*stops)
        params = None if draw is None else ctypes.byref(draw[0])
        with self._lock:
            count, n = self._threads(n)  # a count timed for a few tokens: fewer than n
            out, u = (_I * n)(), None if draw is None else sample.Uniforms(n, draw[1])
            pos = self._prepare([token], cache, cache.lengths[0] + n)
            start = time.perf_counter()
            ran = self.lib.decode_ahead(self._args, token, pos, n, ends, len(stops),
                                        None if halt is None else halt.data_ptr(), params,
                                        None if u is None else u.u.data_ptr(), out, self.logits.data_ptr(), count)
            self._timed(count, start, ran)
        if ran == -1:
            raise _out_of_memory(pos)
        failed = ran < -1  # -2 - t: step t's logits were no numbers to draw from, its token consumed
        ran = -2 - ran if failed else ran
        cache.lengths = [pos + ran + failed]
        if u is not None:
            u.give_back(ran)
        if failed:
            raise ValueError(sample.NOT_FINITE)
        return out[:ran]

    def rows(self, tokens: list[int], cache: HybridCache, rows: list[int] | None = None) -> Tensor:
        """Logits [R, V] of one token for each of a batched cache's R rows (`rows` of them, in place, or all),
        each at its own position (step.c's decode_rows: every product once for all the rows); the cache
        consumes them."""
        return self.sequences([[t] for t in tokens], cache, rows)

    def sequences(self, seqs: list[list[int]], cache: HybridCache, rows: list[int] | None = None) -> Tensor:
        """Logits [S, V], each of its sequence's last token, of S rows of a batched cache (`rows` of them, in
        place, or all) taking their next tokens in one step: `seqs[j]` is what row rows[j] consumes, one
        token where it decodes, up to PREFILL_ROWS where it catches up (a short prompt, the tokens that
        close thinking) beside the others (step.c's decode_rows: every product once for all the tokens,
        each row's states carried from token to token). Each row's logits are the bits of its tokens run
        alone, where the weights are panels."""
        rows = list(range(cache.batch_size)) if rows is None else rows
        if (len(seqs) != len(rows) or len(set(rows)) != len(rows) or not set(rows) <= set(range(cache.batch_size))
                or not all(0 < len(s) <= PREFILL_ROWS for s in seqs)):
            raise ValueError(f"{[len(s) for s in seqs]} tokens for rows {rows} of a cache of {cache.batch_size} "
                             f"(1 to {PREFILL_ROWS} a row)")
        tokens = [t for s in seqs for t in s]
        pos = [cache.lengths[r] + k for r, s in zip(rows, seqs) for k in range(len(s))]
        logits = torch.empty(len(seqs), self.lm_head.out)
        with self._lock:
            self._prepare(tokens, cache, max(cache.lengths[r] + len(s) for r, s in zip(rows, seqs)))
            layers, strides = cache.layers, (_I * (2 * len(self.blocks)))()
            for j, (i, kind, _) in enumerate(self.blocks):
                s = layers[i]
                a, b = (s.conv, s.ssm) if kind == "M" else (s.k, s.v) if kind == "*" else (None, None)
                if a is not None:
                    strides[2 * j], strides[2 * j + 1] = (t.stride(0) * t.element_size() for t in (a, b))
            index = [r for r, s in zip(rows, seqs) for _ in s]
            self._decode_rows(tokens, pos, strides, index, [len(s) for s in seqs], last_only=True, logits=logits)
        for r, s in zip(rows, seqs):
            cache.lengths[r] += len(s)
        return logits

    def prefill(self, tokens: list[int], cache: HybridCache, last_only: bool) -> Tensor:
        """Logits [1, T, V] (`last_only`: [1, 1, V]) of one sequence's next T <= PREFILL_ROWS tokens, the cache
        consuming them: step.c's decode_rows with the tokens as the rows of one sequence (each product once
        for all of them, each Mamba group's state carried from token to token). The same bits as the tokens
        decoded one at a time, where the weights are panels."""
        R = len(tokens)
        assert 0 < R <= PREFILL_ROWS, R
        logits = torch.empty(1 if last_only else R, self.lm_head.out)
        with self._lock:
            pos = self._prepare(tokens, cache, cache.lengths[0] + R)
            strides = (_I * (2 * len(self.blocks)))()  # every row the one sequence's states
            self._decode_rows(tokens, list(range(pos, pos + R)), strides, None, [R], last_only=last_only,
                              logits=logits)
        cache.lengths = [pos + R]
        return logits[None]

    def _decode_rows(self, tokens: list[int], positions: list[int], strides: ctypes.Array, index: list[int] | None,
                     lengths: list[int], *, last_only: bool, logits: Tensor) -> None:
        """step.c's decode_rows on the prepared cache: token r into the cache's row index[r] (or the cache's
        one row), the tokens `lengths` sequences' in order, on torch's thread count and its shares, into
        logits [R, V] (`last_only`: each sequence's last token's, [S, V])."""
        R, S = len(tokens), len(lengths)
        starts = (_I * (S + 1))(0, *itertools.accumulate(lengths))
        rows = None if index is None else (_I * R)(*index)
        self.args.balance = ctypes.addressof(self.balance(torch.get_num_threads()))
        if self.lib.decode_rows(self._args, R, (_I * R)(*tokens), (_I * R)(*positions), strides, rows, S, starts,
                                int(last_only), logits.data_ptr(), torch.get_num_threads()):
            raise _out_of_memory(max(positions))

    def _prepare(self, tokens: list[int], cache: HybridCache, end: int) -> int:
        """Point the step at `cache`, its K / V caches grown to hold `end` positions (the furthest a row's
        tokens reach: one row's catch-up must not grow a batch's caches by its length), the tokens checked
        first; the position row 0's token takes."""
        for token in tokens:
            if not 0 <= token < self.embed.shape[0]:
                raise IndexError(f"token id {token} is outside the vocabulary (0..{self.embed.shape[0] - 1})")
        pos, state, layers = cache.lengths[0], self.state, cache.layers
        if self._bound is None or self._bound() is not cache:
            self._bind(cache)
        for j, i in self.attention:
            s = layers[i]
            if s.k.shape[2] < end:
                s.grow(end)
            state[2 * j], state[2 * j + 1], self.capacity[j] = s.k.data_ptr(), s.v.data_ptr(), s.k.shape[2]
        return pos

    def _bind(self, cache: HybridCache) -> None:
        """Point the state table at `cache`'s Mamba states (a weak reference: the step keeps no cache alive)."""
        for j, (i, kind, _) in enumerate(self.blocks):
            if kind == "M":
                s = cache.layers[i]
                self.state[2 * j], self.state[2 * j + 1] = s.conv.data_ptr(), s.ssm.data_ptr()
        self._bound = weakref.ref(cache)


def _out_of_memory(pos: int) -> MemoryError:
    return MemoryError(f"out of memory for the decode step's scratch buffer at position {pos} (a block's "
                       "activations, a few hundred KiB): free memory and retry")


def build(net: NemotronH, b: Budget) -> DecodeStep | None:
    """Budget `b`'s C decode step, or None where step.c does not cover the network (module docstring)."""
    if net.device.type != "cpu" or net.dtype not in (torch.float32, torch.bfloat16):
        return None
    lib = gemv.library()
    if lib is None:
        return None
    try:
        return DecodeStep(net, b, lib)
    except Unsupported as e:
        log.info("budget %r decodes on the torch path: step.c does not read %s", b.name, e)
        return None


def serves(cache: HybridCache, dtype: torch.dtype) -> bool:
    """Whether step.c can advance this cache of a `dtype` network (one sequence, or a batch's rows through
    `DecodeStep.rows`): its states contiguous (as `new_cache` and the engine's cache operations make them;
    a hand-built cache may not be), in `dtype` but for the SSM states, float32 in every network. Checked
    once per cache (`dense`): what replaces a state later (a KV cache growing) keeps it so."""
    if not cache.dense:
        cache.dense = all(t.is_contiguous() and t.dtype == (torch.float32 if name == "ssm" else dtype)
                          for s in cache.layers if s is not None for name, t in vars(s).items())
    return cache.dense
