"""The state's memory budgets: the pinned host bytes each block's state and staging take (each tensor
rounded up to the pool's alignment), the room the host gives them (what this process can still
take, less a margin, or the room left in a pool given by the caller), the host's floor (the
blocks whose states the host cannot hold live on the GPU), the default pool's size, and the
refusals that name the bytes on each side. Functions over what they are given: nothing here keeps
state (the ``StateStore`` does)."""

from __future__ import annotations

import os

import torch

from ..distributed import process_cpus
from ..pool import CapacityError, PinnedPool, available_memory_bytes, format_bytes, host_margin
from .common import local

_MORE_ROOM = ("leave the GPU more room (a smaller batch, activation checkpointing, a larger gpu_memory_limit), "
              "or use a host with more memory")


def _rss_bytes() -> int:
    """The process's resident memory (0 where /proc is not there to tell)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# -- bytes ---------------------------------------------------------------------------------------------

def in_pool(settings, sizes) -> list[int]:
    """Each size rounded up to the pool's alignment."""
    pool = settings.pool
    align = pool.alignment if pool is not None else 256
    return [-(-size // align) * align for size in sizes]


def tensor_bytes(plan, settings, cuda, b, homes=lambda p: None) -> list[int]:
    """The pool bytes of every host tensor of block b's parameters (``StateStore._host_state``):
    m, v (and amsgrad's max v), the fp32 master of a CUDA or low-precision parameter, the staging of
    a CUDA one (none for a streamed one: ``homes(p)`` is its home, which stages its gradients); each
    rounded up to the pool's alignment."""
    out = []
    for p in plan.blocks[b]:
        n = local(p).numel()
        if not n:
            continue
        sizes = [plan.moment_bytes(n)] * 2 + ([4 * n] if plan.amsgrad(p) else [])  # m, v, max v
        if p.dtype != torch.float32 or cuda:
            sizes.append(4 * n)  # master
        if cuda and homes(p) is None:
            sizes.append(p.element_size() * n)  # staging
        out += in_pool(settings, sizes)
    return out


def block_host_bytes(plan, settings, cuda, homes=lambda p: None) -> list[int]:
    """Per block, the pinned host bytes its state and staging take while the CPU updates it."""
    return [sum(tensor_bytes(plan, settings, cuda, b, homes)) for b in range(len(plan))]


def pool_bytes(per_block, floor, cuda, settings) -> int:
    """A capacity for the default pool: the host bytes of the blocks from the floor on, as many
    again for speculation shadows (a capacity only: shadows are allocated when used, within
    ``host_memory_limit``), and room for the slabs' fragmentation (memory is reserved slab by
    slab as it is used)."""
    host = sum(per_block[floor:])
    if cuda and settings.speculate is not False:
        host *= 2
    return host * 3 // 2 + (256 << 20)


def make_pools(plan, settings, cuda, floor, later, streamed, homes):
    """(the pinned pool, the pool of the streamed blocks' states or None). The pinned one is the one
    given (``settings.pool``) or our own. In our own on a GPU, the streamed blocks' states go apart,
    into ordinary memory: their weights and gradients cross PCIe through their homes, their masters
    and moments never (k stays below the first streamed block, and they do not speculate), and
    ordinary memory is much faster to make than page-locked memory (which stays for what needs it).
    The slabs the states of blocks from ``later`` on take are reserved at once, on several threads."""
    pool, unlocked = settings.pool, None
    apart = frozenset(streamed) if pool is None and cuda else frozenset()
    if pool is None:
        per_block = block_host_bytes(plan, settings, cuda, homes)
        locked = [0 if b in apart else n for b, n in enumerate(per_block)]
        pool = PinnedPool(pool_bytes(locked, floor, cuda, settings), slab_bytes=slab_bytes(locked))
        if apart:
            state = [per_block[b] for b in apart]
            unlocked = PinnedPool(sum(state) * 5 // 4 + (256 << 20), slab_bytes=slab_bytes(state), pinned=False)
    if cuda and not pool.page_locked:
        raise ValueError("CUDA parameters need a page-locked pool (PinnedPool(pinned=True or 'auto') "
                         "on a machine where pinning works)")

    def sizes(blocks):
        return [n for b in blocks for n in tensor_bytes(plan, settings, cuda, b, homes)]

    if pool.page_locked:  # page-locking is the slow part: every slab at once, in parallel
        pool.reserve_for(sizes(b for b in range(later, len(plan)) if b not in apart))
    if unlocked is not None:  # (its pages touched on several threads, where NUMA places them)
        unlocked.reserve_for(sizes(sorted(apart)), threads=min(64, process_cpus()))
    return pool, unlocked


def slab_bytes(per_block) -> int:
    """The default pool's slab: the largest block's host bytes (2 MiB multiples), at least 256 MiB.
    A block's tensors then pack into one or two slabs, and a hole one leaves is taken by the
    next's smaller tensors; in 256 MiB slabs, 20 B's 200 MB moments and staging left a quarter
    of each slab unused (20 GB of 131 GB reserved)."""
    largest = max(per_block, default=0)
    return max(256 << 20, -(-largest // (2 << 20)) * (2 << 20))


# -- room ----------------------------------------------------------------------------------------------

def host_room(settings) -> int | None:
    """The bytes the state may take on the host: what this process can still take, less a
    margin (:func:`host_margin`), or the room left in a pool given by the caller; None where the
    system does not tell."""
    pool = settings.pool
    if pool is not None:
        stats = pool.stats()
        return max(0, stats["capacity"] - stats["in_use"])
    room = available_memory_bytes()
    if room is None:
        return None
    return max(0, room - host_margin(room))


def host_headroom(pool):
    """Bytes the host can still give the pool for states (the pool's free blocks included),
    beside the margin and within the pool's capacity; None where the system does not tell."""
    stats = pool.stats()
    room = available_memory_bytes()
    if room is None:
        return None
    room = room - host_margin(room) + stats["reserved"] - stats["in_use"]
    return max(0, min(room, stats["capacity"] - stats["in_use"]))


def shadow_room(pool, settings) -> int:
    """The bytes speculation shadows may still take: what ``host_memory_limit`` leaves beside the
    process's resident memory (the pool's free blocks included), within the pool's capacity."""
    stats = pool.stats()
    free = stats["reserved"] - stats["in_use"]
    return min(settings.host_memory_limit - _rss_bytes() + free, stats["capacity"] - stats["in_use"])


def trim(pool, settings) -> None:
    """A pool of our own gives its wholly free slabs back to the system."""
    if settings.pool is None:
        pool.trim()


def host_floor(plan, settings, cuda, homes=lambda p: None) -> int:
    """The smallest k for which the host can hold the states of blocks >= k (the rest live on
    the GPU), within the memory this process can still take (or the given pool's room). Without
    CUDA every state lives on the host: one that does not fit is refused here, before anything
    is allocated."""
    per_block = block_host_bytes(plan, settings, cuda, homes)
    room = host_room(settings)
    if room is None:
        return 0
    k, rest = 0, sum(per_block)
    while k < len(per_block) and rest > room:
        rest -= per_block[k]
        k += 1
    if k and not cuda:
        raise CapacityError(
            f"the optimizer state of {_count(plan)} parameters needs {format_bytes(sum(per_block))} of pinned "
            f"host memory ({_what(settings)}), but {_room_text(settings, room)}: "
            + ("pass a pool with a larger capacity, or none (" if settings.pool is not None else "")
            + "use a host with more memory, shard the model over more processes (--nproc / FSDP2), or "
            "train a smaller model" + (")" if settings.pool is not None else ""))
    return k


# -- refusals ------------------------------------------------------------------------------------------

def gpu_refusal(plan, settings, cuda, state_bytes, k, free, homes=lambda p: None) -> CapacityError:
    """The error for a state whose first k blocks must live on the GPU (``state_bytes``: each
    block's there), where ``free`` bytes are left for them: the bytes on each side."""
    per_block = block_host_bytes(plan, settings, cuda, homes)
    on_gpu = sum(state_bytes[:k])
    room = host_room(settings)
    return CapacityError(
        f"the optimizer state of {_count(plan)} parameters does not fit: it needs "
        f"{format_bytes(sum(per_block))} of pinned host memory ({_what(settings)} and staging) for all "
        f"{len(per_block)} blocks; {_room_text(settings, room or 0)}, so the first {k} blocks must "
        f"keep theirs on the GPU ({format_bytes(on_gpu)}), but {format_bytes(max(0, free))} of GPU memory is left "
        "beside the weights, gradients and activations: use a host with more memory or a larger "
        "GPU, shard the model over more processes (--nproc / FSDP2), or train a smaller model")


def deferred_refusal_below_floor(b, floor) -> CapacityError:
    """The error for a deferred block b that the GPU could not hold, below the host's floor."""
    return CapacityError(
        f"the GPU could not hold the optimizer state of block {b} in the first step, once "
        f"the other blocks' gradients were released, and the host can hold those of blocks "
        f"{floor} and after only: {_MORE_ROOM}")


def deferred_refusal_no_room(b, last, room, need) -> CapacityError:
    """The error for deferred blocks b..``last`` that neither the GPU nor the host's ``room`` holds."""
    return CapacityError(
        f"the GPU could not hold the optimizer state of block {b} in the first step, once the other "
        f"blocks' gradients were released, and the host has {format_bytes(room)} left for the "
        f"{format_bytes(need)} of blocks {b} to {last} beside its margin: {_MORE_ROOM}")


def _room_text(settings, room) -> str:
    if settings.pool is not None:
        return f"the pool given has room for {format_bytes(room)}"
    available = available_memory_bytes() or 0
    return (f"the host memory available to this process is {format_bytes(available)}, "
            f"{format_bytes(room)} of it for the state ({format_bytes(host_margin(available))} is kept "
            "for the rest)")


def _what(settings) -> str:
    fmt = settings.format
    return "fp32 master, m and v" + ("" if fmt.dtype == torch.float32 else f" in {fmt.name}")


def _count(plan) -> str:
    n = sum(local(p).numel() for p in plan.params)
    return f"{n / 1e9:.2f} B" if n >= 10**9 else f"{n / 1e6:.2f} M" if n >= 10**6 else str(n)
