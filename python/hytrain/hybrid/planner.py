"""The planner: the measurements (compute-stream events, through the ``Meter``), the native
``KSplitScheduler`` fed with them after each step (block sizes, the GPU memory budget, a start-up
probe of the GPU AdamW's rate), its decision -- k, and from which block offloaded blocks speculate
in the next backward -- and the shadows that speculation needs, taken from the state store."""

from __future__ import annotations

import math
import time

import torch

from .._native import native
from ..cpu_adam import adamw_step
from ..cuda_adam import CudaAdamW
from ..meter import Meter
from ..pool import CapacityError, format_bytes
from . import collectives
from .common import local

# The first step page-locks the shadows of this share of the offloaded blocks (from the last down,
# within the host's headroom) beside the state's own: where speculation starts once measured (7-11
# of L3B's 28 blocks, by format), so that its first starts carve memory already locked. What they
# leave is given back once the speculation has held for QUIET_STEPS steps.
AHEAD_SHARE = 0.5
QUIET_STEPS = 4


def fit(sizes, room) -> int:
    """How many leading blocks of these sizes fit in ``room`` bytes."""
    k, used = 0, 0
    while k < len(sizes) and used + sizes[k] <= room:
        used += sizes[k]
        k += 1
    return k


def first_split(state_bytes, grads, *, free, steady, margin) -> tuple[int, int]:
    """(k, later) at the first step: k, the leading blocks whose states fit on the GPU now (``free``
    bytes, with every gradient still allocated) and beside what later iterations use apart from the
    states (``steady``: that room, the margin taken); later >= k, as many again as fit once the step
    has released the other blocks' gradients (``grads``: per block, the bytes it releases; None:
    nothing is made later). A deferred block's own gradients are counted as held when its state is
    made."""
    k = fit(state_bytes, min(steady, free - margin))
    later = k
    while (grads is not None and later < len(state_bytes) and sum(state_bytes[:later + 1]) <= steady
           and sum(state_bytes[:later + 1]) <= free - margin + sum(grads) - sum(grads[k:later + 1])):
        later += 1
    return k, later


def first_backward(to_come, free, *, device_free, floor_states, transient, hands_off) -> str:
    """What the first backward does, decided at its first gradient (bytes on the GPU): "keep" --
    the gradients still ``to_come`` fit in ``free`` (within the run's limit) beside a 1 GiB margin,
    so every block's stay to step(), where the state is made with the first backward measured;
    "hand off" -- they do not, but the state can be made now (``hands_off``: nothing keeps the
    gradients to step()) with the blocks below the host's floor on the GPU (``floor_states``) beside
    one block's gradients in flight (``transient``), so that each block's gradients leave the GPU as
    in later backwards; "keep" again where the device itself has room (``device_free``: a limit
    below what autograd allocates anyway governs the states, not the gradients); "refuse" otherwise."""
    margin = 1 << 30
    if to_come + margin <= free:
        return "keep"
    if hands_off and floor_states + transient <= free:
        return "hand off"
    if to_come + margin <= device_free:
        return "keep"
    return "refuse"


