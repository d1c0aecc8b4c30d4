"""Pinned host memory pool, viewed from Python as torch CPU tensors without copies.

Master weights, Adam states and copy staging live here. With a usable GPU the memory is page-locked
(``cudaHostAlloc``), so host-device copies run asynchronously at full speed; otherwise it is
page-aligned ordinary memory, and :attr:`PinnedPool.kind` says which. A tensor returned by
:meth:`PinnedPool.empty` keeps its block alive: the memory goes back to the pool only when the last
view of it is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import torch

from . import _checks
from ._native import native
from .distributed import process_cpus

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_bytes(name: str, value, lo: int = 0) -> int:
    """Accepts an integer byte count (at least ``lo``) or a string such as ``"24GiB"`` or ``"512 MB"``."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} must be a byte count like '24GiB' or '512MB', got {value!r}")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    return _checks.integer(name, value, lo=lo)


def format_bytes(n: int) -> str:
    """``n`` bytes as GiB (MiB below one GiB, KiB below one MiB but above 0), two decimals."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 or n <= 0 else f"{n / 2**10:.2f} KiB"


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_total_bytes() -> int:
    """The host memory this process may use in all: the machine's, or a cgroup's (v2 or v1) limit
    below it."""
    total = physical_memory_bytes()
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < total:
            total = int(raw)
        break
    return total


def host_margin(available) -> int:
    """The host memory kept free beside the pinned state, where ``available`` bytes are: 1 GiB, and
    5 % of that or a tenth of the memory the process may use in all, whichever is more. Pinned
    pages cannot be swapped: the kernel, the page cache of the libraries the process runs, its own
    growth and the pool's slack live in this margin, and a state that leaves less gets the process
    killed by the kernel's OOM killer rather than refused (a 20 B state planned to within 1 GiB and
    5 % of a 135 GB host was)."""
    return (1 << 30) + max(available // 20, memory_total_bytes() // 10)


def available_memory_bytes() -> int | None:
    """Host memory this process can still take without swapping or being killed: the system's
    ``MemAvailable``, less under a cgroup (v2 or v1) limit; None where neither can be read.
    Page-locked memory cannot be swapped, so this bounds what a pool can pin."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = Path(limit_file).read_text().strip()
            if raw != "max" and int(raw) < (1 << 60):
                found.append(max(0, int(raw) - int(Path(usage_file).read_text().strip())))
            break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


# What the kernel did while memory was taken: huge pages given (or not), reclaim and compaction the
# faulting threads had to do themselves, from /proc/vmstat (the whole system's counts).
_VM_COUNTERS = ("thp_fault_alloc", "thp_fault_fallback", "pgscan_direct", "pgsteal_direct",
                "compact_stall", "allocstall_normal", "allocstall_movable", "pgmajfault")


def memory_counters() -> dict:
    """The host's memory counters now: ``free_gb``, ``cached_gb`` (the page cache), ``cgroup_gb``
    (this process's cgroup's usage, v2) where those can be read, and the kernel's counts in
    ``_VM_COUNTERS``. Read before and after a large allocation, they say why it took the time it
    did (:func:`counter_changes`)."""
    out = {}
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                if key in ("MemFree", "Cached"):
                    out["free_gb" if key == "MemFree" else "cached_gb"] = round(int(value.split()[0]) * 1024 / 1e9, 1)
    with contextlib.suppress(OSError, ValueError):
        out["cgroup_gb"] = round(int(Path("/sys/fs/cgroup/memory.current").read_text()) / 1e9, 1)
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/vmstat") as f:
            for line in f:
                key, value = line.split()
                if key in _VM_COUNTERS:
                    out[key] = int(value)
    return out


def counter_changes(before: dict, after: dict) -> dict:
    """The kernel's counts between two :func:`memory_counters` readings (only those that moved)."""
    return {k: after[k] - before[k] for k in _VM_COUNTERS if k in before and k in after and after[k] != before[k]}


