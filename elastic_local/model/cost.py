"""The network's own costs: what the fit planner, `info` and the batch runner read instead of copying.

- `PREFILL_CHUNK`: tokens per prefill step (NemotronH's default), which bounds activation memory.
- `NATIVE_CAPABILITY`: the CUDA compute capability from which each precision runs natively; on CPUs
  only bf16 (and fp32) do, FP8 and NVFP4 weights dequantize inside the matmul (quant/linear.py).
- `ArchShape` / `arch_shape`: the sizes of a budget that drive cache and workspace memory, with the
  bytes of its KV cache, Mamba state and one prefill chunk's workspace, as this network allocates them
  (nemotron_h.py `new_cache`: KV and conv state in the compute dtype, SSM state in fp32).
Weight bytes per precision are the quantized formats' (quant/scheme.py `weight_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .budget import Budget
from .config import NemotronHConfig

PREFILL_CHUNK = 1024
NATIVE_CAPABILITY = {"bf16": (8, 0), "fp8": (8, 9), "nvfp4": (10, 0)}
NATIVE_NEEDS = {"bf16": "sm_80+", "fp8": "sm_89+", "nvfp4": "sm_100/sm_120"}


def runs_natively(precision: str, capability: tuple[int, int] | None) -> bool:
    """Whether this runtime computes `precision` in that precision on a GPU of `capability` (None: a CPU)."""
    if capability is None:
        return precision == "bf16"
    return capability >= NATIVE_CAPABILITY[precision]


@dataclass(frozen=True)
class ArchShape:
    """Sizes of one budget that drive cache and workspace memory (Nemotron-H names in comments)."""

    hidden_size: int
    vocab_size: int
    attn_layers: int  # '*' blocks
    attn_heads: int  # query heads (num_attention_heads)
    kv_heads: int  # num_key_value_heads
    head_dim: int
    mamba_layers: int  # 'M' blocks
    mamba_heads: int  # mamba_num_heads
    mamba_head_dim: int
    ssm_state: int  # ssm_state_size
    conv_dim: int  # d_inner + 2 * n_groups * ssm_state: the channels the conv1d sees (xBC)
    conv_kernel: int
    mamba_chunk: int = 128  # SSD chunk length of the chunked scan
    n_experts: int = 0  # routed experts resident in this budget ('E' blocks)
    moe_topk: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0  # the shared expert's intermediate size
    mlp_intermediate: int = 0  # dense '-' blocks

    @property
    def d_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    def kv_bytes(self, context: int, dtype_bytes: int = 2) -> int:
        """One sequence's KV cache for `context` tokens: K and V of every attention layer."""
        return 2 * self.attn_layers * self.kv_heads * self.head_dim * context * dtype_bytes

    def state_bytes(self, conv_len: int | None = None, conv_dtype_bytes: int = 4) -> int:
        """One sequence's Mamba state, constant in context: conv window + fp32 SSM state per layer.

        conv_len defaults to conv_kernel (the last K inputs, SPEC section 3); vLLM keeps conv_kernel - 1.
        """
        conv = (self.conv_kernel if conv_len is None else conv_len) * self.conv_dim * conv_dtype_bytes
        ssm = self.mamba_heads * self.mamba_head_dim * self.ssm_state * 4
        return self.mamba_layers * (conv + ssm)

    def largest_linear(self) -> int:
        """Elements of the largest quantizable weight matrix (lm_head and embeddings stay high precision)."""
        h = self.hidden_size
        return max(
            h * (self.d_inner + self.conv_dim + self.mamba_heads),  # Mamba in_proj: z | xBC | dt
            h * self.attn_heads * self.head_dim,  # q_proj / o_proj
            h * self.moe_intermediate, h * self.shared_intermediate, h * self.mlp_intermediate,
        )

    def workspace_bytes(self, tokens: int, logits_tokens: int, act_bytes: int = 2,
                        dequant: bool = False, graph_rows: int = 0, packed: bool = False) -> int:
        """Peak activation memory of one prefill chunk of `tokens` (batch folded in), one layer at a time.

        Per token, the residual stream (act) plus its fp32 RMSNorm output and fp32 mixer output, plus the
        widest mixer's intermediates:
          mamba: in_proj out (d_inner + conv_dim + heads), conv out (conv_dim), y and gated y (2 d_inner)
                 in fp32; the SSD scan's decay matrix and its C.B-weighted twin (2 x heads x chunk, fp32)
                 and the per-chunk states (heads x head_dim x state / chunk, fp32)
          moe:   router scores (n_experts, fp32); per routed slot the gathered input and the output
                 (2 hidden) and up and activated (2 moe_intermediate); shared expert (2 shared) in act
          attn:  q, k, v and output ((2 attn_heads + 2 kv_heads) x head_dim) in act; a fused SDPA kernel
                 (flash / memory-efficient / CPU flash) is assumed: no tokens x context score matrix
          mlp:   up and activated (2 mlp_intermediate) in act
        Plus the logits of `logits_tokens` positions, lm_head output and its fp32 copy (vocab x (act + 4)),
        plus, when the precision is not native, one dequantized weight matrix in bf16, plus, for CUDA-graph
        decode steps of `graph_rows` rows in all, the routed experts' weights each row gathers
        (moe._experts_gathered): float ones, the up and down of all k at once; `packed` ones, one slot's
        up and down dequantized, with 5 bytes an element of one matrix for its gathered codes (at most
        1) and their int32 table index (4). A graph's memory pool is its own for as long as it
        lives, beside the prefill's, and reuses those copies layer after layer.
        """
        a = act_bytes
        stream = self.hidden_size * (a + 4 + 4)
        mamba = 4 * (self.d_inner + self.conv_dim + self.mamba_heads + self.conv_dim + 2 * self.d_inner)
        mamba += 4 * 2 * self.mamba_heads * self.mamba_chunk
        mamba += 4 * self.mamba_heads * self.mamba_head_dim * self.ssm_state // self.mamba_chunk
        moe = 4 * self.n_experts + a * (self.moe_topk * (2 * self.hidden_size + 2 * self.moe_intermediate)
                                        + 2 * self.shared_intermediate)
        attn = a * (2 * self.attn_heads + 2 * self.kv_heads) * self.head_dim
        mlp = a * 2 * self.mlp_intermediate
        per_token = stream + max(mamba if self.mamba_layers else 0, moe, attn if self.attn_layers else 0, mlp)
        logits = logits_tokens * self.vocab_size * (a + 4)
        expert = self.hidden_size * self.moe_intermediate  # elements of one expert's up (or down)
        gathered = graph_rows * expert * ((2 * a + 5) if packed else self.moe_topk * 2 * a)
        return tokens * per_token + logits + (2 * self.largest_linear() if dequant else 0) + gathered


