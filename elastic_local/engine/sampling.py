"""Next-token choice from logits: greedy argmax at temperature 0, otherwise temperature, top-k, top-p,
min-p (in that order, as transformers applies them) and a draw from a seeded generator. No penalties.

On the CPU a draw is model/sample.c's (the C decode step's run ahead draws with it too, so a seed gives
the same tokens whether a step or a run ahead took them); the torch ops here draw elsewhere and stand as
its oracle in the tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..model import sample as c_sample


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy argmax
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    seed: int | None = None  # None: torch's global generator

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise ValueError(f"{name}={v!r} is not a number")
            return v

        if not 0 <= number("temperature") < math.inf:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be a whole number >= 0 (0 = all tokens)")
        if not 0 < number("top_p") <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] (1 = all tokens)")
        if not 0 <= number("min_p") <= 1:
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1] (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def params(self) -> c_sample.Params:
        """These settings as model/sample.c reads them (temperature > 0)."""
        return c_sample.Params(self.top_k, self.temperature, self.top_p, self.min_p)

    def generator(self, device: torch.device) -> torch.Generator | None:
        return None if self.seed is None else torch.Generator(device).manual_seed(self.seed)


def logits_to_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[B, V] float logits -> [B, V] probabilities after temperature, top-k, top-p and min-p."""
    logits = logits.float() / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    probs = logits.softmax(-1)
    if s.top_p < 1.0:
        probs = nucleus(probs, s.top_p)
    if s.min_p > 0.0:
        probs = probs.masked_fill(probs < s.min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[B, V] probabilities with every token outside the top-p nucleus zeroed: the most likely tokens up to
    the first whose mass before it already reaches top_p (the most likely one always stays).

    Why not one sort of the vocabulary: on a CPU it cost 16 ms a token at 131k tokens (2 threads), while
    a trained model's nucleus is rarely more than a few hundred tokens. The most likely 256 are taken first
    (0.9 ms in all at 131k); only where they hold less than top_p, 4096, then all of them; a stage only
    where it is at most 1/16 of the vocabulary, else it costs more than it saves (docs/decode-speed.md, "Sampling")."""
    vocab = probs.shape[-1]
    for k in [k for k in (256, 4096) if 16 * k <= vocab] + [vocab]:
        p, order = probs.topk(k, dim=-1) if k < vocab else probs.sort(dim=-1, descending=True)
        mass = p.cumsum(-1)
        if k == vocab or bool((mass[:, -1] >= top_p).all()):  # every token past k has top_p before it
            break
    return torch.zeros_like(probs).scatter_(-1, order, p.masked_fill(mass - p >= top_p, 0.0))


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None = None) -> list[int]:
    """[B, V] logits -> B token ids.

    Greedy float32 logits on the CPU take numpy's argmax (the same first maximum, NaN counted largest, as
    torch's): right after a decode step, whose weights have pushed the interpreter out of the caches,
    torch's dispatch of one argmax cost the demo model about 20 us a token more (docs/decode-speed.md, "The Python
    around a token"). Sampled logits on the CPU take model/sample.c's draw, with the generator's next
    uniform number for each row, as a run ahead does."""
    if s.greedy:
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
            return logits.numpy().argmax(-1).tolist()
        return logits.argmax(-1).tolist()
    if (tokens := c_sample.rows(logits, s.params(), generator)) is not None:
        return tokens
    return draw(logits_to_probs(logits, s), generator).tolist()


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, V] probabilities -> [B] ids, by inverting the cumulative distribution at one uniform number per
    row: the token j with c[j-1] <= u < c[j], which a zero-probability token never is.

    Why not torch.multinomial: on a CPU it cost 1.3-1.4 ms a draw at a 32k vocabulary and 5.1-5.8 ms at
    131k (Star Elastic's), against 0.14 / 0.33 ms this way (2 threads), while a 100m model's whole decode
    step takes about 10 ms (docs/decode-speed.md, "Sampling")."""
    c = probs.cumsum(-1)
    total = c[:, -1:]
    if not 0 < float(total.sum()) < math.inf:  # a NaN anywhere fails both comparisons
        raise ValueError(c_sample.NOT_FINITE)
    # u < total even after rounding: below total by 2^-23 of it, at least one float32 step (a uniform
    # number times the total itself could round up to it, past every token)
    u = torch.rand(total.shape, generator=generator, device=c.device, dtype=c.dtype) * (total * (1 - 2**-23))
    return torch.searchsorted(c, u, right=True)[:, 0]
