"""Property-based tests over valid Nemotron-H configurations, against transformers' NemotronHForCausalLM.

Hypothesis draws a configuration (any hybrid pattern of M * E - from one layer up, hidden sizes and head
widths that are not powers of two, 1-3 Mamba groups, GQA ratios, experts with group-limited routing,
chunk sizes that do not divide the sequence, tied embeddings) and checks what a user would do with it:
load and run it (against transformers), nest it into two budgets and slice each (transformers loads the
slice; our budget view must equal it), quantize the nested file to FP8 and NVFP4 and load it, generate.
Profiles in conftest.py (`ci` by default, `soak` for long runs)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import assume, event, given
from hypothesis import strategies as st
from tiny import hf_logits, make_checkpoint, write_tokenizer

import elastic_local


@st.composite
def configs(draw, quantizable: bool = False) -> dict:
    """Overrides of tests/tiny.py's BASE config; `quantizable`: every Linear input a multiple of 16 (NVFP4
    blocks), as the formats require."""
    pattern = draw(st.text("M*E-", min_size=1, max_size=6))
    groups, per_group = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 4]))
    mamba_head_dim = draw(st.sampled_from([4, 6, 8, 12]))
    kv, q_per_kv, head_dim = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3])), \
        draw(st.sampled_from([8, 12, 16]))
    experts = draw(st.integers(2, 8))
    n_group = draw(st.sampled_from([g for g in (1, 2, 4) if experts % g == 0 and experts // g >= 2] or [1]))
    topk_group = draw(st.integers(1, n_group))
    top_k = draw(st.integers(1, min(experts, topk_group * experts // n_group)))
    cfg = dict(
        hybrid_override_pattern=pattern,
        hidden_size=draw(st.sampled_from([32, 48, 80] if quantizable else [24, 32, 40, 48, 80])),
        mamba_num_heads=groups * per_group, n_groups=groups, mamba_head_dim=mamba_head_dim,
        ssm_state_size=draw(st.sampled_from([4, 8, 16])), chunk_size=draw(st.sampled_from([2, 3, 4, 8, 16])),
        conv_kernel=draw(st.sampled_from([2, 4])),
        num_attention_heads=kv * q_per_kv, num_key_value_heads=kv, head_dim=head_dim,
        n_routed_experts=experts, n_group=n_group, topk_group=topk_group, num_experts_per_tok=top_k,
        moe_intermediate_size=draw(st.sampled_from([16, 32, 48])),
        moe_shared_expert_intermediate_size=draw(st.sampled_from([16, 32])),
        intermediate_size=draw(st.sampled_from([16, 32, 48])),
        norm_topk_prob=draw(st.booleans()), tie_word_embeddings=draw(st.booleans()),
    )
    if quantizable:
        assume(groups * per_group * mamba_head_dim % 16 == 0 and kv * q_per_kv * head_dim % 16 == 0)
    event(f"pattern length {len(pattern)}, kinds {''.join(sorted(set(pattern)))}")
    return cfg


def ids_of(seed: int, batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


@given(cfg=configs(), length=st.integers(1, 13), split=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_any_valid_configuration_runs_as_transformers_does(cfg, length, split, seed):
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_checkpoint(Path(tmp), seed=seed, **cfg)
        ids = ids_of(seed, 2, length)
        ref = hf_logits(hf, ids)
        m = elastic_local.load(tmp)
        torch.testing.assert_close(m.logits(ids), ref, atol=1e-4, rtol=0)
        # prefill a prefix, then decode the rest one token at a time through the cache
        split = min(split, length)
        cache = m.new_cache(batch_size=2)
        steps = [m.forward(ids[:, :split], cache)] + [m.forward(ids[:, t:t + 1], cache) for t in range(split, length)]
        torch.testing.assert_close(torch.cat(steps, dim=1), ref, atol=1e-4, rtol=0)


@given(cfg=configs(), lengths=st.lists(st.integers(1, 9), min_size=2, max_size=4), steps=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_any_configuration_decodes_a_batch_of_rows_at_their_own_positions_as_transformers_does(cfg, lengths, steps,
                                                                                             seed):
    """Rows prefilled alone to different lengths, stacked, then decoded together (on the CPU: the C step's rows,
    step.c's decode_rows), each row against transformers on its own sequence from scratch."""
    from elastic_local.model.nemotron_h import HybridCache

    with tempfile.TemporaryDirectory() as tmp:
        hf = make_checkpoint(Path(tmp), seed=seed, **cfg)
        m = elastic_local.load(tmp)
        seqs = [ids_of(seed + r, 1, n + steps)[0] for r, n in enumerate(lengths)]
        with torch.inference_mode():
            caches = []
            for s, n in zip(seqs, lengths):
                caches.append(m.new_cache())
                m.forward(s[None, :n], cache=caches[-1])
            cache = HybridCache.stack(caches)
            out = [m.forward(torch.stack([s[n + t] for s, n in zip(seqs, lengths)])[:, None], cache=cache)
                   for t in range(steps)]
        got = torch.cat(out, dim=1)
        for r, (s, n) in enumerate(zip(seqs, lengths)):
            torch.testing.assert_close(got[r], hf_logits(hf, s[None])[0, n:], atol=1e-4, rtol=0)


@given(cfg=configs(), lengths=st.lists(st.integers(0, 9), min_size=2, max_size=4),
       takes=st.lists(st.integers(0, 7), min_size=4, max_size=4), seed=st.integers(0, 2**16))
def test_any_configuration_steps_rows_that_catch_up_beside_rows_that_decode_as_transformers_does(cfg, lengths,
                                                                                               takes, seed):
    """Rows of a batched cache at their own lengths (0: a row that just joined) take 1 to 7 tokens each in
    one step (on the CPU: step.c's decode_rows with S sequences, `NemotronH.advance_rows`; a take of 0
    leaves the row out of the step), each row's last logits against transformers on its own sequence from
    scratch."""
    from elastic_local.model.nemotron_h import HybridCache

    takes = takes[:len(lengths)]
    assume(any(takes) and all(n + t > 0 for n, t in zip(lengths, takes)))
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_checkpoint(Path(tmp), seed=seed, **cfg)
        m = elastic_local.load(tmp)
        seqs = [ids_of(seed + r, 1, n + t)[0] for r, (n, t) in enumerate(zip(lengths, takes))]
        rows = [r for r, t in enumerate(takes) if t]
        with torch.inference_mode():
            caches = []
            for s, n in zip(seqs, lengths):
                caches.append(m.new_cache())
                if n:
                    m.forward(s[None, :n], cache=caches[-1])
            cache = HybridCache.stack(caches)
            got = m.net.advance_rows([seqs[r][lengths[r]:].tolist() for r in rows], cache, rows)
        if got is None:  # no C step here (another CPU): torch's layers serve batches, tested above
            event("no C step")
            return
        assert cache.lengths == [n + t for n, t in zip(lengths, takes)]
        for j, r in enumerate(rows):
            torch.testing.assert_close(got[j], hf_logits(hf, seqs[r][None])[0, -1], atol=1e-4, rtol=0)


@given(cfg=configs(quantizable=True), seed=st.integers(0, 2**16))
def test_any_quantizable_configuration_nests_slices_quantizes_and_generates(cfg, seed):
    from transformers import NemotronHForCausalLM

    from elastic_local.elastic.nest import nest
    from elastic_local.elastic.slice import slice_budget
    from elastic_local.ptq import quantize_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_checkpoint(root / "parent", seed=seed, **cfg)
        write_tokenizer(root / "parent")
        try:
            nest(root / "parent", root / "nested", {"mid": 0.75, "small": 0.5})
        except ValueError as e:  # a model too small to cut within 2% on the 16-grid: a clear refusal is fine
            assert "cannot reach" in str(e) and "parameters within 2%" in str(e), e
            event("nest: target unreachable on the 16-grid")
            return
        m = elastic_local.load(root / "nested")
        ids = ids_of(seed, 1, 7)
        for name in ("mid", "small"):
            out, portable = slice_budget(root / "nested", root / name, name)
            assert portable  # homogeneous budgets: any Nemotron-H loader reads the slice
            oracle = NemotronHForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            torch.testing.assert_close(m.logits(ids, budget=name), hf_logits(oracle, ids), atol=1e-4, rtol=0)
        for precision in ("fp8", "nvfp4"):
            q = quantize_checkpoint(root / "nested", root / precision, precision)
            qm = elastic_local.load(q)
            assert qm.budgets == m.budgets
            for name in qm.budgets:
                logits = qm.logits(ids, budget=name)
                assert logits.shape == (1, 7, 96) and torch.isfinite(logits).all()
        r = m.generate(ids[0].tolist(), answer_budget="small", max_answer_tokens=4, ignore_eos=True)
        assert r.stats.answer_tokens == 4
