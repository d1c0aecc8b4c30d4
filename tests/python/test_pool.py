"""PinnedPool from Python: zero-copy tensor views, lifetime, capacity errors, stats."""

import gc
import os
import threading

import pytest
import torch

import hytrain
from hytrain.pool import parse_bytes

MiB = 1 << 20


def test_views_share_pool_memory_without_copies():
    pool = hytrain.PinnedPool(64 * MiB, slab_bytes=8 * MiB)
    t = pool.empty((3, 5), torch.float32)
    assert t.shape == (3, 5) and t.dtype == torch.float32 and t.device.type == "cpu"
    assert t.data_ptr() % 256 == 0
    assert pool.stats()["in_use"] == 256  # 60 bytes, rounded to the alignment only
    u = pool.zeros(1000, torch.bfloat16)
    assert torch.count_nonzero(u) == 0
    t.copy_(torch.arange(15.0).view(3, 5))
    assert torch.equal(t.flatten(), torch.arange(15.0))
    assert pool.kind == ("cuda-registered" if hytrain.cuda_available() else "page-aligned")
    c = pool.copy_of(torch.arange(10, dtype=torch.int64), dtype=torch.float32)
    assert torch.equal(c, torch.arange(10.0))


def test_memory_lives_as_long_as_any_view():
    pool = hytrain.PinnedPool(64 * MiB, slab_bytes=8 * MiB)
    t = pool.empty(1 << 20)
    view = t[10:20]
    t.fill_(3.0)
    del t
    gc.collect()
    assert pool.stats()["in_use"] == 4 * MiB  # the slice still holds the block
    assert torch.all(view == 3.0)
    del view
    gc.collect()
    assert pool.stats()["in_use"] == 0
    # The pool object may go before its tensors: the tensor keeps the memory alive.
    t = pool.empty(100)
    del pool
    gc.collect()
    t.fill_(1.0)
    assert t.sum() == 100