def page_placement() -> dict:
    """How new slabs' pages are placed: ``{"policy": "spread" | "local", "nodes": [ids]}``, the NUMA
    nodes this process may run on. ``spread`` (the default) deals a slab's 2 MiB chunks round-robin
    over those nodes, so that one process's update threads use every node's memory channels;
    ``HYTRAIN_PAGE_PLACEMENT=local`` leaves each slab on the node of the thread that made it."""
    nat = native()
    try:
        policy = nat.page_placement()
    except RuntimeError as e:
        raise ValueError(str(e).split(" (")[0] if "HYTRAIN_PAGE_PLACEMENT" in str(e) else str(e)) from None
    nodes = [n["id"] for n in nat.numa_nodes()]
    return {"policy": policy if len(nodes) > 1 else "local", "nodes": nodes}


class CapacityError(MemoryError):
    """The optimizer state (or a streamed model) does not fit where it must live, found before any
    of it is allocated: a ``MemoryError`` whose message names the bytes needed and available on each
    side, and what would make it fit.

    Raised by :class:`HybridAdamW` at its first step (or the first backward on CUDA) when neither the
    host nor the GPU can hold the states, by ``set_gpu_blocks`` for a k whose states cannot go where
    it would put them (the host has no room for the blocks moved back, or streamed layers keep theirs
    on the host), and by :func:`stream_model` when the model does not fit on the GPU even streamed.
    ``hytrain train`` reports it in one line and exits with status 2."""


def _document_native_errors() -> None:
    """Docstrings for the exceptions of the native module (pybind11 makes their classes without one)."""
    try:
        nat = native()
    except ImportError:  # (no native build: nothing to document; native() says why at first use)
        return
    nat.PoolExhaustedError.__doc__ = (
        "A host allocation failed: a :class:`PinnedPool` asked for more than its capacity left free, or the "
        "system refused the memory (page-locked or not). A ``MemoryError`` raised by the allocation itself, "
        "not checked beforehand as :class:`CapacityError` is; its message names the bytes requested and "
        "available. Raise the pool's capacity (``hytrain train --pin-limit``) or train a smaller model. The "
        "class is ``hytrain_native.PoolExhaustedError``, also reached as ``hytrain.PoolExhaustedError``.")
    nat.DeviceTimeoutError.__doc__ = (
        "A wait on device work passed its deadline: a ``TimeoutError`` raised by a wait given a timeout "
        "(``CopyStream.wait(timeout=...)``, the native ``OffloadPipeline.wait_ready(..., timeout_s)``; "
        "HybridAdamW waits without one), naming what had not finished (a copy ticket and how many copies were "
        "done, or a block not yet updated). The work itself goes on. The class is "
        "``hytrain_native.DeviceTimeoutError``, also reached as ``hytrain.DeviceTimeoutError``.")


_document_native_errors()