class Planner:

    def __init__(self, plan, settings, rt, store):
        self.plan, self.settings, self.rt, self.store = plan, settings, rt, store
        self.meter = None
        self.scheduler = None
        self.spec_from = None  # blocks >= this (offloaded, with shadows) speculate in the next backward
        self.shadow_allocations = []  # (blocks, seconds) of each step that made shadows
        self.shadows_ahead = None  # (blocks, seconds) of the first step's page-locking for them
        self._quiet = 0  # steps since shadows were last allocated or page-locked
        self.prediction = None  # the scheduler's simulated iteration for the k in use
        self.summary = {}  # the last measured iteration's figures
        self.gpu_memory_limit = None
        self._agree_group = None  # sharded with k chosen each step: the ranks agree on k
        self._nonstate_peak = 0
        self._pressure = 0  # bytes the state budget gives up: iterations where the allocator retried
        self._first_samples = []  # (block, GPU bytes in use) as each block completed in the first backward
        self.first_k = None  # (k, later) of the first step (initial_k)
        # The first streamed block (window.py): blocks from there on keep their states on the host,
        # where their weights live; k never passes it. None: no block streams.
        self.max_k = None

    def initial_k(self, floor, shard_group, *, defer=False, early=False, kept=False) -> tuple[int, int]:
        """(k, later) for the state about to be created, at the first step, before any block has
        been measured. Fixed k: the k asked for, twice. Auto: k, the leading blocks the GPU holds
        now, while this step's gradients are all still allocated; and ``later`` >= k, as many as it
        holds beside what the next iterations use apart from the states (from the first backward's
        samples). Without ``defer`` both are k (the scheduler moves k from there once it has
        measured); with it, blocks k..later-1 get their states on the GPU in the first step, once
        the gradients of the others are released, and none on the host. Never below the host's
        ``floor``; a floor the GPU cannot hold is refused here, before anything is allocated, naming
        the bytes on each side. ``kept``: the gradients stay until step() whatever the settings (the
        loop unscales them in place).
        ``early``: made during the first backward (:meth:`first_backward`), before anything is
        measured: k is the floor, and the scheduler moves it from there."""
        store, s = self.store, self.settings
        if not store.cuda:
            return 0, 0
        state_bytes = self.plan.sizes()[2]
        allocated, free, limit = self._free()
        peak = max(torch.cuda.max_memory_allocated(store.device), allocated)
        if early:  # bound in the first backward: gradients in flight one block at a time, as later
            free = max(0, free - self._transient())
        if self.max_k is not None and floor > self.max_k:
            raise CapacityError(
                f"the host can hold the optimizer states of blocks {floor} to {len(state_bytes) - 1} only, but "
                f"blocks {self.max_k} and up stream their weights from host memory and must keep their states "
                f"there too: {format_bytes(sum(state_bytes[self.max_k:floor]))} more host memory is needed, or "
                "fewer streamed layers")
        if not s.auto:
            k = s.gpu_blocks
            if self.max_k is not None and k > self.max_k:
                raise CapacityError(
                    f"gpu_blocks={k}, but blocks {self.max_k} and up stream their weights from host memory, so "
                    f"their states stay there: use gpu_blocks <= {self.max_k}, or 'auto'")
            if k < floor:
                raise CapacityError(
                    f"gpu_blocks={k} leaves the states of blocks {k} to {len(state_bytes) - 1} on the host, but "
                    f"the host can hold those of blocks {floor} to {len(state_bytes) - 1} only: use "
                    f"gpu_blocks >= {floor}, or 'auto'")
            if sum(state_bytes[:k]) > free:
                raise CapacityError(
                    f"gpu_blocks={k} keeps {format_bytes(sum(state_bytes[:k]))} of optimizer states on the GPU, "
                    f"but {format_bytes(max(free, 0))} of its memory is free: lower gpu_blocks, or use "
                    "gpu_blocks='auto' (it keeps on the GPU what fits beside the activations)")
            return k, k
        if early:
            if sum(state_bytes[:floor]) > free:
                raise store.gpu_refusal(floor, free)
            self.first_k = (floor, floor)
            return self.first_k
        released = self.releases_in_backward(kept)
        peak = self._steady_peak(peak, released=released)
        margin = (1 << 30) + limit // 20  # the scheduler's margin (_budget)
        # Beside the memory the next iterations use apart from the states, with the margin; and now,
        # while this step's gradients are all still allocated.
        steady = allocated + free - peak - margin
        grads = None
        if defer and released and shard_group is None:
            grads = [sum(p.grad.numel() * p.grad.element_size() for p in blk if p.grad is not None)
                     for blk in self.plan.blocks]
        k, later = first_split(state_bytes, grads, free=free, steady=steady, margin=margin)
        if shard_group is not None:  # the ranks agree (the smallest fit, the largest floor)
            self._agree_group = collectives.host_group(shard_group)
            k = later = collectives.agree_min(k, self._agree_group)
            store.floor = floor = -collectives.agree_min(-floor, self._agree_group)
        if floor > k and sum(state_bytes[:floor]) <= free:
            k = floor  # made now: it fits, if not with the margin
        if floor > max(k, later):
            raise store.gpu_refusal(floor, free + (sum(grads) - sum(grads[k:floor]) if grads else 0))
        if self.max_k is not None:
            k, later = min(k, self.max_k), min(later, self.max_k)
        self.first_k = (k, max(k, later))
        return self.first_k

    def _free(self, *, device=False) -> tuple[int, int, int]:
        """(allocated, free, limit): GPU bytes allocated now, free within the process's limit (the
        allocator's unused reserve counted as free; ``device``: within the device only), and that limit."""
        dev = self.store.device
        allocated = torch.cuda.memory_allocated(dev)
        free, _ = torch.cuda.mem_get_info(dev)
        free += torch.cuda.memory_reserved(dev) - allocated
        limit = self.gpu_limit()
        return allocated, max(0, free if device else min(free, limit - allocated)), limit

    def gpu_room(self) -> int:
        """GPU bytes that more weights and states may take for good, within the run's limit: what this
        iteration has not used at its peak so far (the loss's logits included, which later forwards
        allocate again), beside one block's gradients in flight and the scheduler's margin."""
        allocated, free, limit = self._free()
        peak = max(torch.cuda.max_memory_allocated(self.store.device), allocated)
        return allocated + free - peak - self._transient() - ((1 << 30) + limit // 20)

    def _transient(self) -> int:
        """The gradients in flight at once when blocks hand them off during backward: the largest
        block's, twice (one landing on the host while the next accumulates)."""
        return 2 * max((sum(local(p).numel() * p.element_size() for p in blk) for blk in self.plan.blocks),
                       default=0)

    def first_backward(self, floor, *, hands_off, why_kept) -> bool:
        """At the first gradient of the first backward, on CUDA (see :func:`first_backward`): False
        where the gradients still to come fit (the state is made at step(), as usual); True where
        they do not but the state can be made now, each block's gradients then leaving the GPU as
        in later backwards; otherwise :class:`CapacityError`, before anything of the state is
        allocated, naming the bytes on each side (``why_kept``: what keeps the gradients to step())."""
        sizes = self.plan.sizes()[2]
        to_come = sum(local(p).numel() * p.element_size() for p in self.plan.params
                      if p.requires_grad and p.grad is None)
        allocated, free, _ = self._free()
        device_free = self._free(device=True)[1]
        decision = first_backward(to_come, free, device_free=device_free,
                                  floor_states=sum(sizes[:floor]), transient=self._transient(), hands_off=hands_off)
        if decision == "keep":
            return False
        if decision == "hand off":
            return True
        if not hands_off:
            raise CapacityError(
                f"the first backward would keep every block's gradients on the GPU until step() ({why_kept}): "
                f"{format_bytes(to_come)} more of them, but {format_bytes(device_free)} of GPU memory is free beside "
                f"the {format_bytes(allocated)} in use (weights, activations): without that, each block's "
                "gradients leave the GPU as backward produces them; else use a larger GPU or a smaller model")
        raise self.store.gpu_refusal(floor, free - self._transient())

    def sample_first(self, b) -> None:
        """The first backward, block b's gradients complete: the GPU memory in use (a host-side
        counter), sampled where the meter samples later iterations."""
        device = local(self.plan.blocks[b][0]).device
        if device.type == "cuda":
            self._first_samples.append((b, torch.cuda.memory_allocated(device)))

    def releases_in_backward(self, kept=False) -> bool:
        """Whether later backwards release each block's gradients as it is handed off, so that they
        are not all on the GPU at once. Not while accumulating: every block's stay through the
        micro-batches before the last (later iterations peak as the first did, gradients and all)."""
        s = self.settings
        return s.release_grads and s.overlap and not kept and s.accumulation_steps == 1

    def _steady_peak(self, peak, *, released) -> int:
        """The most GPU memory later iterations use apart from the states, from the first
        iteration's ``peak`` (everything it allocated; no state existed yet). Where later backwards
        release each block's gradients as it is handed off (on CUDA after the first step, without
        loss scaling or accumulation), from the first backward's samples: there every gradient
        stayed until step(), later a block's are gone by the time the next block completes. Where
        they keep every gradient (accumulating micro-batches, or gradients kept for the loop), the
        first iteration's peak is theirs too, including what falls between the samples (the loss's
        logits at the start of each backward, beside the gradients of the micro-batches before):
        the scheduler's budget never counts on less."""
        if not released:
            self._nonstate_peak = max(self._nonstate_peak, peak)
            return peak
        if not self._first_samples:
            return peak
        grad_bytes = [sum(local(p).numel() * p.element_size() for p in blk) for blk in self.plan.blocks]
        out, gone = 0, 0
        for b, in_use in self._first_samples:  # in the order the blocks completed
            out = max(out, in_use - gone)
            gone += grad_bytes[b]
        return out

    def gpu_limit(self) -> int:
        """The GPU memory the run may use: ``gpu_memory_limit``, else the device's memory within the
        process's memory fraction."""
        s, device = self.settings, self.store.device
        if s.gpu_memory_request is not None:
            return s.gpu_memory_request
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = 1.0
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if getter is not None:
            try:
                fraction = float(getter(device))
            except (RuntimeError, TypeError):
                fraction = 1.0
        return int(total * fraction)

    def start(self, *, measured, pipeline) -> None:
        """At the state's creation: on CUDA with per-layer forward hooks (``measured``) the meter
        and the scheduler (with accumulation, an iteration is measured as one micro-batch: the
        others add the same time to every k). And the shadows' memory locked ahead."""
        store, s = self.store, self.settings
        self.reserve_shadows_ahead()
        if not (store.cuda and measured):
            return
        # Iterations are numbered from the first, which ran before the state existed.
        meter = Meter(store.device, pipeline, len(self.plan), first_index=1)
        # Fixed k too: its predictions are what a run is checked against.
        numel, weight, state_bytes = self.plan.sizes()
        scheduler = native().KSplitScheduler(numel, weight, state_bytes, every=s.schedule_every, deferred=True)
        self.attach(meter, scheduler, self.gpu_limit())
        scheduler.min_k = store.floor
        self._probe_gpu_rate()
        if s.gpu_blocks == len(self.plan):  # no block updates on the CPU yet to measure its rate
            self._probe_cpu_rate()

    def attach(self, meter, scheduler=None, gpu_memory_limit=None) -> None:
        """The meter whose iterations feed the scheduler (and the scheduler, with the GPU memory it
        budgets within); :meth:`start` makes them on CUDA, a test gives recorded ones."""
        self.meter, self.scheduler, self.gpu_memory_limit = meter, scheduler, gpu_memory_limit
        if scheduler is not None:
            scheduler.memory_budget = 0.0  # nothing more resident until a step's peak has been seen

    def _probe_gpu_rate(self):
        """alpha's GPU side before any block runs there: the fused AdamW on 4 M scratch elements."""
        n, device = 1 << 22, self.store.device
        dtype = self.plan.blocks[0][0].dtype
        st = self.settings
        t = [torch.zeros(n, device=device),
             *(torch.zeros(st.moment_shape((n,)), dtype=st.state_dtype, device=device) for _ in range(2))]
        g = torch.full((n,), 1e-3, dtype=dtype, device=device)
        w = torch.empty(n, dtype=dtype, device=device) if dtype != torch.float32 else None
        fused = CudaAdamW([t[0]], [t[1]], [t[2]], [g], weights=[w] if w is not None else None)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fused.step(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        start.record()
        for i in range(3):
            fused.step(step=2 + i, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        end.record()
        end.synchronize()
        self.scheduler.observe_rate(native().Phase.gpu, start.elapsed_time(end) / 1e3 / 3 / n)

    def _probe_cpu_rate(self):
        """c, the CPU side, before any block runs there: the workers' AdamW on 4 M scratch elements."""
        n, workers = 1 << 22, self.settings.workers
        dtype = self.plan.blocks[0][0].dtype
        st = self.settings
        w, (m, v) = torch.zeros(n), (torch.zeros(st.moment_shape((n,)), dtype=st.state_dtype) for _ in range(2))
        g = torch.full((n,), 1e-3, dtype=dtype)
        copy = torch.empty(n, dtype=dtype) if dtype != torch.float32 else None
        adamw_step(w, g, m, v, step=1, param_copy=copy, num_threads=workers)
        start = time.perf_counter()
        for i in range(3):
            adamw_step(w, g, m, v, step=2 + i, param_copy=copy, num_threads=workers)
        self.scheduler.observe_rate(native().Phase.cpu, (time.perf_counter() - start) / 3 / n)

    def after_step(self, *, early_copies, speculation_allowed) -> None:
        """After a step's launches: feed the last complete iteration's costs, refresh the memory
        budget, let the scheduler pick k for the next step (migrations start now), and set where
        speculation starts (``speculation_allowed``: whether the next backward may speculate)."""
        if self.meter is not None:
            self._schedule(self.meter.end_iteration(), early_copies, speculation_allowed)
        if self.scheduler is None or self.settings.speculate != "auto":
            self.speculate_from(self.speculation_floor(speculation_allowed), speculation_allowed)
        if self.store.cuda:
            self.give_back_when_quiet()

    def _schedule(self, record, early_copies, allowed):
        s, sched = self.settings, self.scheduler
        summary = self.meter.harvest(record, sched) if record is not None else None
        if summary is not None:
            self.summary = {k: v for k, v in summary.items() if k != "nonstate_peak_bytes"}
        if sched is None:
            return
        sched.deferred = True  # updates are applied in step(), never during backward
        sched.overlap = s.overlap
        sched.early_copies = early_copies
        sched.speculative_min = self.speculation_floor(allowed)
        sched.speculative_fixed = s.speculate != "auto"  # predictions as the run does
        if not s.auto:
            if sched.ready():
                self.prediction = sched.predict(s.gpu_blocks)
                self._speculate_as_predicted(allowed)
            return
        k = s.gpu_blocks
        if summary is not None:
            # The most memory seen in use apart from resident states, sampled as each block's
            # gradients completed (backward is where activations and gradients meet), plus a margin
            # for what falls between samples (the loss, temporary buffers).
            self._nonstate_peak = max(self._nonstate_peak, summary["nonstate_peak_bytes"])
            if summary.get("alloc_retries"):
                self._give_way(k)
            budget = max(0, self._budget(self._nonstate_peak))
            if self.max_k is not None:  # the streamed blocks' states stay on the host: beyond the budget
                budget = min(budget, sum(self.plan.sizes()[2][:self.max_k]))
            sched.memory_budget = float(budget)
            k = sched.decide(s.gpu_blocks)
        if self._agree_group is not None:
            # Sharded: each rank decides from its own measurements, and all take the smallest k --
            # within every rank's memory budget, and every rank's migration falls in the same step
            # (a step is as slow as its slowest rank). Every rank takes part every step, decision or
            # not (a rank whose iteration was not measured offers its current k).
            k = collectives.agree_min(k, self._agree_group)
        if k != s.gpu_blocks:
            self.store.migrate(k)
        if summary is not None and sched.ready():
            self.prediction = sched.last_prediction()
            self._speculate_as_predicted(allowed)

    def _budget(self, nonstate_peak) -> int:
        return self.gpu_memory_limit - nonstate_peak - (1 << 30) - self.gpu_memory_limit // 20 - self._pressure

    def _give_way(self, k) -> None:
        """A measured iteration in which the caching allocator reached the memory limit, freed its
        cache and retried (each time a device synchronisation, in forward or backward): the resident
        states give way by the last resident block's bytes (k goes down one), for the rest of the
        run. The budget counts what the allocator reserves, but not the slack it needs near the limit
        to allocate without freeing; this measures that slack instead of guessing it."""
        sizes = self.plan.sizes()[2]
        self._pressure += sizes[k - 1] if k > 0 else max(sizes, default=0)

    def _speculate_as_predicted(self, allowed):
        if self.settings.speculate == "auto":
            self.speculate_from(self.prediction["speculative_from"], allowed)

    def speculation_floor(self, allowed):
        """The lowest block from which every offloaded block has, or could get, shadows (None: not
        even the last block, or speculation not ``allowed`` in the next backward)."""
        if not allowed:
            return None
        speculate = self.settings.speculate
        plan = self.store.shadow_plan(0 if speculate == "auto" else speculate)
        return plan[-1] if plan else None

    def reserve_shadows_ahead(self) -> None:
        """At the state's creation (on CUDA, speculating, in a pool of our own that page-locks): the
        shadows of the last ``AHEAD_SHARE`` of the offloaded blocks (from a fixed start: those from
        it), within the host's headroom, page-locked now on the state's threads -- the first step
        is making pool memory anyway, where later steps would wait or share the host with it."""
        store, s = self.store, self.settings
        if not (store.cuda and s.overlap and s.speculate is not False and s.pool is None
                and store.pool.page_locked):
            return
        L = len(self.plan)
        start = L - math.ceil((L - s.gpu_blocks) * AHEAD_SHARE) if s.speculate == "auto" else s.speculate
        blocks = [b for b in store.shadow_plan(start) if not store.shadows.has(b)]
        began = time.perf_counter()
        if store.shadows.reserve_ahead(blocks):
            store.shadows.trim_later()
        self.shadows_ahead = (len(blocks), round(time.perf_counter() - began, 3))

    def speculate_from(self, start, allowed) -> None:
        """Blocks >= start speculate in the next backward. Their shadows are allocated from the last
        block down, within the host headroom (where that ends, the start rises) and, in a pool that
        page-locks, within the memory it has locked already (the first step locked some ahead,
        :meth:`reserve_shadows_ahead`): what more they need is page-locked on a thread of its own,
        and the start comes down to the planned one in the step after that has finished. What the
        shadows leave of the locked memory is given back on that thread too
        (:meth:`give_back_when_quiet`). No step waits for either."""
        self.spec_from = None
        if start is not None and allowed:
            self._speculate(start)

    def give_back_when_quiet(self) -> None:
        """Each step: once no shadows have been made or page-locked for ``QUIET_STEPS`` steps, the
        pool's wholly free slabs (what the shadows left, the host memory of states that went to the
        GPU) go back to the system on the background thread, where some are due."""
        shadows = self.store.shadows
        if shadows.trim_due and self._quiet > QUIET_STEPS and shadows.pool_idle() and shadows.trim_in_background():
            shadows.trim_due = False
        self._quiet += 1

    def _speculate(self, start) -> None:
        store = self.store
        began = time.perf_counter()
        plan = store.shadow_plan(start)
        missing = [b for b in plan if not store.shadows.has(b)]
        now = self._within_locked(missing)
        for b in plan:
            if b in now and not store.shadows.allocate(b):
                break  # the pool's capacity: speculation starts above this block
            if not store.shadows.has(b):
                break  # its shadows wait for the memory being locked: speculation starts above it
            self.spec_from = b
        rest = [b for b in missing if not store.shadows.has(b)]
        if rest and store.shadows.reserve_in_background(rest):
            self._quiet = 0
            store.shadows.trim_later()
            if self.meter is not None:
                self.meter.pending = None  # page-locking beside the updates: not a measurement
        if now:
            self._quiet = 0
            store.shadows.trim_later()
            self.shadow_allocations.append((len(now), round(time.perf_counter() - began, 4)))

    def _within_locked(self, missing):
        """The leading blocks of ``missing`` (from the last block down) whose shadows fit in what the
        pool has page-locked and not handed out; every one where the pool does not page-lock."""
        shadows = self.store.shadows
        if not missing or not shadows.pool_idle():
            return [] if missing and shadows.free_room() is not None else missing
        room = shadows.free_room()
        if room is None:
            return missing
        out = []
        for b in missing:
            room -= shadows.need(b)
            if room < 0:
                break
            out.append(b)
        return out

    def stats(self) -> dict:
        out = {"k": self.settings.gpu_blocks, "speculative_from": self.spec_from, **self.summary,
               "shadow_allocations": list(self.shadow_allocations),
               # the shadows' pool work: (kind, start, end, bytes) in time.perf_counter() seconds
               "shadow_pool_work": list(self.store.shadows.work_log)}
        if self.shadows_ahead is not None:
            out["shadows_ahead"] = self.shadows_ahead
        if self.first_k is not None:
            out["first_k"] = self.first_k  # (made at once, made in the first step as room came)
        if self.store.made_s is not None:  # the state's making, in the first step: page-locking, filling
            out["state_made_s"] = dict(self.store.made_s)
            out["state_made_memory"] = dict(self.store.made_memory)
        p = self.prediction
        if p is not None:
            out["predicted_iter_s"] = p["iter_s"]
            out["predicted_gpu_idle_s"] = p["gpu_idle_s"]
        if self.scheduler is not None and self.settings.auto:
            out["state_budget_bytes"] = self.scheduler.memory_budget
        return out