def test_exhaustion_raises_with_sizes_and_keeps_state():
    pool = hytrain.PinnedPool("16MiB", slab_bytes="8MiB")
    a = pool.empty(3 * MiB // 4 * 2, torch.float32)  # 6 MiB
    a.fill_(7.0)
    with pytest.raises(hytrain.PoolExhaustedError) as info:
        pool.empty((20 * MiB,), torch.uint8)
    msg = str(info.value)
    assert "requested 20971520 bytes" in msg and "available" in msg
    assert isinstance(info.value, MemoryError)
    assert torch.all(a == 7.0)  # the failed request changed nothing
    b = pool.empty(2 * MiB, torch.uint8)  # and the pool still works
    assert b.numel() == 2 * MiB


def test_stats_and_trim():
    pool = hytrain.PinnedPool(64 * MiB, slab_bytes=4 * MiB)
    ts = [pool.empty(MiB, torch.uint8) for _ in range(6)]
    s = pool.stats()
    assert s["in_use"] == 6 * MiB and s["allocations"] == 6 and s["slabs"] == 2
    assert s["reserved"] == 8 * MiB and s["capacity"] == 64 * MiB
    del ts
    gc.collect()
    assert pool.stats()["peak_in_use"] == 6 * MiB
    assert pool.trim() == 8 * MiB
    assert pool.stats()["reserved"] == 0
    assert "page-aligned" in repr(pool) or "cuda-registered" in repr(pool)


def test_empty_tensors_take_no_pool_memory():
    pool = hytrain.PinnedPool(MiB)
    t = pool.empty((0, 4))
    assert t.shape == (0, 4) and pool.stats()["in_use"] == 0


@pytest.mark.parametrize("kw,exc,match", [
    (dict(capacity=0), ValueError, "capacity must be >= 1, got 0"),
    (dict(capacity="lots"), ValueError, "capacity must be a byte count"),
    (dict(capacity=-5), ValueError, "capacity must be >= 1, got -5"),
    (dict(capacity=MiB, slab_bytes=0), ValueError, "slab_bytes must be >= 1, got 0"),
    (dict(capacity=MiB, alignment=48), ValueError, "alignment must be a power of two"),
    (dict(capacity=MiB, pinned="yes"), TypeError, "pinned must be"),
])
def test_bad_pool_config(kw, exc, match):
    with pytest.raises(exc, match=match):
        hytrain.PinnedPool(**kw)


def test_pinned_true_without_gpu_is_a_clear_error():
    if hytrain.cuda_available():
        pytest.skip("a GPU is usable here")
    with pytest.raises(ValueError, match="pinned=True needs CUDA"):
        hytrain.PinnedPool(MiB, pinned=True)


def test_bad_view_arguments():
    pool = hytrain.PinnedPool(MiB)
    with pytest.raises(ValueError, match="shape must be >= 0"):
        pool.empty((-1, 3))
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        pool.empty(3, "float32")


def test_parse_bytes():
    assert parse_bytes("x", "24GiB") == 24 * 1024**3
    assert parse_bytes("x", "512 MB") == 512 * 1000**2
    assert parse_bytes("x", 17) == 17


def test_page_aligned_pool_is_not_page_locked():
    pool = hytrain.PinnedPool(MiB, pinned=False)
    t = pool.empty(1000)
    assert pool.kind == "page-aligned" and not pool.page_locked
    assert not hytrain.native().is_page_locked(t.data_ptr())


def test_reserve_for_makes_the_slabs_the_allocations_take():
    pool = hytrain.PinnedPool("64MiB", slab_bytes="8MiB", pinned=False)
    sizes = [10 * 2**20 + 4, 2**20, 3 * 2**20, 2**20]  # one request of its own slab, small ones packed
    got = pool.reserve_for(sizes, threads=2)
    stats = pool.stats()
    assert got == stats["reserved"] and stats["slabs"] == 1 + 2 and stats["in_use"] == 0
    tensors = [pool.empty(n, torch.uint8) for n in sizes]
    for t in tensors:
        t.fill_(7)
    assert pool.stats()["slabs"] == 3  # nothing beyond the reservation
    assert pool.trim() == 8 * 2**20  # the spare slab for the tails
    assert pool.reserve_for([200 * 2**20]) == 0  # past the room: left to the allocation to refuse
    with pytest.raises(ValueError):
        pool.reserve_for(sizes, threads=0)


def test_zeros_are_zero_where_the_memory_was_used_before():
    # Fresh pool memory is handed out as it is (the pages are zero); memory written and freed is
    # zeroed again. Both on reserved slabs, as the state's moments are made.
    pool = hytrain.PinnedPool("64MiB", slab_bytes="8MiB", pinned=False)
    pool.reserve_for([6 * MiB])
    for _ in range(3):
        t = pool.zeros((3 * MiB // 4,), torch.float32)
        assert torch.count_nonzero(t) == 0
        t.normal_()
        u = pool.zeros((1000,), torch.bfloat16)  # past t: never handed out
        assert torch.count_nonzero(u) == 0
        u.fill_(1.0)
        del t, u
        gc.collect()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not os.path.isdir("/sys/devices/system/node"),
                    reason="needs two CPUs and sysfs")
def test_a_confined_thread_makes_memory_with_the_process_cpus():
    # The state is made in the first backward, on a thread of the autograd engine's: what that thread
    # is confined to must not confine the pages' placement or the threads that touch them.
    from hytrain._native import native

    everything = sorted(c for n in native().numa_nodes() for c in n["cpus"])
    seen = {}

    def confined():
        os.sched_setaffinity(0, {everything[0]})  # this thread only
        seen["thread"] = len(os.sched_getaffinity(0))
        seen["nodes"] = sorted(c for n in native().numa_nodes() for c in n["cpus"])
        pool = hytrain.PinnedPool("64MiB", slab_bytes="8MiB", pinned=False)
        seen["reserved"] = pool.reserve_for([8 * MiB] * 4, threads=4)

    t = threading.Thread(target=confined)
    t.start()
    t.join()
    assert seen["thread"] == 1 and seen["nodes"] == everything and seen["reserved"] == 32 * MiB
    assert len(os.sched_getaffinity(0)) == len(everything)  # the main thread untouched


def test_memory_counters_name_what_the_kernel_did():
    from hytrain.pool import counter_changes, memory_counters

    before = memory_counters()
    assert all(isinstance(v, (int, float)) for v in before.values())
    assert counter_changes(before, before) == {}
    moved = dict(before, thp_fault_alloc=before.get("thp_fault_alloc", 0) + 5)
    assert counter_changes(dict(before, thp_fault_alloc=before.get("thp_fault_alloc", 0)), moved) == {"thp_fault_alloc": 5}


def test_reserve_for_stays_within_the_pool_room():
    pool = hytrain.PinnedPool("12MiB", slab_bytes="8MiB", pinned=False)
    got = pool.reserve_for([2**20] * 5, threads=2)  # 5 MiB of small requests, 8 MiB slabs, 12 MiB room
    assert got == 12 * 2**20 == pool.stats()["reserved"]
    assert pool.reserve_for([64 * 2**20]) == 0  # does not fit: left to the allocation to refuse
    ts = [pool.empty(2**20, torch.uint8) for _ in range(5)]
    assert pool.stats()["reserved"] == 12 * 2**20 and len(ts) == 5


def _pages_by_node(ptr: int) -> dict[int, int]:
    """Pages per NUMA node of the mapping holding ``ptr`` (/proc/self/maps, /proc/self/numa_maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                break
        else:
            raise AssertionError(f"{ptr:#x} is in no mapping")
    with open("/proc/self/numa_maps") as f:
        for line in f:
            fields = line.split()
            if int(fields[0], 16) == lo:
                return {int(k[1:]): int(v) for k, v in (x.split("=") for x in fields[1:] if x[:1] == "N" and "=" in x)}
    raise AssertionError(f"the mapping at {lo:#x} is not in numa_maps")


def test_page_placement_setting(monkeypatch):
    placement = hytrain.pool.page_placement()
    assert placement["nodes"] and placement["policy"] in ("spread", "local")
    assert placement["policy"] == ("spread" if len(placement["nodes"]) > 1 else "local")
    monkeypatch.setenv("HYTRAIN_PAGE_PLACEMENT", "local")
    assert hytrain.pool.page_placement()["policy"] == "local"
    monkeypatch.setenv("HYTRAIN_PAGE_PLACEMENT", "everywhere")
    with pytest.raises(ValueError, match="HYTRAIN_PAGE_PLACEMENT must be 'spread' or 'local'"):
        hytrain.PinnedPool(64 * MiB)


@pytest.mark.skipif(len(hytrain.pool.page_placement()["nodes"]) < 2, reason="one NUMA node: nothing to spread")
def test_slabs_are_spread_over_the_numa_nodes():
    nodes = hytrain.pool.page_placement()["nodes"]
    pool = hytrain.PinnedPool(1024 * MiB, slab_bytes=512 * MiB)
    t = pool.empty(512 * MiB // 4)
    pages = _pages_by_node(t.data_ptr())
    total = sum(pages.values())
    assert set(pages) <= set(nodes) and total > 0, pages
    for node in nodes:  # dealt round-robin in 2 MiB chunks: each node holds its share, give or take
        assert pages.get(node, 0) >= 0.7 * total / len(nodes), pages
