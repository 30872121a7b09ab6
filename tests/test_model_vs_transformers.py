"""Our network against transformers' NemotronHForCausalLM (an independent implementation)."""

import pytest
import torch
from tiny import hf_logits, make_checkpoint

import elastic_local
from elastic_local.model import HybridCache

CONFIGS = {
    # every block kind, 2 Mamba groups, GQA 4/2, chunk 4 with T = 11 (chunks smaller than and not dividing T)
    "all_kinds": dict(),
    # MoE with group-limited routing (n_group > 1) and a Nemotron-Nano-like pattern
    "grouped_router": dict(hybrid_override_pattern="MEMEM*EMEME", n_group=2, topk_group=1,
                           num_experts_per_tok=3, n_routed_experts=8),
    # a chunk larger than the sequence, 4 Mamba groups, plain multi-head attention
    "one_chunk_mha": dict(chunk_size=16, n_groups=4, num_key_value_heads=4, hybrid_override_pattern="*M-M"),
    # one group, 8-way GQA, unnormalised top-k weights
    "one_group": dict(n_groups=1, num_attention_heads=8, num_key_value_heads=1, norm_topk_prob=False,
                      hybrid_override_pattern="EM*M", chunk_size=3),
    # tie_word_embeddings: transformers still writes (and runs) its own lm_head.weight
    "tied": dict(tie_word_embeddings=True, hybrid_override_pattern="-M*E"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_equal_transformers(tmp_path, name):
    hf = make_checkpoint(tmp_path, seed=1, **CONFIGS[name])
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    ours = elastic_local.load(tmp_path).logits(ids)
    ref = hf_logits(hf, ids)
    assert ref.abs().max() > 1.0  # the random model is not degenerate
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_then_decode_gives_full_forward_logits(tmp_path, name):
    hf = make_checkpoint(tmp_path, seed=2, **CONFIGS[name])
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(hf, ids)
    m = elastic_local.load(tmp_path)
    cache = m.new_cache(batch_size=2)
    steps = [m.forward(ids[:, :6], cache)]
    for t in range(6, 13):
        steps.append(m.forward(ids[:, t:t + 1], cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), ref, atol=1e-4, rtol=0)
    assert cache.lengths == [13, 13]


def test_chunked_prefill_continues_the_cache_exactly(tmp_path):
    hf = make_checkpoint(tmp_path, seed=3)
    ids = torch.randint(0, 96, (1, 23), generator=torch.Generator().manual_seed(2))
    m = elastic_local.load(tmp_path)
    m.net.prefill_chunk = 5  # 5 + 5 + 5 + 5 + 3, each chunk attending to the cached prefix
    cache = m.new_cache()
    out = m.forward(ids, cache)
    torch.testing.assert_close(out, hf_logits(hf, ids), atol=1e-4, rtol=0)
    last = m.forward(ids[:, :1], cache, last_only=True)
    assert last.shape == (1, 1, 96)


def test_rows_at_different_positions_decode_together(tmp_path):
    make_checkpoint(tmp_path, seed=4)
    m = elastic_local.load(tmp_path)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 96, (1, 9), generator=g), torch.randint(0, 96, (1, 5), generator=g)
    caches = [m.new_cache(), m.new_cache()]
    m.forward(a[:, :-1], caches[0])
    m.forward(b[:, :-1], caches[1])
    batch = HybridCache.stack(caches)  # rows at positions 8 and 4
    assert batch.lengths == [8, 4]
    out = m.forward(torch.cat([a[:, -1:], b[:, -1:]]), batch)
    torch.testing.assert_close(out[0], m.logits(a)[0, -1:], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], m.logits(b)[0, -1:], atol=1e-4, rtol=0)
