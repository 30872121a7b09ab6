"""Shared by the generation and chat tests: a tiny elastic model with two budgets and a tokenizer, and
the oracle check that every generated token is the greedy argmax of its budget run from scratch."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch
from tiny import make_checkpoint, write_tokenizer

import elastic_local
from elastic_local.engine import ElasticModel
from elastic_local.engine.events import Switch, Token
from elastic_local.engine.generate import Generation, Request
from elastic_local.model import Budget

# near-ties (top-2 logit gap below this) are not checked: float rounding may order them either way
TIE = 1e-4


def small_budget(cfg) -> Budget:
    """Half of every axis: Mamba heads per group, query heads per KV group, experts (>= top-k), expert,
    shared and MLP channels; three quarters of the hidden width."""
    layers = []
    for s in Budget.full(cfg).layers:
        if s.kind == "M":
            s = replace(s, mamba_heads=s.mamba_heads // 2)
        elif s.kind == "*":
            s = replace(s, attention_heads=s.attention_heads // 2)
        elif s.kind == "E":
            s = replace(s, experts=max(cfg.num_experts_per_tok, s.experts // 2), expert_channels=s.expert_channels // 2,
                        shared_channels=s.shared_channels // 2)
        else:
            s = replace(s, mlp_channels=s.mlp_channels // 2)
        layers.append(s)
    return Budget("small", cfg.hidden_size * 3 // 4, tuple(layers))


def elastic_model(path: Path, seed: int = 0, prefill_chunk: int = 8, precision: str | None = None,
                  **overrides) -> ElasticModel:
    """The ElasticModel a nested checkpoint with budgets "full" and "small" gives (float32, CPU; `precision`
    quantizes while loading). Its `</think>` logit is 0 at every position (lm_head row zeroed) and so is
    never the argmax among 95 random ones: the random model does not close thinking by itself, the think
    budget does."""
    if not (path / "config.json").is_file():
        make_checkpoint(path, seed=seed, **overrides)
        write_tokenizer(path)
    base = elastic_local.load(path, precision=precision)
    base.net.prefill_chunk = prefill_chunk  # catch-ups longer than this run in several chunks
    base.net.silence(base.tokenizer.think_ids[1])
    cfg = base.config
    return ElasticModel(base.net, {"full": Budget.full(cfg), "small": small_budget(cfg)}, path, base.tokenizer)


def assert_argmax(m: ElasticModel, ids: list[int], tokens: list[tuple[int, str]]) -> int:
    """Every (position, budget) in `tokens`: ids[position] is the argmax of that budget's logits over
    ids[:position], computed from scratch (one full forward per budget). Returns how many were checked."""
    checked = 0
    seq = torch.tensor([ids])
    for budget in {b for _, b in tokens}:
        logits = m.logits(seq, budget=budget)[0]
        for t, b in tokens:
            if b != budget:
                continue
            top = logits[t - 1].topk(2)
            if top.values[0] - top.values[1] < TIE:
                continue
            best = int(top.indices[0])
            assert best == ids[t], f"position {t}: {ids[t]} is not {budget}'s argmax {best}"
            checked += 1
    return checked


def sampled_tokens(events, prompt_len: int, row: int = 0) -> list[tuple[int, str]]:
    """(position, budget) of every token the model sampled (forced ones left out), from Token events."""
    out, pos = [], prompt_len
    for ev in events:
        if isinstance(ev, Token) and ev.row == row:
            if not ev.forced:
                out.append((pos, ev.budget))
            pos += 1
    return out


def generate_with_a_live_switch(m: ElasticModel) -> tuple[list[int], list[tuple[int, str]]]:
    """Think on "full", answer on "small", and switch thinking to "small" after 4 thinking tokens, live:
    (the result's ids, the sampled tokens as (position, budget)), checked to have switched where asked."""
    prompt = m.chat_prompt("switch")
    gen = Generation(m, [prompt], Request(think_budget="full", answer_budget="small", max_think_tokens=12,
                                          max_answer_tokens=6, ignore_eos=True, think_close="ok."))
    events = []
    for ev in gen.run():
        events.append(ev)
        thinking = [e for e in events if isinstance(e, Token) and e.phase == "think"]
        if len(thinking) == 4 and not any(isinstance(e, Switch) for e in events):
            gen.switch(think="small")
    tokens = sampled_tokens(events, len(prompt))
    assert [b for _, b in tokens][:6] == ["full"] * 4 + ["small"] * 2
    return events[-1].results[0].ids, tokens


def at_a_real_models_pace(m, monkeypatch) -> None:
    """5 ms a step: the tiny model's steps take microseconds (C decode step), so a stream's consumer, which
    collects tokens every 20 ms, would see a generation end before it could act on one."""
    def slow(step):
        def run(*args, **kwargs):
            time.sleep(0.005)
            return step(*args, **kwargs)
        return run

    monkeypatch.setattr(m.net, "forward", slow(m.net.forward))
    monkeypatch.setattr(m.net, "decode_token", slow(m.net.decode_token))
    monkeypatch.setattr(m.net, "decode_ahead", slow(m.net.decode_ahead))  # a run ahead's call (one token)


def runs_ahead(monkeypatch) -> list[int]:
    """The length of every run ahead the engine makes from here on (CacheSet.run_ahead), with no time limit
    on one: on a slow or busy machine a token could take longer than RUN_AHEAD_S and none would run."""
    from elastic_local.engine import generate
    from elastic_local.engine.cacheset import CacheSet

    lengths: list[int] = []

    def record(self, *args, _run=CacheSet.run_ahead):
        out = _run(self, *args)
        if out is not None:
            lengths.append(len(out))
        return out

    monkeypatch.setattr(CacheSet, "run_ahead", record)
    monkeypatch.setattr(generate, "RUN_AHEAD_S", 1.0)
    monkeypatch.setattr(generate, "QUIET_RUN_AHEAD_S", 1.0)
    return lengths
