"""Speculation shadows: what a speculative pass of an offloaded block writes instead of its state.
For each parameter either a second host state (master, m, v, and weight staging), registered in the
native ``ParamTable`` as its shadow slots -- adopted by swapping it with the state -- or, for fp32
states without amsgrad, an undo record (3 bytes a parameter of distances, an escape list and two
counters, see the native adamw.h) of a pass that updates the state in place. Shadows are taken from
the pinned pool within the host's headroom, from the last block down, and given back when a block
goes to the GPU or the host needs the room for states coming back.

Page-locking their memory is slow (seconds for some GB on a host whose memory is touched for the
first time), and so is giving it back: neither runs on the training thread after the first step.
The first step locks the room that speculation is likely to take beside the state's own
(:meth:`Shadows.reserve_ahead`); what more a later start needs is locked on a thread of its own
(:meth:`Shadows.reserve_in_background`), and what the shadows leave is given back there too, once
the speculation has held (:meth:`Shadows.trim_in_background`). ``work_log`` times that work, for
the benchmarks' timelines."""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from .. import _checks
from .._native import native
from . import budgets
from .common import STATE_KEYS, like, local

STATE_AND_MASTER = ("master", *STATE_KEYS)
BACKGROUND_LOCK_THREADS = 4  # page-locking threads beside the training: the update workers keep the rest
WORK_LOG = 64  # the pool work kept in ``Shadows.work_log`` (the most recent)


def undo_capacity(n) -> int:
    """The escape entries of a parameter's undo record (the native adamw.h's rule)."""
    return native().undo_capacity(n)


