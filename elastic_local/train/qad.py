"""Quantization-aware distillation: the student's Linears seen through the stored FP8 / NVFP4 format.

Each quantized Linear's weight is replaced in the network by a `FakeQuant` view of its trainable
parameter. Its forward uses dequantize(quantize(w)) computed by the project's own quantizers on the
tensor exactly as `quantize` will store it (the parent's dtype, the file's column order, one scale per
stored tensor: q, k and v and every expert on their own), so the trained forward equals the exported
file's. Gradients pass straight through to the full-precision weight. Budgets still slice prefixes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..model.attention import AttentionWeights
from ..model.linear import RowConcat
from ..model.mamba2 import MambaWeights
from ..model.moe import MLPWeights, MoEWeights
from ..model.nemotron_h import NemotronH
from ..quant.scheme import is_quantized, quantize
from .weights import file_column_order


class FakeQuant:
    """A weight [out, in] = `source()` whose forward is its quantized-and-dequantized value."""

    def __init__(self, source: Callable[[], torch.Tensor], precision: str, dtype: torch.dtype, name: str,
                 columns: torch.Tensor | None = None, cut: tuple[int, int, int] | None = None):
        self.source, self.precision, self.dtype, self.name = source, precision, dtype, name
        self.columns = columns  # file column of each resident column (reordered heads), or None
        w = source()
        self.cut = cut or (0, w.shape[0], w.shape[1])
        self.shape = torch.Size((self.cut[1] - self.cut[0], self.cut[2]))

    def weight(self) -> torch.Tensor:
        w = self.source()
        stored = w.detach().to(self.dtype)
        if self.columns is not None:
            stored = stored.index_select(1, torch.argsort(self.columns))
        deq = quantize(stored, self.precision, self.name).dequantize(w.dtype)
        if self.columns is not None:
            deq = deq.index_select(1, self.columns)
        q = w + (deq - w).detach()  # straight-through: the forward sees deq, the gradient reaches w
        r0, r1, cols = self.cut
        return q[r0:r1, :cols]

    def block(self, r0: int, r1: int, cols: int) -> FakeQuant:
        base = self.cut[0]
        return FakeQuant(self.source, self.precision, self.dtype, self.name, self.columns,
                         (base + r0, base + r1, cols))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight().to(x.dtype))


def fake_quantize(net: NemotronH, precision: str, dtypes: dict[str, torch.dtype], keep: list[str] = ()) -> int:
    """Put FakeQuant views over every Linear `quantize` would quantize; `dtypes`: the parent's stored dtype
    per canonical tensor name. Returns how many stored tensors are fake-quantized."""
    cols = file_column_order(net)
    cfg, count = net.cfg, 0

    def fq(name: str, source: Callable[[], torch.Tensor], columns=None):
        nonlocal count
        if not is_quantized(name, keep):
            return source()
        count += 1
        return FakeQuant(source, precision, dtypes.get(name, torch.bfloat16), name, columns)

    for i, layer in enumerate(net.layers):
        w, m = layer.mixer, f"layers.{i}.mixer."
        if isinstance(w, MambaWeights):
            p_in, p_out = w.in_proj, w.out_proj
            w.in_proj = fq(m + "in_proj.weight", lambda p=p_in: p)
            w.out_proj = fq(m + "out_proj.weight", lambda p=p_out: p, cols[m + "out_proj"])
        elif isinstance(w, AttentionWeights):
            KV, hd = cfg.num_key_value_heads, cfg.head_dim
            qkv, o = w.qkv, w.o_proj
            q = w.q_heads(hd, KV) * hd
            bounds = {"q_proj": (0, q), "k_proj": (q, q + KV * hd), "v_proj": (q + KV * hd, q + 2 * KV * hd)}
            w.qkv = RowConcat([fq(m + f"{n}.weight", lambda p=qkv, a=a, b=b: p[a:b]) for n, (a, b) in bounds.items()])
            w.o_proj = fq(m + "o_proj.weight", lambda p=o: p, cols[m + "o_proj"])
        elif isinstance(w, MoEWeights):
            up, down = w.up, w.down
            w.up = [fq(m + f"experts.{e}.up_proj.weight", lambda p=up, e=e: p[e]) for e in range(up.shape[0])]
            w.down = [fq(m + f"experts.{e}.down_proj.weight", lambda p=down, e=e: p[e]) for e in range(down.shape[0])]
            su, sd = w.shared_up, w.shared_down
            w.shared_up = fq(m + "shared_experts.up_proj.weight", lambda p=su: p)
            w.shared_down = fq(m + "shared_experts.down_proj.weight", lambda p=sd: p)
        elif isinstance(w, MLPWeights):
            u, d = w.up, w.down
            w.up = fq(m + "up_proj.weight", lambda p=u: p)
            w.down = fq(m + "down_proj.weight", lambda p=d: p)
    return count