class PinnedPool:
    """A capacity-limited pool of (page-locked when possible) host memory.

    Args:
        capacity: most bytes the pool may hold (int or string like ``"64GiB"``); default 80% of the
            machine's physical memory. Past it, allocation raises :class:`PoolExhaustedError`.
        slab_bytes: size of each slab reserved from the system (larger requests get their own).
        pinned: ``"auto"`` (page-locked when a GPU is usable), ``True`` (page-locked, or an error)
            or ``False`` (ordinary page-aligned memory).
        alignment: alignment of every block, a power of two up to 4096 bytes.
    """

    def __init__(self, capacity=None, *, slab_bytes="256MiB", pinned="auto", alignment: int = 256):
        capacity = int(0.8 * physical_memory_bytes()) if capacity is None else capacity
        capacity = parse_bytes("capacity", capacity, lo=1)
        slab = parse_bytes("slab_bytes", slab_bytes, lo=1)
        alignment = _checks.integer("alignment", alignment, lo=1)
        if alignment & (alignment - 1) or alignment > 4096:
            raise ValueError(f"alignment must be a power of two <= 4096, got {alignment}")
        nat = native()
        if pinned == "auto":
            pinned = nat.cuda_available()
        elif not isinstance(pinned, bool):
            raise TypeError(f"pinned must be 'auto', True or False, got {pinned!r}")
        elif pinned and not nat.cuda_available():
            raise ValueError("pinned=True needs CUDA compiled in and a usable GPU; use pinned='auto'")
        self.placement = page_placement()  # before any slab is made: a bad setting fails here
        self._pool = nat.PinnedPool(capacity, slab, pinned, alignment)
        self._slab = slab
        self.alignment = alignment  # every block's size is rounded up to it
        self.slab_bytes = slab

    @property
    def kind(self) -> str:
        """``"cuda-registered"`` (page-locked) or ``"page-aligned"``."""
        return self._pool.kind

    @property
    def page_locked(self) -> bool:
        return self._pool.page_locked

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised CPU tensor backed by pool memory (no copy)."""
        return self._take(shape, dtype)[0]

    def zeros(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero CPU tensor backed by pool memory. Memory the pool hands out for the first time is
        zero already (fresh pages) and is not written again: making a large state then touches its
        moments once, not twice."""
        t, zeroed = self._take(shape, dtype)
        return t if zeroed else t.zero_()

    def _take(self, shape, dtype):
        """(an uninitialised tensor over pool memory, whether that memory is known to be zero)."""
        if isinstance(shape, int):
            shape = (shape,)
        shape = tuple(_checks.integer("shape", s, lo=0) for s in shape)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        numel = 1
        for s in shape:
            numel *= s
        if numel == 0:
            return torch.zeros(shape, dtype=dtype), True
        itemsize = torch.empty((), dtype=dtype).element_size()
        block = self._pool.allocate(numel * itemsize)
        return torch.frombuffer(block, dtype=dtype, count=numel).view(shape), block.zeroed

    def copy_of(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A pool-backed copy of ``t`` (any device), optionally converted to ``dtype``."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
        out = self.empty(t.shape, dtype or t.dtype)
        out.copy_(t.detach())
        return out

    def stats(self) -> dict:
        """Bytes: capacity, reserved, in_use, peak_in_use, largest_free; counts: slabs, allocations."""
        return dict(self._pool.stats())

    def reserve_for(self, nbytes, threads: int | None = None) -> int:
        """Reserves, on ``threads`` threads at once (default: the usable cores, at most 16), the slabs
        that allocations of these byte sizes will take: each request of a slab or more its own slab,
        the smaller ones packed into slabs (one more for the tails). Page-locking is what makes a
        large state slow to create, and it scales with threads (bench/pin_rate.cu). Returns the
        bytes reserved; :meth:`trim` releases what the allocations left unused."""
        page, small, slabs = os.sysconf("SC_PAGE_SIZE"), 0, []
        for n in nbytes:
            n = int(n)
            if n <= 0:
                continue
            if -(-n // page) * page >= self._slab:
                slabs.append(-(-n // page) * page)
            else:
                small += n
        # Within the pool's room, as the allocations themselves would be: a speed-up, never a new
        # way to fail (what does not fit is left to the allocations, which say so).
        stats = self.stats()
        room = stats["capacity"] - stats["reserved"] - sum(slabs)
        if room < 0:
            return 0
        # The tails (a small request does not fit a slab's rest): 256 MiB more at most; what is still
        # short takes a slab when it is allocated.
        small += min(self._slab, 256 << 20) if small else 0
        while small > 0 and room >= page:
            take = min(self._slab, -(-small // page) * page, room // page * page)
            slabs.append(take)
            small -= take
            room -= take
        if threads is None:
            threads = min(16, process_cpus())
        return self._pool.reserve(slabs, _checks.integer("threads", threads, lo=1))

    def trim(self) -> int:
        """Returns empty slabs to the system; returns the bytes released."""
        return self._pool.trim()

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PinnedPool(kind={self.kind}, in_use={s['in_use']}, reserved={s['reserved']}, "
                f"capacity={s['capacity']}, slabs={s['slabs']})")
