"""Tiny random Nemotron-H checkpoints written by transformers (the independent oracle) in the hub layout."""

from __future__ import annotations

import math
from pathlib import Path

import torch

BASE = dict(
    vocab_size=96, hidden_size=32, hybrid_override_pattern="M*E-ME", num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=4,
    n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=4, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, routed_scaling_factor=2.5,
    norm_topk_prob=True, layer_norm_epsilon=1e-5,
    # transformers clamps dt at time_step_min, the shipped model does not: make the clamp a no-op
    time_step_min=1e-9,
)


def hf_config(**overrides):
    from transformers import NemotronHConfig

    kw = dict(BASE)
    kw.update(overrides)
    return NemotronHConfig(**kw)


def randomize(model, seed: int = 0) -> None:
    """Give every parameter a scale where each block matters and routing varies from token to token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(1, 8, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-3, 0.5, generator=g))
            elif name.endswith(".D"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.4 * torch.randn(p.shape, generator=g))
            elif name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


def make_checkpoint(path: Path, seed: int = 0, **overrides):
    """Write a random checkpoint with transformers' save_pretrained; returns the transformers model."""
    from transformers import NemotronHForCausalLM

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(hf_config(**overrides)).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    return model


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        # use_cache=False: transformers 5.x builds a cache whose layer 0 is a DummyLayer when the pattern
        # starts with an MoE or MLP block, then asks it for get_seq_length (AttributeError)
        return model(ids, use_cache=False).logits.float()


# 16-aligned sizes, so every budget cut is a whole NVFP4 block (Mamba: 8-wide heads x 2 groups per rank)
ALIGNED = dict(hidden_size=64, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
               n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               moe_shared_expert_intermediate_size=48, hybrid_override_pattern="M*EM-ME")


# A Nemotron-3-style chat template: ChatML, earlier assistant turns rendered as `<think></think>answer`,
# the generation prompt opening thinking (`<think>\n`) or closing it at once (`<think></think>`).
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n<think></think>' ~ m.content ~ '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' ~ ('<think>\\n' if enable_thinking is not defined or enable_thinking "
    "else '<think></think>') -}}"
    "{%- endif -%}"
)


def write_tokenizer(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """Save a 96-token tokenizer (tests/tiny.py's vocab_size) into a checkpoint dir: tokenizer.json and
    tokenizer_config.json. Ids 0-7 are <pad> <s> </s> <unk> <|im_start|> <|im_end|> <think> </think>;
    then byte-fallback tokens for 'é' and '€' (multi-byte characters split across tokens), a-z A-Z 0-9,
    a few punctuation marks and BPE merges. eos is <|im_end|>."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    byte_tokens = ["<0xC3>", "<0xA9>", "<0xE2>", "<0x82>", "<0xAC>"]  # é = C3 A9, € = E2 82 AC
    chars = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n.,?!':-")
    merges = [("t", "h"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), (" ", "t"), ("th", "e"), (" ", "a"),
              ("o", "n"), ("r", "e"), ("a", "t"), ("e", "n")]
    vocab: dict[str, int] = {}
    for t in specials + byte_tokens + chars + ["".join(m) for m in merges]:
        vocab.setdefault(t, len(vocab))
    assert len(vocab) == 96, len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
              "pad_token": "<pad>", "unk_token": "<unk>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
