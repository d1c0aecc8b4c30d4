"""Speculation (see the package notes): offloaded blocks updated during backward under clipping, their
new state written to shadows beside the current one, adopted when the step's multiplier is 1 and
redone from the untouched state when it is not. Shadows are borrowed from GPU-resident blocks of the
same shapes (their host state is idle) or allocated within the host memory limit; the native
``BlockRuntime`` plans which."""

from __future__ import annotations

import os

import torch

from .. import _checks
from .._native import native
from .common import STATE_KEYS, local


def _rss_bytes() -> int:
    """The process's resident memory (0 where /proc is not there to tell)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Speculation:
    """Shadows, their plan, and what step() does with speculative results."""

    def _has_shadows(self, b) -> bool:
        return all(id(p) in self._shadow for p in self._blocks[b])

    def _shadow_bytes(self, b) -> int:
        return sum(local(p).numel() * 4 * sum(1 for key in ("master", *STATE_KEYS) if key in self.state[p])
                   + (local(p).numel() * p.element_size() if p.dtype != torch.float32 else 0)
                   for p in self._blocks[b] if id(p) not in self._shadow)

    def _speculation_allowed(self) -> bool:
        """Whether the next backward may speculate: clipping on CUDA, and the last step did not clip."""
        return self.speculate is not False and self._early_handoff() and not self._last_clipped

    def _set_shadow(self, p, sh):
        self._shadow[id(p)] = sh
        copy = sh.get("copy")
        self._table.set_shadow(self._index_of[id(p)], sh["master"].data_ptr(), sh["exp_avg"].data_ptr(),
                               sh["exp_avg_sq"].data_ptr(), _checks.address(sh.get("max_exp_avg_sq")),
                               copy.data_ptr() if copy is not None else 0)

    def _drop_shadow(self, p):
        if self._shadow.pop(id(p), None) is not None:
            self._table.clear_shadow(self._index_of[id(p)])

    def _borrow(self, b, r):
        for p, q in zip(self._blocks[b], self._blocks[r]):
            st = self.state[q]
            sh = {key: st[key] for key in ("master", *STATE_KEYS) if key in st}
            if p.dtype != torch.float32:
                sh["copy"] = self._staging[id(q)][0]
            self._set_shadow(p, sh)
        self._lent[b] = r

    def _reclaim(self, r):
        """Donor r is about to need its host state again (it moves down): its borrower stops
        speculating once its pass in flight (which may read or write that memory) is done."""
        for b in [b for b, d in self._lent.items() if d == r]:
            if self._rt.in_flight(b):
                self._wait_blocks([b])
            for p in self._blocks[b]:
                self._drop_shadow(p)
            del self._lent[b]

    def _shadow_plan(self, lowest_start):
        """From the last block down to ``lowest_start``: (block, donor or None) for each offloaded
        block that can have shadows, borrowed from a GPU-resident donor of the same shapes whose host
        state nothing reads, or allocated within the host limit and the pool's capacity; stops at the
        first that cannot (the native BlockRuntime.plan_shadows)."""
        rt, n = self._rt, len(self._blocks)
        has = [self._has_shadows(b) for b in range(n)]
        taken = set(self._lent.values())
        ready = []
        for r in range(n):
            ev = self._mig_events.get(r)
            ready.append(rt.on_gpu(r) and r not in taken and (ev is None or ev.query()))
        need = [0 if has[b] else self._shadow_bytes(b) for b in range(n)]
        room = 0
        if not all(has[max(0, lowest_start):]):  # host headroom, read only if some block needs memory
            stats = self._pool.stats()
            free = stats["reserved"] - stats["in_use"]
            room = min(self.host_memory_limit - _rss_bytes() + free, stats["capacity"] - stats["in_use"])
        plan = rt.plan_shadows(lowest_start, has, self._signatures, ready, need, room)
        return [(b, donor if donor >= 0 else None) for b, donor in plan]

    def _speculation_floor(self):
        """The lowest block from which every offloaded block has, or could get, shadows (None: not
        even the last block)."""
        if not self._speculation_allowed():
            return None
        plan = self._shadow_plan(0 if self.speculate == "auto" else self.speculate)
        return plan[-1][0] if plan else None

    def _speculate_from(self, start) -> None:
        """Blocks >= start speculate in the next backward. Their shadows are borrowed from GPU-resident
        blocks of the same shapes where there are such, else allocated (from the last block down;
        where neither is possible, the start rises). Allocation is slow the first time
        (page-locking), so the iteration it falls in is not measured."""
        self._spec_from = None
        if start is None or not self._speculation_allowed():
            return
        allocated = False
        for b, donor in self._shadow_plan(start):
            if donor is not None:
                self._borrow(b, donor)
            elif not self._has_shadows(b):
                try:
                    for p in self._blocks[b]:
                        st = self.state[p]
                        sh = {key: self._pool.empty(st[key].shape, torch.float32)
                              for key in ("master", *STATE_KEYS) if key in st}
                        if p.dtype != torch.float32:
                            sh["copy"] = self._pool.empty(local(p).shape, p.dtype)
                        self._set_shadow(p, sh)
                        allocated = True
                except MemoryError:  # the pool's capacity: speculation starts above this block
                    for p in self._blocks[b]:
                        self._drop_shadow(p)
                    break
            self._spec_from = b
        if allocated and self._meter is not None:
            self._meter.pending = None  # the allocation stalled this iteration: not a measurement

    def _adopt(self, keep=()):
        """The multiplier is 1: the speculative states are the step's result; the old ones become
        the shadows (the passes still writing them are waited for before anything reads them).
        Blocks in ``keep`` (their gradients changed after the hand-off) stay speculated for _restage."""
        rt = self._rt
        adopted = [b for b in rt.in_phase(native().BlockPhase.speculated) if b not in keep]
        self.speculation_counts["adopted"] += len(adopted)
        for b in adopted:
            donor = self._lent.get(b)
            twin = {} if donor is None else {id(p): q for p, q in zip(self._blocks[b], self._blocks[donor])}
            for h in rt.handed(b):
                p = self._params[h]
                st, sh = self.state[p], self._shadow[id(p)]
                for key in ("master", *STATE_KEYS):
                    if key in st:
                        st[key], sh[key] = sh[key], st[key]
                        if donor is not None:  # the donor's state entries follow the spare set
                            self.state[twin[id(p)]][key] = sh[key]
                self._table.adopt(h)
                if donor is not None:
                    self._restate(twin[id(p)])
            rt.launch(b)

    def _redo(self, b, mult):
        """Clipping fired: block b is updated again from its untouched state with the multiplier;
        the gradients are still in staging. (The pipeline lets the speculative pass finish first.)"""
        rt = self._rt
        handles = list(rt.handed(b))
        ps = [self._params[h] for h in handles]
        if self.timeline is not None:
            self._pass_owner[b] = self.timeline.current
        if self._meter is not None:
            self._meter_owner[b] = self._meter.current
        self._sync_groups()
        self._pipeline.stage(b, self._table, handles, [0] * len(ps), [local(p).data_ptr() for p in ps], float(mult),
                             torch.cuda.current_stream(self.device).cuda_stream, redo=True)
        self._alive[b] = [local(p).detach() for p in ps]
        rt.set_in_flight(b)
        rt.launch(b)  # (until here a failure leaves it to _drop_held)
        self.speculation_counts["redone"] += 1
