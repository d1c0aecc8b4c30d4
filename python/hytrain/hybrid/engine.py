"""The engine under HybridAdamW: it owns the parts and the native ``BlockRuntime`` (each block's phase
in a step and its placement, kept once, natively) and runs a step through them --

* ``plan`` (:class:`BlockPlan`): parameters, groups, blocks; fixed;
* ``store`` (:class:`StateStore`): the state, staging, placement and moves, shadows;
* ``intake`` (:class:`GradientIntake`): gradient hooks, checks, the global norm, clips;
* ``launcher`` (:class:`Launcher`): the native engine and pipeline, GPU updates, waits;
* ``planner`` (:class:`Planner`): measurements, the k-split scheduler, where speculation starts;
* ``fence`` (:class:`Fence`): any other read or write of an in-flight block waits for it;

and the model's forward hooks, which wait for each block just before it is used."""

from __future__ import annotations

import math
import warnings
import weakref

import torch

from .._native import native
from ..pool import CapacityError
from ..trace import Timeline
from . import collectives, forks, streamed
from .fence import Fence
from .hooks import forward_hooks
from .intake import GradientIntake
from .launcher import Launcher
from .plan import BlockPlan
from .planner import Planner
from .store import StateStore


def _in_backward() -> bool:
    """Whether autograd is running a backward here (activation checkpointing recomputes forwards,
    whose hooks then run inside it)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class Engine:
    """``groups``: the optimizer's param groups (read at every step); ``state``: its state dict."""

    def __init__(self, groups, state, settings):
        self.groups, self.settings = groups, settings
        self.plan = plan = BlockPlan(groups, model=settings.model, blocks=settings.blocks,
                                     bucket_elements=settings.bucket_elements,
                                     moment_bytes=settings.moment_bytes)
        if settings.gpu_blocks > len(plan):
            raise ValueError(f"gpu_blocks={settings.gpu_blocks} but there are only {len(plan)} blocks")
        # FSDP2-sharded parameters: each rank holds the state of its own shards; the norm and the
        # overflow flag are agreed over this group.
        self.shard_group = collectives.shard_group(plan.params)
        self.fence = Fence(weakref.ref(self))
        self._state = state
        self._make_parts()
        self.timeline = None
        self.steps = 0  # steps taken
        self.loss_scaling = False
        self.last_clipped = True  # whether the last step was clipped or skipped (or none yet): see step()
        # The multiplier speculative passes run with: the last step's loss-scale unscaling (1 without
        # a GradScaler); adopted where the step's multiplier is exactly this (it did not clip, and
        # the scale did not change).
        self.spec_mult = 1.0
        # The loop unscales the gradients in place (GradScaler.unscale_ before step(), as
        # ShardedGradScaler users and clipping loops do): released gradients would miss that, so
        # under loss scaling nothing is released during backward from then on.
        self.unscaled_in_place = False
        self.reloaded = set()  # speculated blocks whose state was loaded before step(): see loaded()
        self._model_hooks = []

    def _make_parts(self):
        """The runtime and the parts over the plan, as before any state exists."""
        plan, settings = self.plan, self.settings
        self.rt = native().BlockRuntime([len(b) for b in plan.blocks], settings.accumulation_steps)
        self.store = StateStore(plan, settings, self.rt, self._state, self.wait_blocks)
        self.intake = GradientIntake(plan, settings, self.rt, self.store, self.shard_group, self._arrived)
        self.launcher = Launcher(plan, settings, self.rt, self.store, self.intake, self.fence, self.groups)
        self.speculation_counts = self.launcher.counts  # speculated block updates, so far
        self.planner = Planner(plan, settings, self.rt, self.store)
        self.bound_early = False  # the state was made in the first backward (see _first_gradient)
        self._first_seen = False  # the first backward's first gradient has been looked at

    @property
    def bound(self) -> bool:
        return self.store.bound is not None

    # -- creation and teardown --------------------------------------------------------------------------

    def bind(self, early=False):
        """Creates the state, the native engine and pipeline, forward hooks and the planner for the
        device and dtype the parameters have now (``early``: made in the first backward, see
        :meth:`_first_gradient`). On failure nothing is left half made."""
        s, store = self.settings, self.store
        pending = None
        try:
            store.prepare()
            self._bind_window()
            # Where each block's state lives from the start: the host holds what it can (the
            # blocks from its floor on), the GPU the first k; checked on both sides first.
            # What optimizer.state holds before the state exists (a load, carried entries, the loop's
            # own writes) is what the state starts from: taken out, then loaded into the buffers.
            pending = self.pending
            for p in pending or ():
                del self._state[p]
            k, later = self.planner.initial_k(store.host_floor(), self.shard_group, defer=not pending,
                                              early=early, kept=self.unscaled_in_place)
            store.create(self.groups, k, later)
            self.loss_scaling = any(p.dtype == torch.float16 for p in self.plan.params)
            self.timeline = Timeline(store.device if store.cuda else None, keep=s.trace) if s.trace else None
            self.launcher.start(self.timeline)
            if s.model is not None:
                self._model_hooks, measured = forward_hooks(weakref.ref(self), self.plan, s.model,
                                                            sharded=self.shard_group is not None)
            else:
                measured = False
            self.planner.start(measured=measured, pipeline=self.launcher.pipeline)
            self.launcher.meter = self.planner.meter
            store.writes.note(sharded=self.shard_group is not None)
            if pending:
                store.load_entries(store.checked_entries(pending), reset_missing=False,
                                   sharded=self.shard_group is not None)
            self.bound_early = early
        except BaseException:  # nothing half made: the parts as before the first step
            self._unbind()
            self._state.update(pending or {})
            raise

    def _bind_window(self) -> None:
        streamed.bind(weakref.ref(self), self.plan, self.store, self.planner, sharded=self.shard_group is not None)

    def _unbind(self):
        """The parts as before the first step (the state dropped)."""
        streamed.detach(self.store)  # the weight window's side, if any
        self._remove_model_hooks()
        self.store.clear()
        self.launcher.stop()
        self.intake.close()
        self._make_parts()
        self.timeline = None

    @property
    def pending(self) -> dict | None:
        """Before the state exists: the entries ``optimizer.state`` holds for the parameters (loaded,
        carried over, or written by the loop), which the state starts from when it is made."""
        if self.bound:
            return None
        out = {p: dict(e) for p in self.plan.params for e in (self._state.get(p),) if e}
        return out or None

    def carry(self) -> dict:
        """Parameter -> state entry (copies) of every parameter with state, or loaded for later."""
        out = dict(self.pending or {})
        if self.bound:
            self.synchronize()
            for p in self.plan.params:
                out[p] = {k: v.detach().clone() for k, v in self._state[p].items()}
        return out

    def take(self, carried) -> None:
        """Entries of :meth:`carry` go back into ``optimizer.state`` (loaded into the buffers when the
        state is made; those of frozen parameters kept there as torch keeps them). A parameter no
        longer in the param groups has none (torch's would stay there, and break its state_dict())."""
        grouped = {id(p) for p in (*self.plan.params, *self.plan.frozen)}
        for p, e in carried.items():
            if id(p) in grouped:
                self._state[p] = e

    def close(self):
        """Waits for what is in flight, then removes every hook and drops the state."""
        self.synchronize()
        self.fence.disarm(force=True)
        self.intake.close()
        streamed.detach(self.store)  # the weight window's side, if any
        self._remove_model_hooks()
        self.store.clear()
        self.launcher.stop()
        self.timeline = None

    def _remove_model_hooks(self):
        hooks, self._model_hooks = self._model_hooks, []
        for h in hooks:
            h.remove()

    # -- during backward and forward --------------------------------------------------------------------

    def early_handoff(self) -> bool:
        """On CUDA after the first step: each block's gradients leave the GPU during backward; the
        updates wait for step(), or run speculatively beside the state and are checked there. Under
        loss scaling a GradScaler's overflow check sees a released block's overflow through a
        stand-in gradient (see GradientIntake.handed_off), and kept gradients are compared by content
        at step() (the check rewrites them in place, unchanged); only while the loop leaves the unscaling to step():
        ``GradScaler.unscale_()`` changes ``.grad`` in place, which released gradients would miss and
        kept ones would then be updated again from."""
        return (self.store.cuda and self.settings.overlap and (self.steps > 0 or self.bound_early)
                and not (self.loss_scaling and self.unscaled_in_place))

    def speculation_allowed(self) -> bool:
        """Whether the next backward may speculate: clipping on CUDA, and the last step did not clip."""
        return self.settings.speculate is not False and self.early_handoff() and not self.last_clipped

    def _first_gradient(self) -> None:
        """The first backward's first gradient, on CUDA: where the gradients still to come do not
        fit on the GPU beside what is there, the state is made now, so that each block's gradients
        leave the GPU during this backward as in later ones and the first step needs no more GPU
        memory than the steady state; where that cannot be, a CapacityError before anything of the
        state is allocated. (Sharded parameters hold a rank's shards of the gradients: not checked.)"""
        self._first_seen = True
        store, s = self.store, self.settings
        try:
            store.prepare()
            self._bind_window()  # (streamed blocks: their homes stage, k stops below them)
        except (RuntimeError, ValueError):
            return  # refused at step(), where the state is made
        if not store.cuda or self.shard_group is not None:
            return
        kept = [why for why, yes in (
            ("release_grads=False", not s.release_grads), ("overlap=False", not s.overlap),
            (f"accumulation_steps={s.accumulation_steps}", s.accumulation_steps > 1),
        ) if yes]
        if self.planner.first_backward(store.host_floor(), hands_off=not kept, why_kept=", ".join(kept)):
            self.bind(early=True)

    def _arrived(self, b, complete):
        if not self.bound and not self._first_seen:
            self._first_gradient()
        if not self.bound:  # the first backward: only its memory is measured (planner.initial_k)
            if complete:
                self.planner.sample_first(b)
            return
        if complete:
            if self.timeline is not None:
                self.timeline.mark("backward", b)
            meter = self.planner.meter
            if meter is not None:
                meter.backward_done(b, self.store.resident_bytes if self.planner.scheduler is not None else None)
            # Nothing is applied before step(): the multiplier, the gradients (which the loop may
            # still clip or rescale) and the hyperparameters (which it may still change) are known
            # only then. What can start is the copy out, and speculative updates beside the state.
            if self.early_handoff():
                start = self.planner.spec_from
                spec = (not self.rt.on_gpu(b) and start is not None and b >= start and not self.last_clipped
                        and self.store.shadows.has(b))
                self.launcher.hand_off(b, spec, self.spec_mult, scaled=self.loss_scaling)
        self.launcher.release_landed()

    def before_forward(self, wait_for, marks):
        meter = self.planner.meter
        if (meter is not None and self.settings.accumulation_steps > 1 and torch.is_grad_enabled()
                and self.rt.any_arrived() and not _in_backward()):
            meter.later_forward()  # a later micro-batch (not a recomputation in backward)
        meter = meter if (meter is not None and torch.is_grad_enabled() and not self.rt.any_arrived()) else None
        if self.rt.any_submitted() and not _in_backward():
            self.launcher.forward_before_step()
        before = None
        if meter is not None:
            meter.start(True)
            before = meter.before_wait()
        self.wait_blocks(wait_for)
        if meter is not None:
            meter.after_wait(marks, before)
        if self.timeline is not None and torch.is_grad_enabled():
            for b in marks:
                self.timeline.mark("forward", b)
        if self.fence.armed:
            self.fence.disarm()  # off the stack once every block has been waited for

    # -- the step -----------------------------------------------------------------------------------------

    def drop_held(self):
        self.launcher.drop_held(sharded=self.shard_group is not None)

    def step(self, grad_scale, found_inf) -> None:
        """Everything after the face's checks: every gradient checked, then every update started
        (and waited for without overlap). A step that raises leaves every weight and state as it
        was, with nothing in flight."""
        rt, intake, launcher, store = self.rt, self.intake, self.launcher, self.store
        try:
            if found_inf is not None and grad_scale is None:  # the loop unscaled .grad in place
                self.unscaled_in_place = True  # (before bind: the first step plans for kept gradients)
            if not self.bound:
                self.bind()
            if found_inf is not None and self.shard_group is not None:  # skipped on all ranks or none
                found_inf = collectives.all_reduce(found_inf.detach().clone(), self.shard_group, op="max")
            if grad_scale is not None or found_inf is not None:
                if not self.loss_scaling and rt.any_submitted():
                    self.drop_held()
                    raise RuntimeError("a GradScaler started driving HybridAdamW after updates had begun "
                                       "overlapping backward; create the optimizer with loss scaling in use "
                                       "from the first step")
                self.loss_scaling = True
            if self.unscaled_in_place and intake.released_scaled and grad_scale is None:
                # Released during this backward, before the loop first unscaled in place: those
                # gradients missed the unscaling. The step is skipped, as for an overflow.
                self.drop_held()
                self.last_clipped = True
                warnings.warn(
                    "GradScaler.unscale_() was called on gradients that HybridAdamW had already released "
                    "during backward (release_grads=True): they missed the unscaling, so this step was skipped "
                    "(nothing changed). From now on the gradients are kept until step(), as unscale_ needs.",
                    RuntimeWarning, stacklevel=4)
                return
            if found_inf is not None and float(found_inf) != 0.0:
                self.drop_held()
                self.last_clipped = True  # the scale backs off: the next backward does not speculate
                return  # overflow: skip the step entirely, state untouched (torch's behaviour)
            inv = intake.inv_scale(grad_scale)
            mult = intake.multiplier(inv)
            if not math.isfinite(mult):
                self.drop_held()
                raise RuntimeError(f"the gradient multiplier is {mult} (non-finite gradient norm)")
            phases = native().BlockPhase
            changed = intake.changed_blocks(launcher.staged)
            # Speculated from masters now refreshed, or from a state loaded since: redone.
            rewritten = (self._follow_weight_writes() | self.reloaded) - changed
            # Every gradient this step reads is checked before anything is applied: a refused step
            # leaves every parameter and state as it was.
            fresh = {b: intake.grads(b) for b in range(len(self.plan)) if not rt.submitted(b) or b in changed}
            # Hyperparameters changed since the hand-offs (an lr set between backward and step()):
            # held passes are released with the new ones, speculative results are redone.
            stale = store.sync_groups(self.groups)
            if self.planner.meter is not None:
                self.planner.meter.launched()
            clipped = mult != inv or bool(changed)
            launcher.count_handed()  # the step goes ahead: the hand-offs count it now
            if mult == self.spec_mult and not stale:
                self._adopt(mult, keep=changed | rewritten)
            # Forward order (the next forward needs block 0 first), offloaded blocks first so that
            # their copies start before the GPU updates queue up on the compute stream.
            # Blocks whose states wait for room on the GPU (the first step; see StateStore.create):
            # every block's gradients are released as it launches, and their states made in turn.
            deferring = bool(store.deferred)
            for b in rt.launch_order():
                if b in store.deferred:
                    launcher.drop_landing()
                    store.make_deferred(b)
                phase = rt.phase(b)
                if phase == phases.held:
                    if b in changed:
                        launcher.restage(b, mult, fresh.pop(b))
                    else:
                        launcher.release(b, mult)
                elif not rt.submitted(b):
                    launcher.launch(b, mult, release=deferring, pairs=fresh.pop(b))
            for b in rt.in_phase(phases.speculated):  # after the GPU updates: these may wait on the host
                if b in changed:
                    launcher.restage(b, mult, fresh[b])
                else:
                    launcher.redo(b, mult)
                    self.speculation_counts["redone"] += 1
            self.steps += 1
            self.last_clipped = clipped
            self.spec_mult = inv
            self.planner.after_step(early_copies=self.early_handoff(), speculation_allowed=self.speculation_allowed())
            if not self._model_hooks or not self.settings.overlap:
                self.synchronize()
            rt.end_step()
        except BaseException:
            if self.bound:
                self.drop_held()  # whatever was not released yet: as before the backward
                try:
                    self.synchronize()  # nothing is left in flight
                except Exception:  # noqa: BLE001 -- the error being raised is the one to report
                    pass
                try:
                    store.defer_to_host()  # states not made yet (a first step): on the host instead
                except Exception:  # noqa: BLE001 -- neither side holds them: made again at the next step
                    self._unbind()
            if self.planner.meter is not None:
                self.planner.meter.current = None  # a step not taken is not measured
            raise
        finally:
            self.reloaded = set()
            launcher.end_step()
            rt.abandon_step()
            intake.end_step()
            if self.timeline is not None:
                self.timeline.current.k = self.settings.gpu_blocks
                self.timeline.next_iteration()
        if self.settings.fence and self.in_flight():
            # Updates outlive step(): any other path to the weights, the gradients they read or the
            # optimizer's state (opt.state[p], read or written by the loop) waits for them.
            for b in self.rt.in_flight_blocks():
                self.fence.watch(b, [t for p in self.plan.blocks[b] for t in self._state[p].values()])
            self.fence.arm()

    def _adopt(self, mult, keep=()):
        """The multiplier is the one the speculative passes ran with (``mult``): their states are
        the step's result; the old ones become the shadows (the passes still writing them are waited for before anything reads them).
        Blocks in ``keep`` (their gradients changed after the hand-off) stay speculated to be restaged."""
        rt, table = self.rt, self.store.table
        # (Updates in place that were taken back before step() -- see synchronize() -- are redone.)
        adopted = [b for b in rt.in_phase(native().BlockPhase.speculated) if b not in keep and
                   not any(table.has_record(h) and not table.recorded(h) for h in rt.handed(b))]
        self.speculation_counts["adopted"] += len(adopted)
        for b in adopted:
            handles = rt.handed(b)
            if self.store.adopt(b, handles):  # updates in place: adopted once known complete
                self.launcher.adopt_later(b, handles, mult)
            rt.launch(b)

    def _follow_weight_writes(self) -> set:
        """Weights the loop wrote since the last step (a rollback with ``model.load_state_dict``, a
        ``.data`` write) are what the next update starts from, as with torch's optimizers, and so are
        weights that a master loaded since does not round to: see WeightWrites.refresh.
        Returns the blocks whose speculative pass read a master changed here (redone in step())."""
        written = self.store.writes.written(sharded=self.shard_group is not None)
        if not written:
            return set()
        speculated = set(self.rt.in_phase(native().BlockPhase.speculated))
        self.synchronize()  # nothing in flight reads the masters being refreshed
        changed = self.store.writes.refresh(written)
        return {self.plan.block_of[id(p)] for p in changed} & speculated

    # -- waits ----------------------------------------------------------------------------------------

    def wait_blocks(self, ids):
        self.launcher.wait_blocks(ids)

    def load(self, entries) -> None:
        """Loaded state entries (parameter -> {key: tensor}, checked) replace the state (a parameter
        without one starts afresh); before the first step they are kept until the state is made."""
        if not self.bound:
            for p in self.plan.params:
                self._state.pop(p, None)
            self._state.update({p: dict(e) for p, e in entries.items()})
            return
        self.store.load_entries(entries, reset_missing=True, sharded=self.shard_group is not None)
        self.loaded()

    def resume(self, state) -> None:
        """A call from the loop (step, zero_grad): the fence's watch ends, and what the loop did to
        ``optimizer.state`` meanwhile is taken in (:meth:`reconcile`)."""
        self.fence.disarm()
        self.reconcile(state)

    def reconcile(self, state, wait=False) -> None:
        """What the loop did to ``optimizer.state`` between calls -- cleared it, removed or emptied an
        entry, put other tensors in it, replaced the dict itself -- is found by identity and applied
        as torch's AdamW would see it (see StateStore.changes and restore), after waiting for what is
        in flight; the buffers the native side points at were never freed (the store holds them)."""
        forks.check(self.launcher)  # an inherited state on CUDA, in a forked child: refused (forks.py)
        if state is not self._state:
            self._state = state
            self.store.rebind(state)
        if not self.bound:
            return
        replaced, removed = self.store.changes()
        if not (replaced or removed):
            if wait:  # ``wait``: nothing left in flight on return, whatever was found
                self.synchronize()
            return
        self.synchronize()
        self.store.restore(replaced, removed, sharded=self.shard_group is not None)
        self.loaded()

    def loaded(self) -> None:
        """A state loaded between backward and step() is the state the step starts from: speculated
        blocks (their results computed from the state before) are redone in step(), not adopted."""
        speculated = self.rt.in_phase(native().BlockPhase.speculated)
        self.launcher.drop_records(speculated)  # records nobody took back (a dcp.load in place)
        self.reloaded.update(speculated)

    def in_flight(self) -> bool:
        return self.bound and bool(self.rt.in_flight_blocks())

    def fence_wait(self, blocks) -> None:
        """The fence saw an operation on these blocks' parameters or gradients (see fence.py)."""
        rt, held = self.rt, native().BlockPhase.held
        self.wait_blocks(sorted(b for b in blocks if rt.in_flight(b) and rt.phase(b) != held))

    def synchronize(self) -> None:
        if not self.bound:
            return
        forks.check(self.launcher)
        # Held blocks (between backward and step) have nothing to wait for until step() releases them.
        phases = native().BlockPhase
        # Speculative updates in place are taken back: whoever synchronizes before step() (to read the
        # state, save it, refresh the masters) sees the state before backward; step() redoes them.
        self.launcher.take_back(self.rt.in_phase(phases.speculated))
        self.wait_blocks([b for b in self.rt.in_flight_blocks() if self.rt.phase(b) != phases.held])
        if self.store.cuda:
            self.store.settle()
        self.fence.disarm()

    def set_gpu_blocks(self, k, wait):
        if self.rt.any_submitted() or self.rt.any_arrived():
            raise RuntimeError("set_gpu_blocks must be called between steps, not between backward and step()")
        if not self.bound:
            self.settings.gpu_blocks = k
            return
        if k and not self.store.cuda:
            raise ValueError("gpu_blocks > 0 needs CUDA parameters (these are on the CPU)")
        if self.planner.max_k is not None and k > self.planner.max_k:
            raise CapacityError(f"gpu_blocks={k}: blocks {self.planner.max_k} and up stream their weights from host "
                                f"memory, so their states stay there (use gpu_blocks <= {self.planner.max_k})")
        if k < self.store.floor:
            raise CapacityError(f"gpu_blocks={k}: the host can hold the states of blocks {self.store.floor} "
                                f"to {len(self.plan) - 1} only (use gpu_blocks >= {self.store.floor})")
        fit = self.store.host_fit(k) if self.store.cuda else k
        if fit > k:
            raise CapacityError(f"gpu_blocks={k}: the host has no room now for the states of blocks {k} to "
                                f"{fit - 1}, beside its margin (use gpu_blocks >= {fit})")
        if wait:
            self.synchronize()
        if self.store.cuda:
            self.store.migrate(k)
            if wait:
                self.store.settle()

    def residency(self) -> dict:
        if not self.bound:
            return {"gpu": [], "moving": [], "floor": 0, "host_bytes": 0, "gpu_bytes": 0, "shadow_bytes": 0}
        store, gpu = self.store, set(self.rt.resident())
        on_host = store.block_host_bytes()
        on_gpu = self.plan.sizes()[2]
        return {"gpu": sorted(gpu), "moving": store.residency.moving(), "floor": store.floor,
                "host_bytes": sum(n for b, n in enumerate(on_host) if b not in gpu),
                "gpu_bytes": sum(n for b, n in enumerate(on_gpu) if b in gpu),
                "shadow_bytes": store.shadows.total_bytes()}
