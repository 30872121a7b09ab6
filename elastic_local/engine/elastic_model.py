"""ElasticModel: one resident network and the budgets it can run, the object `elastic_local.load` returns."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..model.budget import Budget
from ..model.config import NemotronHConfig
from ..model.nemotron_h import HybridCache, NemotronH
from .events import Result
from .generate import Generation
from .phases import Request, Specials
from .stream import Stream
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .chat import Chat

Prompt = Sequence[int] | torch.Tensor


class ElasticModel:
    def __init__(self, net: NemotronH, budgets: dict[str, Budget], path: Path | None = None,
                 tokenizer: Tokenizer | None = None, not_resident: Sequence[str] = ()):
        self.net, self.path = net, path
        self._budgets = budgets  # every budget the resident weights can run, largest first
        self.not_resident = list(not_resident)  # the checkpoint's budgets this load left out (larger ones)
        self.tokenizer = tokenizer  # None when the checkpoint has no tokenizer.json
        # seconds a token of each budget took in its last run ahead (Generation): how far the next one,
        # of any generation on this model, goes in one call (its first included: no token spent timing)
        self.token_s: dict[str, float] = {}

    @property
    def config(self) -> NemotronHConfig:
        return self.net.cfg

    @property
    def device(self) -> torch.device:
        return self.net.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.dtype

    @property
    def context_limit(self) -> int | None:
        """Tokens one sequence may fill, prompt and reply: config.json's max_position_embeddings (None: no
        limit named). Generation stops there with finish_reason "context_limit"; a longer prompt is an error."""
        n = self.config.raw.get("max_position_embeddings")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    @property
    def budgets(self) -> list[str]:
        """Budget names that run on the resident weights, largest first."""
        return list(self._budgets)

    def budget(self, name: str | None = None) -> Budget:
        if name is None:
            return self.net.resident
        if name in self.not_resident:
            raise KeyError(f"budget {name!r} is not resident: this load holds {self.budgets} (budget "
                           f"{self.net.resident.name!r}); load with budget {name!r}, or none, to run it")
        if name not in self._budgets:
            raise KeyError(f"unknown budget {name!r}; this model runs {self.budgets}")
        return self._budgets[name]

    def new_cache(self, batch_size: int = 1, budget: str | None = None, capacity: int = 0) -> HybridCache:
        return self.net.new_cache(batch_size, self.budget(budget), capacity)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: HybridCache | None = None, budget: str | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Logits [B, T or 1, vocab] (float32); with a cache, continues and advances it (its budget runs)."""
        b = cache.budget if cache is not None else self.budget(budget)
        ids = as_ids(input_ids, self.config.vocab_size, None if cache is not None else self.context_limit)
        if cache is not None and ids.shape[0] != len(cache.lengths):
            raise ValueError(f"input_ids has {ids.shape[0]} rows, the cache {len(cache.lengths)}")
        return self.net.forward(ids.to(self.net.device), b, cache, last_only)

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor, budget: str | None = None) -> torch.Tensor:
        """Logits of a whole sequence from scratch: LongTensor [B, T] -> FloatTensor [B, T, vocab]. One sequence
        as a 1-D tensor or a list of ids is a batch of one ([1, T, vocab])."""
        ids = as_ids(input_ids, self.config.vocab_size, self.context_limit)
        return self.net.forward(ids.to(self.net.device), self.budget(budget))

    # ------------------------------------------------------------------------------------------ generation
    # The prompt ends where thinking starts (after `<think>`; after `</think>` for thinking off). Options
    # are phases.Request's fields: think_budget, answer_budget, max_think_tokens, max_answer_tokens,
    # temperature, top_k, top_p, min_p, seed, stop, stop_ids, ignore_eos, think_close, transplant.

    @property
    def specials(self) -> Specials:
        """`<think>` / `</think>` ids (from the tokenizer), every eos id the checkpoint names (config.json,
        generation_config.json, tokenizer_config.json) and its closing text for thinking cut short."""
        eos, close = generation_config(self.path)
        if isinstance(self.config.eos_token_id, list):
            eos.update(self.config.eos_token_id)
        elif self.config.eos_token_id is not None:
            eos.add(self.config.eos_token_id)
        start = end = None
        if self.tokenizer is not None:
            eos |= self.tokenizer.eos_ids
            start, end = self.tokenizer.think_ids
        return Specials(start, end, frozenset(eos), close)

    def generate(self, prompt_ids: Prompt | Sequence[Prompt], *, cancel: threading.Event | None = None,
                 **options) -> Result | list[Result]:
        """Generate for one prompt (ids) -> Result, or for several (a list of id lists, or [B, T]) ->
        one Result each, decoded together. `cancel` (a threading.Event) stops it before the next step: the
        next token, or after a run of tokens of at most RUN_AHEAD_S (generate.py)."""
        prompts, single = _prompts(prompt_ids)
        results = Generation(self, prompts, Request.of(**options), cancel=cancel).collect()
        return results[0] if single else results

    def stream(self, prompt_ids: Prompt | Sequence[Prompt], **options) -> Stream:
        """Like generate, on a background thread: iterate the Stream for Token / CatchUp / Switch / Done
        events; `.switch(think=..., answer=...)` and `.cancel()` act from the next token on."""
        prompts, _ = _prompts(prompt_ids)
        return Stream(Generation(self, prompts, Request.of(**options)))

    def chat(self, system: str | None = None, think: bool = True, **options) -> Chat:
        """A multi-turn conversation that reuses caches between turns (see chat.py); `options` are the
        defaults of every turn."""
        from .chat import Chat

        return Chat(self, system=system, think=think, **options)

    def chat_prompt(self, text: str | list[dict], think: bool = True, system: str | None = None) -> list[int]:
        """Token ids of one user message (or a list of messages) with the assistant's turn opened."""
        from .chat import render_prompt

        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json; pass token ids instead")
        messages = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)
        if system:
            messages = [{"role": "system", "content": system}] + messages
        return render_prompt(self.tokenizer, messages, think)


