"""The GPU side of the state: the device tensors of GPU-resident blocks (master, m, v, max v and the
gradient buffer their fused updates read), the fused CUDA AdamW over them, and the asynchronous
moves of blocks' states between pinned host memory and the GPU on a migration stream. The native
``BlockRuntime`` decides what moves; the ``StateStore`` says which host tensors a block has and
keeps the optimizer's state and the native table in step with each move; this part copies the
tensors and knows when each copy has completed."""

from __future__ import annotations

import torch

from ..cuda_adam import CudaAdamW
from . import budgets
from .common import local, span


class Residency:
    """``dev``: id(p) -> the parameter's device master/exp_avg/exp_avg_sq[/max_exp_avg_sq]/grad
    (GPU-resident blocks; read only here and by the launcher); ``moves``: block -> CUDA event: its
    states' move to the host has completed. ``pool``: where host tensors leaving go back."""

    def __init__(self, plan, settings, rt, device, pool, trim_later=lambda: None):
        self.plan, self.settings, self.rt, self.device, self.pool = plan, settings, rt, device, pool
        self.trim_later = trim_later  # the pool's free slabs to go back off the training thread (shadows.py)
        self.dev = {}
        self.moves = {}
        self._leaving = {}  # block -> (event, host tensors) freed once its move to the GPU has read them
        self._fused = {}  # ((id, address) of each parameter) -> CudaAdamW
        self._stream = None

    def start(self) -> None:
        """The migration stream (CUDA parameters)."""
        self._stream = torch.cuda.Stream(self.device, priority=0)

    def add(self, p, d) -> None:
        """Parameter p's state made on the GPU: ``d``, its device tensors."""
        self.dev[id(p)] = d

    def discard(self, p) -> None:
        self.dev.pop(id(p), None)

    def up(self, b, entries, placed) -> None:
        """Starts moving block b's states to the GPU. ``entries``: (parameter, its entry in
        ``optimizer.state``, the keys of its state), whose tensors are replaced by device ones;
        ``placed(p)``, once p's copies are queued: the owner's record of the move, returning host
        tensors those copies may still read. The host tensors are let go once the copies have read
        them (:meth:`free_left`); the compute stream waits for the copies."""
        compute = torch.cuda.current_stream(self.device)
        moving = []
        for p, st, keys in entries:
            d = {key: torch.empty_like(st[key], device=self.device)
                 for key in keys if key != "master" or p.dtype != torch.float32}
            d["grad"] = torch.empty_like(local(p))
            moving.append((p, st, keys, d))
        # Fresh allocations may reuse memory that queued compute-stream work still reads.
        self._stream.wait_stream(compute)
        leaving = []
        with torch.cuda.stream(self._stream):
            for p, st, keys, d in moving:
                for key, t in d.items():
                    if key != "grad":
                        t.copy_(st[key], non_blocking=True)
                if p.dtype == torch.float32:
                    d["master"] = local(p).detach()  # fp32 weights are their own master (the last update wrote them)
                leaving += [st[key] for key in keys]
                for key in keys:
                    st[key] = d[key]
                self.dev[id(p)] = d
                leaving += placed(p)
        done = torch.cuda.Event()
        done.record(self._stream)
        compute.wait_event(done)  # any later read of the state on the GPU follows the copy
        self._leaving[b] = (done, leaving)
        self.rt.moved_up(b)

    def down(self, b, entries, placed) -> None:
        """Starts moving block b's states to the host. ``entries``: (parameter, its entry in
        ``optimizer.state``, its new host tensors, the keys of its state); ``placed(p, host)``, once
        p's copies are queued: the owner's record of the move. The device tensors are freed once the
        copies have read them; the host waits for them in :meth:`migration_done`."""
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # after the block's last update
        with torch.cuda.stream(self._stream):
            for p, st, host, keys in entries:
                d = self.dev.pop(id(p))
                for key in keys:
                    host[key].copy_(d[key], non_blocking=True)
                    if key != "master" or p.dtype != torch.float32:
                        d[key].record_stream(self._stream)  # freed only after the copy
                    st[key] = host[key]
                d["grad"].record_stream(self._stream)
                placed(p, host)
        self.drop_fused({id(p) for p in self.plan.blocks[b]})
        done = torch.cuda.Event()
        done.record(self._stream)
        self.moves[b] = done
        self.rt.moved_down(b)

    def migration_done(self, b, *, host):
        """Before block b's states are used: the host waits for a move down (normally long done).
        (The compute stream already follows a move up.)"""
        ev = self.moves.pop(b, None)
        if ev is not None and host:
            ev.synchronize()
        self.free_left()

    def settle(self):
        """Completes every move started (``StateStore.settle`` starts those waiting to go up first)."""
        for b in list(self.moves):
            self.moves.pop(b).synchronize()
        self.free_left(wait=True)

    def free_left(self, wait=False) -> bool:
        """The host memory of states that moved to the GPU, once their copies have read it: back to
        the pool, and the pool's wholly free slabs back to the system (a pool of our own) -- at once
        where the moves are waited for (``wait``), else on the background thread once the plan has
        held (``trim_later``): unlocking GBs would hold the training thread, and the slabs may be
        the shadows' next. Returns whether some is still waiting for its copies."""
        freed = False
        for b, (ev, _) in list(self._leaving.items()):
            if wait:
                ev.synchronize()
            if wait or ev.query():
                del self._leaving[b]
                freed = True
        if freed and wait:
            budgets.trim(self.pool, self.settings)
        elif freed:
            self.trim_later()
        return bool(self._leaving)

    def moving(self) -> list:
        return sorted(set(self.moves) | set(self._leaving))

    def fused(self, ps, gi, dtype, amsgrad):
        """The fused CUDA AdamW over these GPU-resident parameters' device states (its tables hold
        the weights' addresses: a parameter whose storage was replaced gets a new one). Returns
        (kernel, whether it was built now)."""
        key = tuple((id(p), local(p).data_ptr()) for p in ps)
        fused = self._fused.get(key)
        if fused is not None:
            return fused, False
        self.drop_fused({id(p) for p in ps})
        ds = [self.dev[id(p)] for p in ps]
        half = dtype != torch.float32
        fused = CudaAdamW([span(d["master"]) for d in ds], [span(d["exp_avg"]) for d in ds],
                          [span(d["exp_avg_sq"]) for d in ds], [span(d["grad"]) for d in ds],
                          weights=[span(local(p)) for p in ps] if half else None, amsgrad=amsgrad,
                          max_exp_avg_sqs=[span(d["max_exp_avg_sq"]) for d in ds] if amsgrad else None,
                          seeds=[self.plan.index(p) for p in ps])  # the table's seeds: the handles
        self._fused[key] = fused
        return fused, True

    def drop_fused(self, ids):
        self._fused = {key: g for key, g in self._fused.items() if not any(i in ids for i, _ in key)}
