"""Residency: where each block's fp32 master and Adam states live (pinned host memory, or the GPU for
the first k blocks), and their asynchronous moves on a migration stream. The native ``BlockRuntime``
keeps the placement and decides what moves; this module moves the tensors."""

from __future__ import annotations

import torch

from .common import STATE_KEYS, local


class Residency:
    """Moves of the blocks' states between pinned host memory and the GPU."""

    def _migrate(self, k):
        """Starts moving states so that blocks < k are GPU-resident. Nothing here waits: states go
        down on the migration stream after the compute stream's last update of them; states go up
        once the block's in-flight CPU update has finished (at its forward wait), and the compute
        stream waits for them only at the block's first GPU update."""
        up, down = self._rt.migrate(k)  # blocks with a pass in flight go up once it is waited for
        for b in up:
            self._to_gpu(b)
        for b in down:
            self._to_host(b)
        self.gpu_blocks = k

    def _to_gpu(self, b):
        for p in self._blocks[b]:  # a resident block does not speculate; nothing reads its shadows now
            self._drop_shadow(p)
        self._lent.pop(b, None)  # a donor's state entries already name the spare set
        compute = torch.cuda.current_stream(self.device)
        states = []
        for p in self._blocks[b]:
            st = self.state[p]
            d = {key: torch.empty(st[key].shape, dtype=torch.float32, device=self.device)
                 for key in STATE_KEYS if key in st}
            if p.dtype != torch.float32:
                d["master"] = torch.empty(local(p).shape, dtype=torch.float32, device=self.device)
            d["grad"] = torch.empty_like(local(p))
            states.append((p, st, d))
        # Fresh allocations may reuse memory that queued compute-stream work still reads.
        self._mig_stream.wait_stream(compute)
        with torch.cuda.stream(self._mig_stream):
            for p, st, d in states:
                for key, t in d.items():
                    if key != "grad":
                        t.copy_(st[key], non_blocking=True)
                if p.dtype == torch.float32:
                    d["master"] = local(p)  # fp32 weights are their own master
                self._dev_state[id(p)] = d
        done = torch.cuda.Event()
        done.record(self._mig_stream)
        self._mig_events[b] = done
        self._rt.moved_up(b)

    def _to_host(self, b):
        self._reclaim(b)
        self._mig_stream.wait_stream(torch.cuda.current_stream(self.device))  # after the block's last update
        with torch.cuda.stream(self._mig_stream):
            for p in self._blocks[b]:
                st, d = self.state[p], self._dev_state.pop(id(p))
                for key in (*STATE_KEYS, "master"):
                    if key in st:
                        st[key].copy_(d[key], non_blocking=True)
                        if key != "master" or p.dtype != torch.float32:
                            d[key].record_stream(self._mig_stream)  # freed only after the copy
                d["grad"].record_stream(self._mig_stream)
        self._drop_gpu_groups({id(p) for p in self._blocks[b]})
        done = torch.cuda.Event()
        done.record(self._mig_stream)
        self._mig_events[b] = done
        self._rt.moved_down(b)

    def _migration_done(self, b, *, host):
        """Before block b's states are used: the host waits for a move down (normally long done);
        the compute stream waits for a move up."""
        ev = self._mig_events.pop(b, None)
        if ev is None:
            return
        if host:
            ev.synchronize()
        else:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def _settle_migrations(self):
        for b in self._rt.take_up():
            self._to_gpu(b)
        for b in list(self._mig_events):
            self._mig_events.pop(b).synchronize()

    def _resident_bytes(self):
        rt = self._rt
        return sum(s for b, s in enumerate(self._state_bytes) if rt.on_gpu(b) or rt.moving_up_later(b))