def as_ids(input_ids, vocab: int, context: int | None = None) -> torch.Tensor:
    """Token ids as a LongTensor [B, T], checked: integers of the vocabulary, at least one token, at most
    `context`; a 1-D tensor or a list is one sequence, a list of equal-length lists a batch."""
    if not isinstance(input_ids, torch.Tensor):
        try:
            input_ids = torch.tensor(input_ids)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"input_ids must be a LongTensor [B, T], a list of ids, or a list of equal-length id "
                             f"lists ({e})") from None
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, not {input_ids.dtype}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T] (or one sequence [T]); got shape {list(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {list(input_ids.shape)}); give at least one token")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary of {vocab} (ids 0..{vocab - 1})")
    if context is not None and input_ids.shape[1] > context:
        raise ValueError(f"input_ids has {input_ids.shape[1]} tokens, past the model's context of {context} "
                         "(max_position_embeddings in config.json)")
    return input_ids.long()


def _prompts(p) -> tuple[list[list[int]], bool]:
    """(prompts, single): one prompt is a flat sequence of ids; a batch is a list of them or [B, T]."""
    if isinstance(p, torch.Tensor):
        return (p.tolist(), False) if p.dim() == 2 else ([p.tolist()], True)
    p = list(p)
    if p and isinstance(p[0], (Sequence, torch.Tensor)):
        return [q.tolist() if isinstance(q, torch.Tensor) else list(q) for q in p], False
    return [[int(x) for x in p]], True


def generation_config(path: str | Path | None) -> tuple[set[int], str | None]:
    """The eos ids a checkpoint directory's generation_config.json names, and its "think_close": the text
    that closes thinking cut short by a think token budget (None: it names none, and phases.THINK_CLOSE,
    NVIDIA's sentence, is used; a model trained without that sentence may answer better after a bare
    `</think>`, "", as the embedded demo model does). A broken file is a ValueError naming it."""
    file = None if path is None else Path(path) / "generation_config.json"
    if file is None or not file.is_file():
        return set(), None
    try:
        gen = json.loads(file.read_text())
        eos, close = gen.get("eos_token_id"), gen.get("think_close")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{file}: not a valid generation config ({e}); fix or remove it") from None
    if close is not None and not isinstance(close, str):
        raise ValueError(f"{file}: think_close must be a string (\"\" closes thinking with </think> alone), got "
                         f"{close!r}; fix or remove it")
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos]), close
