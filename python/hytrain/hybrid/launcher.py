"""The launcher: how a block's update starts on each path -- the native ``UpdateEngine`` (CPU
parameters), the native ``OffloadPipeline`` (gradients to pinned memory, CPU update, weights back) or
the fused CUDA AdamW (GPU-resident blocks) -- from the parameters' handles in the native
``ParamTable``; hand-offs during backward, releases of held passes, speculative results redone,
the waits before a block is used, and what a step not taken undoes. It keeps alive what the native
side reads or writes until it is waited for."""

from __future__ import annotations

import collections

import torch

from .._native import native
from ..cpu_adam import simd_paths
from . import forks
from .common import is_sharded, local


class Launcher:

    def __init__(self, plan, settings, rt, store, intake, fence, groups):
        self.plan, self.settings, self.rt, self.store, self.intake = plan, settings, rt, store, intake
        self.fence, self.groups = fence, groups
        self.sharded = any(is_sharded(p) for p in plan.params)  # FSDP2 shards: no weight versions
        self.engine = None  # the native UpdateEngine (CPU workers), once the state exists
        self.pipeline = None  # the native OffloadPipeline (CUDA parameters)
        self.timeline = None
        self.meter = None
        self._alive = {}  # block -> what the workers read (CPU path) / the weights written (pipeline)
        self._landing = collections.deque()  # (D2H ticket, gradients it reads) until the copy lands
        self._unchecked = {}  # block -> handles adopted with undo records, checked complete when waited for
        self._counted = set()  # blocks handed off during backward whose step step() has counted
        self.counts = {"adopted": 0, "redone": 0}  # speculated block updates (the engine's)
        self._pass_owner = {}  # block -> the timeline iteration its pass belongs to
        self._meter_owner = {}  # block -> the measured iteration its pass belongs to

    def start(self, timeline) -> None:
        """The native engine (and pipeline, on CUDA) for the state just created."""
        s = self.settings
        self.engine = native().UpdateEngine(s.workers, s.slice_elements, simd_paths()["selected"])
        if self.store.cuda:
            # The weight copies gate the next forward: give them the higher priority.
            self.pipeline = native().OffloadPipeline(self.engine, self.store.device.index, 0, -1)
        self.timeline = timeline
        if timeline is not None:
            timeline.pipeline = self.pipeline
        forks.watch(self)  # quiesced before a fork; in a forked child, see forks.py

    def stop(self) -> None:
        self.engine = self.pipeline = self.timeline = self.meter = None
        self._alive, self._landing, self._unchecked = {}, collections.deque(), {}

    def _stream(self):
        return torch.cuda.current_stream(self.store.device).cuda_stream

    def hand_off(self, b, speculative, spec_mult=1.0, *, scaled=False) -> None:
        """Early hand-off of block b during backward: offloaded blocks are staged on hold (or
        speculate, with multiplier ``spec_mult``), GPU-resident blocks copy their gradients into
        their update buffers. ``scaled``: a GradScaler drives the steps (see GradientIntake.handed_off)."""
        try:
            pairs = self.intake.grads(b)
        except (RuntimeError, TypeError, ValueError):
            return  # not handed off: step() refuses the step before anything is applied
        self.intake.handed_off(b, pairs, scaled=scaled)
        release = self.settings.release_grads
        if self.rt.on_gpu(b):
            for p, g in pairs:
                self.store.residency.dev[id(p)]["grad"].copy_(g)
            self.rt.hold(b, self.plan.handles(p for p, _ in pairs))
            if release:
                for p, _ in pairs:
                    p.grad = None
        else:
            self.launch(b, spec_mult if speculative else 1.0, release=release, hold=not speculative,
                        speculative=speculative)

    def launch(self, b, grad_scale, *, release, hold=False, speculative=False, pairs=None):
        """Starts block b's update with gradient multiplier ``grad_scale``. ``release`` drops the
        parameters' ``.grad`` (the GPU memory returns once the gradient copy has landed). ``hold``
        (offloaded blocks): copy the gradients out now, update on :meth:`release`.
        ``speculative`` (offloaded blocks): the new state goes to the block's shadows, or in place
        with its undo records, and the new weights come from their own staging; the gradients stay
        in staging (see :meth:`redo`).
        The parameters are stepped by their handles in the native table; what crosses is the
        multiplier and the gradients' and weights' addresses of the moment."""
        if pairs is None:
            pairs = self.intake.grads(b)
        rt, store = self.rt, self.store
        if self.timeline is not None:
            self._pass_owner[b] = self.timeline.current
        if self.meter is not None and store.cuda and not rt.on_gpu(b):
            self._meter_owner[b] = self.meter.current
        handles = self.plan.handles(p for p, _ in pairs)
        if pairs and not rt.on_gpu(b):
            store.sync_groups(self.groups)
        if not store.cuda:
            if rt.in_flight(b):  # its previous update (a step() right after step()) finishes first
                self.wait_blocks([b])
            self._stale(b)
            self.engine.submit(b, store.table, handles, [g.data_ptr() for _, g in pairs],
                               [store.weight_address(p) for p, _ in pairs], float(grad_scale))
            # The workers read the gradients and write the weights: both stay alive until waited for.
            self._alive[b] = [t for p, g in pairs for t in (g, local(p).detach())]
            self.fence.watch(b, [g for _, g in pairs])
            rt.set_in_flight(b)
        elif rt.on_gpu(b):
            self.gpu_update(b, pairs, grad_scale)
        elif pairs:
            if b in self._unchecked:  # its last pass is checked before a new one reads the state
                self.wait_blocks([b])
            store.residency.migration_done(b, host=True)  # states that came down from the GPU have landed
            self._stale(b)
            self.pipeline.stage(b, store.table, handles, [g.data_ptr() for _, g in pairs],
                                [store.weight_address(p) for p, _ in pairs], float(grad_scale), self._stream(),
                                hold=hold, speculative=speculative, count=not (hold or speculative))
            self._landing.append((self.pipeline.d2h_issued, [g for _, g in pairs]))
            # The H2D copies write these weights: their storage stays alive until the pass is waited
            # for, even if the caller replaces the parameters' data meanwhile.
            self._alive[b] = [local(p).detach() for p, _ in pairs]
            self.fence.watch(b, [g for _, g in pairs])  # the gradient copies still read them
            rt.set_in_flight(b)
        if pairs and hold:
            rt.hold(b, handles)
        elif pairs and speculative:
            rt.speculate(b, handles)
        else:
            rt.launch(b)
        if release and store.cuda:
            for p, _ in pairs:
                p.grad = None

    def count_handed(self) -> None:
        """step() goes ahead: the offloaded blocks handed off during backward count the step now.
        Their passes were staged with it (the counter + 1), but until step() the counters stay the
        state before it, as torch's do (what ``optimizer.state``, a state dict or a load sees)."""
        rt, phases = self.rt, native().BlockPhase
        for b in (*rt.in_phase(phases.held), *rt.in_phase(phases.speculated)):
            if not rt.on_gpu(b) and b not in self._counted:
                self.store.table.advance(rt.handed(b))
                self._counted.add(b)

    def end_step(self) -> None:
        self._counted.clear()

    def _uncount(self, b) -> None:
        if b in self._counted:
            self.store.table.retreat(self.rt.handed(b))
            self._counted.discard(b)

    def release(self, b, mult) -> None:
        """A held block's update goes ahead with the step's multiplier (and hyperparameters)."""
        if self.rt.on_gpu(b):
            self.gpu_update(b, [(p, None) for p in self.plan.of_handles(self.rt.handed(b))], mult)
        else:
            self.pipeline.release(b, mult, self.store.table, self.rt.handed(b))
        self.rt.launch(b)

    def _stale(self, b) -> None:
        """Block b's weights are about to be written on the host: a streamed block's copy on the
        GPU (its window's) is dropped first."""
        if not self.store.streams(b):
            return
        window = self.store.window
        for layer in sorted({window.layer_of(p) for p in self.plan.blocks[b]}):
            window.invalidate(layer)

    def updated(self, b) -> bool:
        """Whether block b's weights are final now, without waiting: no update in flight, or its CPU
        update finished with nothing left to check (an undo record adopted is checked, and maybe redone,
        when the block is waited for)."""
        if not self.rt.in_flight(b):
            return True
        phases = native().BlockPhase
        if self.pipeline is None or b in self._unchecked or self.rt.phase(b) in (phases.held, phases.speculated):
            return False
        return self.pipeline.updated(b)

    def staged(self, b):
        """The weights block b's pass in flight writes (None if none)."""
        return self._alive.get(b)

    def gpu_update(self, b, pairs, grad_scale):
        """pairs: (parameter, gradient), or (parameter, None) when the gradient is already in the
        parameter's update buffer (early hand-off)."""
        store = self.store
        store.residency.migration_done(b, host=False)  # states that went up: the compute stream waits for them
        groups = {}
        for p, g in pairs:
            d = store.residency.dev[id(p)]
            if g is not None:
                d["grad"].copy_(g)
            st = store.state[p]
            st["step"] += 1
            groups.setdefault((self.plan.group_index[id(p)], p.dtype, int(st["step"].item())), []).append(p)
        timed = self.timeline is not None or self.meter is not None
        first = False
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(store.device))
        for (gi, dtype, step), ps in groups.items():
            group = self.groups[gi]
            fused, built = store.residency.fused(ps, gi, dtype, bool(group["amsgrad"]))
            first = first or built  # building the group's tables is not the update's cost: not measured
            sign = -1.0 if group.get("maximize", False) else 1.0  # maximize: ascend
            fused.step(step=step, lr=float(group["lr"]), betas=tuple(float(x) for x in group["betas"]),
                       eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                       grad_scale=sign * float(grad_scale))
            store.writes.note(ps, sharded=self.sharded)  # written on this stream: see writes.py
        if timed:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(store.device))
            if self.timeline is not None:
                self.timeline.gpu_update(b, start, end)
            if self.meter is not None and not first:
                self.meter.gpu_update(b, start, end)

    def drop_held(self, *, sharded):
        """A step that cannot be taken: held updates are cancelled, speculative ones dropped (their
        blocks get back the weights of their untouched state), and step counts restored where step()
        had counted them, so that the states and weights are as before the backward."""
        rt, phases, table = self.rt, native().BlockPhase, self.store.table
        for b in rt.in_phase(phases.held):
            if not rt.on_gpu(b):
                self.pipeline.cancel(b)
                self._uncount(b)
            rt.drop(b)
            if self.store.streams(b):
                # Its home stages its gradients: once they have landed, the weights go back there
                # (they are the master's rounding, as every update leaves them).
                self.wait_blocks([b])
                self._stale(b)
                for p in self.plan.blocks[b]:
                    self.store.weights(p).copy_(self.store.state[p]["master"])
        for b in rt.in_phase(phases.speculated):
            self.wait_blocks([b])  # the compute stream now follows the speculative weight copies
            table.undo(rt.handed(b))  # updates in place with an undo record: taken back
            ps = self.plan.of_handles(rt.handed(b))
            self._stale(b)
            for p in ps:  # the weights are its rounding (a streamed parameter's in its home)
                self.store.weights(p).copy_(self.store.state[p]["master"], non_blocking=True)
            self.store.writes.note(ps, sharded=sharded)
            self._uncount(b)
            rt.drop(b)

    def forward_before_step(self) -> None:
        """A forward (not a recomputation in backward) while blocks of the last backward wait for
        step() on the host: the loop accumulates gradients over micro-batches without having said so
        (``accumulation_steps``). Their passes hold gradients copied out of that backward (a streamed
        block's home holds them in place of its weights), and speculative ones have written weights
        the step has not taken yet: refused in one line, before the forward reads anything. Nothing
        is applied; step() goes on with the hand-offs as they are. (GPU-resident blocks keep their
        weights until step(), and step() sees their gradients changed: nothing to refuse.)"""
        phases = native().BlockPhase
        pending = [b for b in self.rt.in_phase(phases.held) if not self.rt.on_gpu(b)]
        pending += self.rt.in_phase(phases.speculated)
        if pending:
            raise RuntimeError(
                f"a forward ran after a backward and before optimizer.step(), while {len(pending)} block(s) "
                "of that backward were already handed to the host's update: to accumulate gradients over "
                "several micro-batches, pass accumulation_steps=<micro-batches per step> to HybridAdamW "
                "(nothing is handed off before the last one), or call step() after every backward")

    def restage(self, b, mult, pairs=None):
        """Block b's gradients changed after its hand-off: its held pass is cancelled, or its
        speculative one dropped (it wrote the shadows, or in place: taken back), and the block is updated from the
        gradients there now (the new copies wait for the old pass on the device)."""
        rt = self.rt
        if pairs is None:
            pairs = self.intake.grads(b)
        if rt.on_gpu(b):
            self.gpu_update(b, pairs, mult)
            rt.launch(b)
            return
        if rt.phase(b) == native().BlockPhase.held:
            self.pipeline.cancel(b)
        else:  # speculated: an update in place with an undo record is taken back first
            self.wait_blocks([b])
            self.store.table.undo(rt.handed(b))
        self._uncount(b)  # counted again by the new pass
        self.launch(b, mult, release=False, pairs=pairs)

    def adopt_later(self, b, handles, mult) -> None:
        """Block b's speculative updates in place (undo records) are the step's result, if complete:
        that is known once the pass has finished, and checked when the block is waited for (before
        its next forward, or any other use of its weights or state). ``mult``: the step's multiplier."""
        self._unchecked[b] = (list(handles), float(mult))

    def _check_records(self, b) -> None:
        """Block b's pass has finished: its records are adopted where complete; otherwise (an element
        left untouched, its escape list full) the block is redone with the step's multiplier and the
        hyperparameters of its step (the table's until the next hand-off), and waited for."""
        table, (handles, mult) = self.store.table, self._unchecked.pop(b)
        pending = [h for h in handles if table.recorded(h)]
        if all(table.record_complete(h) for h in pending):
            for h in pending:
                table.adopt(h)
            return
        ps = self.plan.of_handles(handles)
        self._stale(b)
        self.pipeline.stage(b, table, handles, [0] * len(ps), [self.store.weight_address(p) for p in ps], mult,
                            self._stream(), redo=True)
        self.pipeline.wait_ready(b, self._stream())
        self.counts["adopted"] -= 1
        self.counts["redone"] += 1

    def _recorded(self, b) -> list:
        """Block b's handles whose speculative update in place is neither adopted nor taken back,
        once that pass has finished on the CPU ([] without waiting if there are none)."""
        table = self.store.table
        handles = [h for h in self.rt.handed(b) if table.recorded(h)]
        if handles:
            self.pipeline.wait_updated(b)
        return handles

    def take_back(self, blocks) -> None:
        """Speculative updates in place (undo records) of these blocks are taken back, their passes
        finished first: the state is the one before backward (the step redoes them)."""
        for b in blocks:
            handles = self._recorded(b)
            if handles:
                self.store.table.undo(handles)

    def drop_records(self, blocks) -> None:
        """A state was loaded over these blocks' speculative updates in place: their records describe
        a state that is gone and are dropped, not taken back (the step redoes the blocks)."""
        for b in blocks:
            handles = self._recorded(b)
            if handles:
                self.store.table.mark_resolved(handles)

    def redo(self, b, mult):
        """Clipping fired: block b is updated again from its old state with the multiplier (read
        back from the undo records in the same pass); the gradients are still in staging. (The
        pipeline lets the speculative pass finish first.)"""
        rt = self.rt
        handles = list(rt.handed(b))
        ps = self.plan.of_handles(handles)
        if self.timeline is not None:
            self._pass_owner[b] = self.timeline.current
        if self.meter is not None:
            self._meter_owner[b] = self.meter.current
        self.store.sync_groups(self.groups)
        self._stale(b)
        self.pipeline.stage(b, self.store.table, handles, [0] * len(ps), [self.store.weight_address(p) for p in ps],
                            float(mult), self._stream(), redo=True)
        self._alive[b] = [local(p).detach() for p in ps]
        rt.set_in_flight(b)
        rt.launch(b)  # (until here a failure leaves it to drop_held)

    def drop_landing(self) -> None:
        """Lets go of released gradients whose copies out may still be under way: the compute stream
        first waits for those copies, so that its next allocations may take their memory."""
        if self._landing:
            device = self.store.device
            d2h = torch.cuda.ExternalStream(self.pipeline.d2h_handle, device=device)
            torch.cuda.current_stream(device).wait_stream(d2h)
            self._landing.clear()

    def release_landed(self):
        if not self._landing:
            return
        done = self.pipeline.d2h_completed
        while self._landing and self._landing[0][0] <= done:
            self._landing.popleft()

    def wait_blocks(self, ids):
        forks.check(self)  # (a forked child cannot wait for CUDA copies: it raises instead)
        rt, up, cuda = self.rt, [], self.store.cuda
        for b in ids:
            if not rt.in_flight(b):
                continue
            try:
                if cuda:
                    self.pipeline.wait_ready(b, self._stream())
                    if b in self._unchecked:
                        self._check_records(b)
                else:
                    self.engine.wait(b)
                # The weights as this update wrote them, before any operation of the loop's can touch
                # them (on the stream that reads them next): see writes.py.
                self.store.writes.note(self.plan.blocks[b], sharded=self.sharded)
            finally:
                self._unchecked.pop(b, None)
                self._alive.pop(b, None)
                self.fence.forget(b)
                if rt.landed(b):  # k rose while its pass was in flight: its states go up now
                    up.append(b)
            owner = self._pass_owner.pop(b, None)
            info = None
            if owner is not None:
                info = self.pipeline.last_pass(b) if cuda else self.engine.timing(b)
                owner.passes[b] = info
            metered = self._meter_owner.pop(b, None)
            if metered is not None:
                metered.passes[b] = info if info is not None else self.pipeline.last_pass(b)
        for b in up:
            self.store.to_gpu(b)
        self.release_landed()
