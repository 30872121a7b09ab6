"""Continuous batching: one running Generation that requests join and leave at every step.

    waiting: [j5 j6 j7 ...]  --join while the batch has room-->  running: rows decode together per budget
                                                              <--leave when finished-- -> (job, result)

A request joins when the batch has fewer rows than it may hold (`max_batch`, or one where rows decode
faster one at a time: Admission) and the caches, with it, stay within the memory the fit planner leaves for
them (Memory). It joins by a prefill of its prompt (on a CPU, up to 64 tokens in the step where the others
decode; a longer one alone), then decodes with the others; rows on different budgets decode as separate
sub-batches of the same step. Each row keeps its own Request (budgets, limits, sampling, stops), so a
row's tokens are those it gets alone.

Cache memory is rectangular: every budget taking part keeps a cache of every running row, sized for the
longest row's capacity (prompt + think and answer limits + closing text), and it only shrinks when the
batch empties. That is what Memory.bytes counts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..engine import ElasticModel
from ..engine.cacheset import holds_copies
from ..engine.events import CatchUp, Result, Token
from ..engine.generate import Generation
from ..engine.phases import Request
from .requests import Job, LineError


@dataclass(frozen=True)
class Memory:
    """What a batch's caches may occupy (`room`, bytes; None: no bound) and what a row costs in them."""

    room: int | None
    kv_token: dict[str, int]  # budget -> bytes of one cached token of one row (every attention layer)
    state: dict[str, int]  # budget -> bytes of one row's Mamba conv + SSM state
    copies: bool = False  # sub-batches step on copies of their rows (no C step in place: a GPU)

    @classmethod
    def of(cls, model: ElasticModel, room: int | None) -> Memory:
        """Per-row costs measured on the model's own caches (its dtype, its layers)."""
        state = {b: model.new_cache(1, b).nbytes() for b in model.budgets}
        kv = {b: model.new_cache(1, b, capacity=1).nbytes() - state[b] for b in model.budgets}
        return cls(room, kv, state, holds_copies(model))

    def bytes(self, rows: int, capacity: int, budgets: set[str]) -> int:
        """Caches of `rows` rows sized for `capacity` tokens, one cache per budget; with `copies` and more
        than one budget, also the copies the sub-batches step on (CacheSet.held: every row's copy in the
        budget it steps on, at most the costliest one's)."""
        row = [capacity * self.kv_token[b] + self.state[b] for b in budgets]
        return rows * (sum(row) + (max(row) if self.copies and len(row) > 1 else 0))


def cache_room(model: ElasticModel, device: str = "cpu") -> int:
    """Bytes a batch's caches may fill: the memory free now, as the fit planner probes it (the weights are
    already resident), less the planner's safety margin and the workspace of one prefill chunk."""
    from ..hardware.fit import live_profile
    from ..hardware.planner import default_margin
    from ..model.cost import PREFILL_CHUNK, arch_shape

    free = live_profile(device).available_bytes
    work = arch_shape(model.config, model.budget()).workspace_bytes(PREFILL_CHUNK, 1, model.dtype.itemsize)
    return free - default_margin(free) - work


# Decode seconds timed each way (one row, several) before a batch settles its size (Admission).
PROBE_S = 0.05


class Admission:
    """How many rows the batch admits: `max_batch`, or one where rows decode faster one at a time, timed on
    the batch's own first jobs.

    Neither always wins. A lone row runs ahead in the C decode step, many tokens a call; a batch takes
    one C step a token for all its rows (step.c's decode_rows): on the demo model on a CPU, whose weights
    sit in the caches, small batches decode slower than one row ahead and large ones faster, while on a
    136M model a batch of 8 wins clearly (benchmarks/bench_batch.py, README "Batch files"). So the first
    jobs run batched, as many as it may hold (a batch's rate grows with its rows: a batch timed at a
    quarter of the jobs waiting, 2-4 rows of a short file, misjudged the demo), until PROBE_S of decoding
    is timed; then, once that batch has drained, alone until as much is; from then on the batch admits up
    to `max_batch` rows, or one where alone was faster. Batched first, because batching wins on most
    models and a short file is over before the verdict (README: alone first gave 16-request demo files
    0.95-1.05x one at a time, batched first 0.93-1.40x). Prefills are left out of both (a prefill in a
    batched step counts its tokens' share of the step); the tokens are the same at any batch size.
    `fixed`: always up to `max_batch`."""

    def __init__(self, fixed: bool = False, probe_s: float = PROBE_S):
        self.fixed, self.probe_s = fixed, probe_s
        self.alone = [0, 0.0]  # decoded tokens, seconds
        self.together = [0, 0.0]

    def add(self, rows: int, tokens: int, seconds: float) -> None:
        """A step of `rows` rows decoded `tokens` tokens in `seconds` (its prefills left out)."""
        tally = self.alone if rows == 1 else self.together
        tally[0] += tokens
        tally[1] += seconds

    def limit(self, max_batch: int) -> int:
        """The rows the batch may hold now."""
        if self.fixed or max_batch == 1 or self.together[1] < self.probe_s:
            return max_batch
        if self.alone[1] < self.probe_s:
            return 1
        return 1 if self.alone[0] * self.together[1] > self.together[0] * self.alone[1] else max_batch


def run_jobs(model: ElasticModel, jobs: list[Job], max_batch: int = 32, memory: Memory | None = None,
             on_step: Callable[[int], None] | None = None,
             admission: Admission | None = None) -> Iterator[tuple[Job, Result | LineError]]:
    """Run every job with continuous batching, up to `max_batch` rows where batching is the faster
    (Admission); yields (job, Result) as each finishes, or (job, LineError) for one that does not fit in
    memory even alone. `on_step(tokens)` hears of every step."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch} must be >= 1")
    admission = admission or Admission()
    gen = Generation(model, [], Request())
    waiting = deque(jobs)
    running: dict[int, Job] = {}
    capacity = 0  # what the caches are sized for while the batch runs
    largest = model.budgets[0]

    def budgets(job: Job) -> set[str]:
        return {job.request.think_budget or largest, job.request.answer_budget or largest}

    while waiting or gen.rows:
        while waiting and len(gen.active) < admission.limit(max_batch):
            job = waiting[0]
            if memory is not None and memory.room is not None:
                cap = max(capacity, job.capacity)
                use = set().union(budgets(job), *map(budgets, running.values()))
                need = memory.bytes(len(gen.active) + 1, cap, use)
                if need > memory.room and gen.active:
                    break  # it joins when rows leave
                if need > memory.room:
                    waiting.popleft()
                    yield job, LineError(job.line, job.custom_id, "out_of_memory",
                                         f"line {job.line}: its caches need {need / 2**20:.0f} MiB, more than the "
                                         f"{memory.room / 2**20:.0f} MiB this machine has free for them; lower "
                                         "max_tokens / max_think_tokens")
                    continue
                capacity = cap
            waiting.popleft()
            running[gen.add(job.prompt, job.request)] = job
        # a lone row runs ahead (Generation.run): no job could join it before it finishes anyway (the
        # batch would hold more rows otherwise), and a run ahead stops where the row finishes
        rows, start = len(gen.active), time.perf_counter()
        events = gen.step(ahead=True)
        tokens = sum(isinstance(e, Token) and not e.forced for e in events)
        prefill = sum(e.seconds for e in events if isinstance(e, CatchUp))
        admission.add(rows, tokens, time.perf_counter() - start - prefill)
        if on_step is not None:
            on_step(tokens)
        for i, result in gen.take_finished():
            yield running.pop(i), result
        if not gen.active:
            capacity = 0  # the caches were freed with the last row
