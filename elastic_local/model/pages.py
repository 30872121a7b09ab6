"""A CPU load's resident weights in transparent huge pages (2 MiB), where Linux lends them on request.

Why: batch-1 decode streams every weight once a token. In 4 KiB pages that is a TLB entry to walk every
4 KiB, and the hardware prefetchers stop at every page boundary. In 2 MiB pages gen16's decode (bf16
panels) ran 1.03-1.26x faster over six runs (most 1.05-1.13x), 100m's in float32, FP8 and NVFP4
0.99-1.11x (docs/decode-speed.md, "Weights in huge pages"). torch's allocator does not ask for them (its
THP_MEM_ALLOC_ENABLE switch is read once per process, at its first allocation, and then covers every
large tensor), and where the kernel lends huge pages only on request (THP "madvise", a common default) a
weight never gets one.

How: while `arena()` is open (engine/load.py, around the CPU layout), `zeros` hands out tensors packed one
after another into anonymous mappings of 64 MiB or more (`Arena`), each advised MADV_HUGEPAGE and
aligned to 2 MiB; `settle` moves the large tensors made elsewhere (FP8 / NVFP4 codes as read) into
them. Packing loses at most the unfilled part of each mapping's last huge page, where a mapping per tensor
would round every tensor up to 2 MiB (a 2.5 MiB NVFP4 expert of the 30B to 4). A mapping lives while any
tensor in it does (torch.frombuffer holds it). Elsewhere (not Linux, THP "never", a model under 64 MiB, a
small tensor, a mapping the system refuses, ELASTIC_LOCAL_HUGE_PAGES=0): torch.zeros and the tensor as it
is, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

ENV = "ELASTIC_LOCAL_HUGE_PAGES"  # "0": never
HUGE = 2 << 20
CHUNK = 64 << 20   # an arena's mappings: this, or one tensor's size where that is larger
ALIGN = 64         # a tensor's start within a mapping: a cache line
MIN_BYTES = 64 << 10  # smaller tensors stay where torch put them (a norm, a bias)
WORTH = 64 << 20  # smaller models stay in 4 KiB pages: their weights stay in the CPU's caches between tokens
# (the demo model's decode: the same speed either way), and an arena would only add to their load
TRIM_EVERY = 32 << 20  # a load's resident memory exceeds its weights by at most about this (`_trim`)


def _libc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's
    except (OSError, AttributeError, TypeError):  # another libc, another OS
        return None


_malloc_trim = _libc_trim()


def _trim() -> None:
    """Give the heap's free pages back (glibc's malloc_trim). A weight replaced by its copy in the arena is
    freed into glibc's heap, which keeps chunks under its mmap threshold (up to 32 MiB) for reuse; the
    arena reuses none of them, so without this a load's resident memory would be its weights twice."""
    _malloc_trim(0)


def available() -> bool:
    """Whether this process can ask for huge pages: Linux with THP "madvise" or "always", and glibc."""
    if os.environ.get(ENV) == "0" or not hasattr(mmap, "MADV_HUGEPAGE") or _malloc_trim is None:
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def describe(weights: int) -> str:
    """Where a CPU load of a model of `weights` bytes puts them (`elastic-local info`)."""
    if os.environ.get(ENV) == "0":
        return f"4 KiB pages ({ENV}=0)"
    if not available():
        return "4 KiB pages (this system lends no transparent huge pages on request)"
    if weights < WORTH:
        return f"4 KiB pages (under {WORTH >> 20} MiB: they stay in the CPU's caches)"
    return f"2 MiB huge pages, packed and advised MADV_HUGEPAGE ({ENV}=0: off)"


class Arena:
    """Tensors packed into huge-page mappings, never freed one by one: for weights that live as long as
    their model."""

    def __init__(self) -> None:
        self.chunk: mmap.mmap | None = None
        self.used = self.size = 0
        self.bytes = 0  # handed out
        self.untrimmed = 0  # handed out since the last _trim
        self.spans: list[tuple[int, int]] = []  # every mapping's [start, end) address
        self.failed = False  # a mapping was refused: the rest of the load allocates as before

    def holds(self, t: torch.Tensor) -> bool:
        return any(a <= t.data_ptr() < b for a, b in self.spans)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialized tensor in the arena (zeros as handed out: a mapping's pages are fresh), or None
        where no mapping could be made (a system that refuses it: the caller allocates as before)."""
        if self.failed:
            return None
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if self.untrimmed >= TRIM_EVERY:  # the weights these replace, freed by now, back to the system
            _trim()
            self.untrimmed = 0
        self.untrimmed += nbytes
        start = -(-self.used // ALIGN) * ALIGN
        if self.chunk is None or start + nbytes > self.size:
            try:
                self._grow(nbytes)
            except OSError:  # no address space or memory for the mapping (strict overcommit), or no madvise
                self.failed = True
                return None
            start = self.used
        self.used, self.bytes = start + nbytes, self.bytes + nbytes
        flat = torch.frombuffer(self.chunk, dtype=torch.uint8, count=nbytes, offset=start) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).view(shape)

    def _grow(self, nbytes: int) -> None:
        size = max(CHUNK, -(-nbytes // HUGE) * HUGE) + HUGE  # room to align the start to a huge page
        chunk = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        chunk.madvise(mmap.MADV_HUGEPAGE)
        view = ctypes.c_char.from_buffer(chunk)
        address = ctypes.addressof(view)
        del view  # an exported buffer would keep the mapping from closing with its last tensor
        self.chunk, self.size, self.used = chunk, size, -address % HUGE
        self.spans.append((address, address + size))


_arena: Arena | None = None


@contextlib.contextmanager
def arena(weights: int = WORTH) -> Iterator[Arena | None]:
    """Weights that `zeros` and `settle` make inside go into one arena, for a model of `weights` bytes
    (None where huge pages are not available, or the model is smaller than WORTH: nothing changes)."""
    global _arena
    outer, _arena = _arena, Arena() if weights >= WORTH and available() else None
    try:
        yield _arena
    finally:
        if _arena is not None:
            _trim()
        _arena = outer


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros: in the open arena where there is one and it is large enough."""
    t = None if _arena is None or torch.Size(shape).numel() * dtype.itemsize < MIN_BYTES else \
        _arena.empty(shape, dtype)
    return torch.zeros(shape, dtype=dtype) if t is None else t


def settle(tensors: Sequence[torch.Tensor]) -> int:
    """Move each large CPU tensor of `tensors` that alone holds its storage, and is not there yet, into the
    open arena, in place (`set_`: whoever holds the tensor sees the new pages; peak memory one tensor
    more). A storage shared by two of them, or a view into a larger one, stays (moving one would keep both
    copies). The bytes moved; 0 without an arena."""
    if _arena is None:
        return 0
    holders: dict[int, int] = {}
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        holders[key] = holders.get(key, 0) + 1
    moved = 0
    with torch.no_grad():
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if (t.device.type != "cpu" or nbytes < MIN_BYTES or not t.is_contiguous() or t.storage_offset()
                    or t.untyped_storage().nbytes() != nbytes or holders[t.untyped_storage().data_ptr()] > 1
                    or _arena.holds(t)):
                continue
            home = _arena.empty(t.shape, t.dtype)
            if home is None:
                break
            home.copy_(t)
            t.set_(home)
            moved += nbytes
    return moved
