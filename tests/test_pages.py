"""A CPU load's resident weights in huge pages (model/pages.py): tensors packed into advised mappings that
live as long as the tensors in them, lone tensors moved in place, shared ones left, the same tokens from
a model loaded either way, and no second copy of the weights left behind in the heap."""

import gc
import os
import weakref

import pytest
import torch
from tiny import make_checkpoint

import elastic_local
from elastic_local.model import pages
from elastic_local.model.linear import Panels

needs_pages = pytest.mark.skipif(not pages.available(), reason="no huge pages on request here (not Linux with "
                                 "THP madvise or always and glibc): the arena is off and nothing changes")


def advised(address: int) -> bool:
    """Whether the mapping holding `address` is advised MADV_HUGEPAGE ("hg" in its smaps VmFlags)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= address < hi
            elif head == "VmFlags:" and inside:
                return "hg" in line.split()
    return False


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@needs_pages
def test_an_arena_packs_its_tensors_into_an_advised_mapping_aligned_to_a_huge_page():
    with pages.arena() as arena:
        a = pages.zeros((1000, 300), torch.float32)
        b = pages.zeros((513, 257), torch.bfloat16)
        small = pages.zeros((4, 4), torch.float32)  # under MIN_BYTES: torch's own
        assert a.data_ptr() % pages.HUGE == 0
        assert b.data_ptr() == a.data_ptr() + -(-a.nbytes // pages.ALIGN) * pages.ALIGN
        assert arena.holds(a) and arena.holds(b) and not arena.holds(small)
        assert advised(a.data_ptr()) and advised(b.data_ptr() + b.nbytes - 1)
        assert arena.bytes == a.nbytes + b.nbytes
        assert not a.any() and not b.any()  # fresh pages: zeros, as Panels.of needs for its padding
        b.fill_(1.5)
        assert a.sum() == 0 and b.float().sum() == 1.5 * b.numel()
    outside = pages.zeros((1000, 300), torch.float32)
    assert not arena.holds(outside)


@needs_pages
def test_a_tensor_keeps_its_mapping_and_the_last_one_to_go_frees_it():
    with pages.arena() as arena:
        t = pages.zeros((1 << 20,), torch.float32)
        u = pages.zeros((1 << 20,), torch.float32)
        mapping = weakref.ref(arena.chunk)
    del arena
    gc.collect()
    t.fill_(2.0)
    assert mapping() is not None and t.sum() == 2.0 * t.numel()
    del t
    gc.collect()
    assert mapping() is not None  # u still lives in it
    del u
    gc.collect()
    assert mapping() is None


@needs_pages
def test_settle_moves_lone_tensors_in_place_and_leaves_shared_storage_views_and_small_ones():
    g = torch.Generator().manual_seed(0)
    lone, shared, small = torch.randn(300, 300, generator=g), torch.randn(200, 200, generator=g), torch.randn(10)
    view = shared[1:]  # a view into shared's storage: moving shared would keep both copies
    holder, before = {"w": lone}, lone.clone()
    with pages.arena() as arena:
        moved = pages.settle([lone, shared, view, small])
        assert moved == lone.nbytes
        assert arena.holds(holder["w"]) and holder["w"] is lone and torch.equal(lone, before)
        assert not arena.holds(shared) and not arena.holds(view) and not arena.holds(small)
        assert view.data_ptr() == shared.data_ptr() + shared.stride(0) * 4
        assert pages.settle([lone]) == 0  # already there


def test_without_huge_pages_an_arena_changes_nothing(monkeypatch):
    monkeypatch.setenv(pages.ENV, "0")
    t = torch.randn(300, 300)
    with pages.arena() as arena:
        assert arena is None
        z = pages.zeros((300, 300), torch.float32)
        assert pages.settle([t]) == 0
    assert not z.any() and z.shape == (300, 300)


def test_info_says_where_a_load_puts_the_weights(monkeypatch):
    big = pages.WORTH
    if pages.available():
        assert pages.describe(big).startswith("2 MiB huge pages")
        assert pages.describe(big - 1).startswith("4 KiB pages (under 64 MiB")
    else:
        assert pages.describe(big).startswith("4 KiB pages (this system lends no")
    monkeypatch.setenv(pages.ENV, "0")
    assert pages.describe(big) == f"4 KiB pages ({pages.ENV}=0)"


@needs_pages
def test_settling_weights_leaves_no_second_copy_in_the_heap(monkeypatch):
    """Each tensor moved frees its old storage into glibc's heap, which keeps chunks under its mmap
    threshold; the arena trims them back, or a load's resident memory would be its weights twice."""
    gc.collect()
    torch.ones(30 << 18)  # 30 MiB mapped and unmapped: glibc's mmap threshold rises to it (as a load's frees do),
    weights = [torch.full((1 << 20,), float(i)) for i in range(48)]  # so these 48 x 4 MiB come from its heap
    start = rss_mib()
    with pages.arena():
        pages.settle(weights)
    gc.collect()
    grown = rss_mib() - start
    assert grown < 0.5 * 48 * 4, f"{grown:.0f} MiB more after moving 192 MiB"
    assert all(w[-1] == i for i, w in enumerate(weights))


@needs_pages
def test_a_model_loaded_into_huge_pages_gives_the_same_logits_and_tokens(tmp_path, monkeypatch):
    """A model this small stays in 4 KiB pages (its weights stay in the CPU's caches anyway); with no
    floors every tensor goes into the arena, panels and all, and gives the same bits."""
    make_checkpoint(tmp_path, seed=3)
    plain = elastic_local.load(tmp_path)
    monkeypatch.setattr(pages, "MIN_BYTES", 0)
    monkeypatch.setattr(pages, "WORTH", 0)
    huge = elastic_local.load(tmp_path)
    panels = [w for layer in huge.net.layers for w in vars(layer.mixer).values() if isinstance(w, Panels)]
    assert panels and all(advised(w.p.data_ptr()) for w in panels)
    assert not any(advised(t.data_ptr()) for t in plain.net.tensors())
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.inference_mode():
        assert torch.equal(plain.forward(ids), huge.forward(ids))
    prompt = [3, 7, 11, 19]
    for budget in plain.budgets:
        assert plain.generate(prompt, answer_budget=budget, max_answer_tokens=12, ignore_eos=True).ids == \
            huge.generate(prompt, answer_budget=budget, max_answer_tokens=12, ignore_eos=True).ids


@needs_pages
def test_a_system_that_refuses_the_mappings_loads_as_before(tmp_path, monkeypatch):
    """mmap failing (strict overcommit, no address space) or madvise refused: the load goes on in torch's
    own memory, with the same logits, and nothing in an arena."""
    make_checkpoint(tmp_path, seed=3)
    plain = elastic_local.load(tmp_path)
    monkeypatch.setattr(pages, "MIN_BYTES", 0)
    monkeypatch.setattr(pages, "WORTH", 0)

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(pages.mmap, "mmap", refuse)
    refused = elastic_local.load(tmp_path)
    assert not any(advised(t.data_ptr()) for t in refused.net.tensors())
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.inference_mode():
        assert torch.equal(plain.forward(ids), refused.forward(ids))