class Shadows:
    """``entries``: id(p) -> the parameter's shadow (spare host master/exp_avg/exp_avg_sq
    [/max_exp_avg_sq], or an undo record: codes/escapes/counters; and ``copy``, the weight staging
    of a bf16/fp16 parameter), registered in ``table``; allocated from ``pool``. ``state``: the
    optimizer's state dict (the state a shadow stands beside)."""

    def __init__(self, plan, settings, rt, state, pool, table, streams=lambda b: False):
        self.plan, self.settings, self.rt, self.state, self.pool, self.table = plan, settings, rt, state, pool, table
        self.streams = streams  # whether a block streams its weights (window.py)
        self.entries = {}
        self.lock_rate = None  # bytes/s at which the pool page-locked new slabs, at the last reserve
        self._work = None  # the thread of the pool's background work in flight (locking or giving back)
        self.lock_error = None  # why the last background reservation failed, if it did
        # (kind, start, end, bytes) of the pool work done for shadows, time.perf_counter() seconds:
        # "ahead" (the first step), "lock" and "trim" (in the background)
        self.work_log = deque(maxlen=WORK_LOG)
        # The pool (our own) may hold wholly free slabs to give back, in the background, once the
        # plan has held (the planner's give_back_when_quiet): slabs locked ahead or for shadows that
        # were not all taken, or the host memory of states that went to the GPU.
        self.trim_due = False

    def rebind(self, state) -> None:
        """``optimizer.state`` is another dict now (see ``StateStore.rebind``)."""
        self.state = state

    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for sh in self.entries.values() for t in sh.values())

    def has(self, b) -> bool:
        return all(id(p) in self.entries for p in self.plan.blocks[b])

    def need(self, b) -> int:
        """The pool bytes block b's shadows would take (0 where it has them)."""
        return self._need(b)

    def free_room(self):
        """Bytes the pool has page-locked and not handed out (shadows carved there cost no new
        locking); None where the pool does not page-lock (nothing to pace)."""
        if not self.pool.page_locked:
            return None
        stats = self.pool.stats()
        return max(0, stats["reserved"] - stats["in_use"])

    def _need(self, b) -> int:
        return 0 if self.has(b) else sum(self._tensor_bytes(b))

    def _records(self, p) -> bool:
        """Whether parameter p speculates with an undo record (a format that has them, fp32, without
        amsgrad; see the native adamw.h) rather than a copy of its state."""
        n = local(p).numel()
        return self.settings.format.undo_records and not self.plan.amsgrad(p) and 0 < n < 2 ** 32

    def _tensor_bytes(self, b) -> list[int]:
        """The pool bytes of block b's shadows: undo records (3 bytes a parameter, the escape list and
        the weight staging), or copies of the state where records do not apply."""
        out = []
        for p in self.plan.blocks[b]:
            n = local(p).numel()
            if not n:
                continue
            if self._records(p):
                sizes = [3 * n, 16 * undo_capacity(n), 16]
                if p.dtype != torch.float32:
                    sizes.append(p.element_size() * n)
            else:
                st = self.state[p]
                sizes = [st[key].numel() * st[key].element_size() for key in STATE_AND_MASTER if key in st]
                if p.dtype != torch.float32:
                    sizes.append(p.element_size() * n)
            out += budgets.in_pool(self.settings, sizes)
        return out

    def _set(self, p, sh):
        self.entries[id(p)] = sh
        copy = sh.get("copy")
        if "codes" in sh:
            n, codes = local(p).numel(), sh["codes"].data_ptr()
            self.table.set_record(self.plan.index(p), codes, codes + n, codes + 2 * n, sh["escapes"].data_ptr(),
                                  sh["escapes"].numel() // 4, sh["counters"].data_ptr(),
                                  copy.data_ptr() if copy is not None else 0)
            return
        self.table.set_shadow(self.plan.index(p), sh["master"].data_ptr(), sh["exp_avg"].data_ptr(),
                              sh["exp_avg_sq"].data_ptr(), _checks.address(sh.get("max_exp_avg_sq")),
                              copy.data_ptr() if copy is not None else 0)

    def drop(self, p):
        if self.entries.pop(id(p), None) is not None:
            self.table.clear_shadow(self.plan.index(p))

    def drop_all(self, wait) -> None:
        """Every block's shadows go, once the passes that may read or write them (``wait``: waits
        for blocks' updates in flight) have finished."""
        holding = [b for b in range(len(self.plan)) if any(id(p) in self.entries for p in self.plan.blocks[b])]
        wait([b for b in holding if self.rt.in_flight(b)])  # their passes may read or write the shadows
        for b in holding:
            for p in self.plan.blocks[b]:
                self.drop(p)

    def reserve_ahead(self, blocks, threads=None) -> int:
        """Page-locks now what these blocks' shadows need beyond the pool's free room, on as many
        threads as the state's own reservation: at the first step, where the pool is making memory
        anyway, so that speculation's first starts find their memory locked. Returns the bytes
        locked (0 where nothing is short, or where the pool or the system has no room: the shadows
        are then locked when asked for, as without this)."""
        short = self._short(blocks)
        if short <= 0:
            return 0
        try:
            return self._lock(short, threads=threads, kind="ahead")
        except (MemoryError, RuntimeError) as e:
            self.lock_error = str(e)
            return 0

    def reserve_in_background(self, blocks) -> bool:
        """Starts page-locking what these blocks' shadows need beyond the pool's free room (slabs of
        the pool's size, into which the shadows are carved) on a thread of its own (a few
        page-locking threads), so that no step waits for it; the blocks take their shadows from
        that room once it is there (:meth:`pool_idle`), and :meth:`trim_in_background` gives back
        what they leave. Returns whether a reservation started (not while pool work is in flight,
        nor where nothing is short)."""
        if self._work is not None:
            return False
        short = self._short(blocks)
        if short <= 0:
            return False

        def lock():
            try:
                self._lock(short, threads=BACKGROUND_LOCK_THREADS, kind="lock")
            except (MemoryError, RuntimeError) as e:  # the pool's capacity, the system's memory:
                self.lock_error = str(e)  # the shadows then fit where they can (allocate says so)

        self._start(lock)
        return True

    def trim_later(self) -> None:
        """The pool's wholly free slabs are to go back to the system, off the training thread, once
        the plan has held (a pool of our own; one given is its owner's to trim)."""
        self.trim_due = self.settings.pool is None

    def trim_in_background(self) -> bool:
        """Starts giving the pool's wholly free slabs back to the system (unlocking and unmapping
        them, tens of ms a GB) on a thread of its own. Returns whether it started (not while pool
        work is in flight)."""
        if self._work is not None:
            return False

        def trim():
            began = time.perf_counter()
            released = self.pool.trim()
            self._log("trim", began, released)

        self._start(trim)
        return True

    def _start(self, fn) -> None:
        self._work = threading.Thread(target=fn, name="hytrain-shadows")
        self._work.start()

    def pool_idle(self) -> bool:
        """Whether no background pool work is in flight (work that has finished is joined)."""
        if self._work is not None:
            if self._work.is_alive():
                return False
            self._work.join()
            self._work = None
        return True

    def _short(self, blocks) -> int:
        if not blocks or not self.pool.page_locked:
            return 0
        stats = self.pool.stats()
        return sum(n for b in blocks for n in self._tensor_bytes(b)) - (stats["reserved"] - stats["in_use"])

    def _lock(self, short, threads, kind) -> int:
        slab = self.pool.slab_bytes
        slabs = -(-short // slab)
        start = time.perf_counter()
        self.pool.reserve_for([slab] * slabs, threads=threads)
        self.lock_rate = slabs * slab / max(time.perf_counter() - start, 1e-6)
        self._log(kind, start, slabs * slab)
        return slabs * slab

    def _log(self, kind, began, nbytes) -> None:
        self.work_log.append((kind, began, time.perf_counter(), int(nbytes)))

    def allocate(self, b) -> bool:
        """Block b's own shadows from the pool; False (and none) where its capacity is reached."""
        try:
            for p in self.plan.blocks[b]:
                st = self.state[p]
                n = local(p).numel()
                if self._records(p):
                    sh = {"codes": self.pool.empty((3 * n,), torch.int8),
                          "escapes": self.pool.empty((4 * undo_capacity(n),), torch.int32),
                          "counters": self.pool.zeros((2,), torch.int64)}
                else:
                    sh = {key: like(self.pool.empty(st[key].shape, st[key].dtype), local(p))
                          for key in STATE_AND_MASTER if key in st}
                if p.dtype != torch.float32:
                    sh["copy"] = like(self.pool.empty(local(p).shape, p.dtype), local(p))
                self._set(p, sh)
        except MemoryError:
            for p in self.plan.blocks[b]:
                self.drop(p)
            return False
        return True

    def plan_from(self, lowest_start, free_left):
        """From the last block down to ``lowest_start``: each offloaded block that has, or can get,
        shadows within the host headroom (what ``host_memory_limit`` and the pool leave); stops at
        the first that cannot (the native BlockRuntime.plan_shadows). ``free_left()`` gives back the
        host memory of states that went to the GPU where their copies have read it, and tells whether
        some is still waiting for them."""
        rt, n = self.rt, len(self.plan)
        has = [self.has(b) for b in range(n)]
        need = [0 if has[b] else self._need(b) for b in range(n)]
        # A streamed block's home stages its gradients, which a speculative update would have to keep
        # beside the weights it writes: it does not speculate (nor the blocks below it).
        for b in range(n):
            if self.streams(b):
                has[b], need[b] = False, 1 << 62
        room = 0
        # Host headroom, read only if some block needs memory, and only once the host memory of
        # states that went to the GPU has been given back (their copies may still read it).
        leaving = free_left()
        if not all(has[max(0, lowest_start):]) and not leaving:
            room = budgets.shadow_room(self.pool, self.settings)
        return rt.plan_shadows(lowest_start, has, need, max(0, room))

    def swap(self, p, st) -> bool:
        """Parameter p's shadow becomes its state (``st``: its entry in ``optimizer.state``) and the
        old state its shadow; False for an undo record (updated in place: that is the state already)."""
        sh = self.entries[id(p)]
        if "codes" in sh:
            return False
        for key in STATE_AND_MASTER:
            if key in st:
                st[key], sh[key] = sh[key], st[key]
        return True