def arch_shape(cfg: NemotronHConfig, b: Budget) -> ArchShape:
    """The sizes of a budget that drive cache and workspace memory. A heterogeneous budget's per-layer
    sizes are summarised by their largest value: an upper bound on its Mamba state and workspace."""
    on = [s for s in b.layers if s.enabled]

    def most(kind: str, axis: str) -> int:
        return max((getattr(s, axis) for s in on if s.kind == kind), default=0)

    heads = most("M", "mamba_heads")
    return ArchShape(
        hidden_size=b.hidden, vocab_size=cfg.vocab_size,
        attn_layers=sum(s.kind == "*" for s in on), attn_heads=most("*", "attention_heads"),
        kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        mamba_layers=sum(s.kind == "M" for s in on), mamba_heads=heads, mamba_head_dim=cfg.mamba_head_dim,
        ssm_state=cfg.ssm_state_size, conv_dim=heads * cfg.mamba_head_dim + 2 * cfg.n_groups * cfg.ssm_state_size,
        conv_kernel=cfg.conv_kernel, mamba_chunk=cfg.chunk_size,
        n_experts=most("E", "experts"), moe_topk=cfg.num_experts_per_tok,
        moe_intermediate=most("E", "expert_channels"), shared_intermediate=most("E", "shared_channels"),
        mlp_intermediate=most("-", "mlp_channels"),
    )
