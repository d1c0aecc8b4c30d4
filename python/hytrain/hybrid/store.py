"""The state store: every parameter's fp32 master, m and v (torch's ``optimizer.state``), created at
the first step in the pinned pool for the device and dtype the parameters have then, registered
once in the native ``ParamTable``, in the state format (formats.py); staging for CUDA parameters;
where each block's state lives (pinned host memory, or the GPU for resident blocks) and which
blocks' states the first step makes. It owns the parts that do the rest:

* ``residency`` (:class:`Residency`, residency.py): the GPU-resident states and the asynchronous
  moves between host and GPU on a migration stream (the native ``BlockRuntime`` decides what moves);
* ``shadows`` (:class:`Shadows`, shadows.py): speculation shadows and undo records, within the host
  limit;
* ``writes`` (:class:`WeightWrites`, writes.py): the weights as the optimizer last wrote them;

with the memory budgets and refusals in budgets.py, and the entries loaded or put in
``optimizer.state`` by the loop in loads.py."""

from __future__ import annotations

import os
import time

import torch

from .. import _checks
from .._native import native
from ..distributed import process_cpus
from ..pool import counter_changes, memory_counters
from . import budgets, formats, loads
from .common import is_sharded, like, local
from .residency import Residency
from .shadows import Shadows
from .writes import WeightWatch, WeightWrites


class StateStore:
    """``state``: the optimizer's state dict (parameter -> {key: tensor}), filled by :meth:`create`:
    pinned host tensors for the blocks the CPU updates, GPU tensors for GPU-resident blocks (the
    host holds nothing of those). ``wait``: waits for blocks' updates in flight (the launcher's)."""

    def __init__(self, plan, settings, rt, state, wait):
        self.plan, self.settings, self.rt, self.state, self.wait = plan, settings, rt, state, wait
        self.device = None
        self.cuda = False
        self.pool = None
        # The streamed blocks' states in ordinary memory (own pool, CUDA only): see _make_pools.
        self.unlocked = None
        self.table = None
        self.bound = None  # id(p) -> (device, dtype, shape) the state was created for
        self.amsgrad_bound = None  # each group's amsgrad when the state was created
        self.staging = {}  # id(p) -> (gradient staging, weight staging or None); host-resident CUDA parameters
        # id(p) -> the tensors this store last put in state[p]: they stay alive whatever the loop does
        # to optimizer.state (the native table holds their addresses), and tell what it changed there.
        self._owned = {}
        self.floor = 0  # the host holds the states of blocks >= floor only: k never goes below it
        self.made_s = None  # how long create() took (its two parts), once it has run
        self.made_memory = None  # the host's memory then (pool.memory_counters)
        self.deferred = []  # GPU-resident blocks whose states the first step makes (create)
        self._groups_set = None  # the hyperparameters the table has
        self._state_bytes = plan.sizes()[2]
        # The model's weight window (window.py), or None: a streamed parameter's training copy lives
        # in its home on the host, which its updates write; and the blocks that stream (set_window,
        # before create()).
        self.window = None
        self.streamed = frozenset()
        self._new_parts()
        self.writes = WeightWrites(plan, rt, state)

    def _new_parts(self) -> None:
        """The residency and the shadows over the device, pool and table of now (none before
        :meth:`create`)."""
        self.shadows = Shadows(self.plan, self.settings, self.rt, self.state, self.pool, self.table,
                               streams=self.streams)
        self.residency = Residency(self.plan, self.settings, self.rt, self.device, self.pool,
                                   trim_later=self.shadows.trim_later)

    # -- streamed weights -----------------------------------------------------------------------------

    def home(self, p):
        """A streamed parameter's training copy on the host (its window's home), else None."""
        w = self.window
        return w.home(p) if w is not None and w.streams(p) else None

    def weights(self, p):
        """The parameter's training copy as the optimizer reads it: its home when it streams, else its
        local weights."""
        home = self.home(p)
        return local(p) if home is None else home

    def weight_address(self, p) -> int:
        """Where an update writes the parameter's new weights: on the CPU path its home or its
        weights; on the CUDA path 0 for a streamed one (its staging entry is its home: nothing is
        copied to the device), else the device weights (a kept layer's too)."""
        home = self.home(p)
        if home is None or (self.cuda and self.window.kept(p)):
            return local(p).data_ptr()  # (a kept layer's update is copied from its home to the device)
        return 0 if self.cuda else home.data_ptr()

    def set_window(self, window, blocks) -> None:
        """The weight window whose homes hold the weights of ``blocks`` (each streams whole)."""
        self.window, self.streamed = window, frozenset(blocks)

    def streams(self, b) -> bool:
        """Whether block b streams (its home stages its gradients: it never speculates)."""
        return b in self.streamed

    # -- creation -------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """The parameters' device, checked, before the state is placed."""
        self.device = formats.check_params(self.plan.params)
        self.cuda = self.device.type == "cuda"
        if self.settings.gpu_blocks and not self.cuda:
            raise ValueError("gpu_blocks > 0 needs CUDA parameters (these are on the CPU)")

    def create(self, param_groups, k, later=None) -> None:
        """Creates the state for the device and dtype the parameters have now: blocks < ``k`` on the
        GPU (nothing of theirs on the host), the others in the pinned pool -- except blocks
        k..``later``-1, GPU-resident too, whose states are made in the first step (:meth:`make_deferred`):
        there is room for them once the step has released the other blocks' gradients."""
        plan = self.plan
        later = k if later is None else later
        pool = self.settings.pool
        began, at_start = time.perf_counter(), memory_counters()
        self._make_pools(later)
        self.table = native().ParamTable()  # each parameter's host buffers; handle = its index
        self._new_parts()
        locked, reserved = time.perf_counter(), memory_counters()
        for p in plan.params:
            b = plan.block_of[id(p)]
            if k <= b < later and local(p).numel():
                self._register_on_gpu(p)
            else:
                self._init_state(p, on_gpu=b < later)
        # (seconds: reserving the pools' memory, page-locking it, then filling the state: schedule_stats)
        self.made_s = {"reserve": round(locked - began, 3), "fill": round(time.perf_counter() - locked, 3)}
        # (and what the kernel did meanwhile: huge pages, reclaim, compaction; the memory free before)
        self.made_memory = {"before": {k: v for k, v in at_start.items() if k.endswith("_gb")},
                            "slabs": [p.stats()["slabs"] for p in (self.pool, self.unlocked) if p is not None],
                            "cpus": {"thread": len(os.sched_getaffinity(0)),
                                     "process": process_cpus()},
                            "reserve": counter_changes(at_start, reserved),
                            "fill": counter_changes(reserved, memory_counters())}
        self.deferred = list(range(k, later))
        if pool is None:
            self.pool.trim()  # slabs the reservation made and the state did not need
            if self.unlocked is not None:
                self.unlocked.trim()
        up, _ = self.rt.migrate(later)  # nothing is in flight: the first blocks are resident now
        for b in up:
            self.rt.moved_up(b)
        self.settings.gpu_blocks = later
        if self.cuda:
            self.residency.start()
        watched = [[p for p in blk if not is_sharded(p) and local(p).numel() and self.home(p) is None
                    and (p.dtype != torch.float32 or self.cuda)]  # (fp32 CPU weights are their own master)
                   for blk in plan.blocks]
        watch = WeightWatch(watched, self.device) if any(watched) and self.settings.watch_writes else None
        self.writes = WeightWrites(plan, self.rt, self.state, watch, homes=self.home)
        self.bound = {id(p): (w.device, w.dtype, w.shape) for p in plan.params for w in (local(p),)}
        self.amsgrad_bound = [bool(g["amsgrad"]) for g in param_groups]

    def _make_pools(self, later) -> None:
        """The pinned pool (given, or our own) and, in our own on a GPU, the ordinary-memory pool of
        the streamed blocks' states (budgets.make_pools); the states' slabs reserved at once."""
        self.pool, self.unlocked = budgets.make_pools(self.plan, self.settings, self.cuda, self.floor, later,
                                                      self.streamed, self.home)

    def make_deferred(self, b) -> None:
        """Block b's deferred state (see :meth:`create`), made on the GPU now. Where the GPU cannot
        hold it, it goes to the host instead, with every deferred block after it."""
        if b not in self.deferred:
            return
        params = [p for p in self.plan.blocks[b] if local(p).numel()]
        try:
            for p in params:
                self._gpu_state(p)
        except torch.cuda.OutOfMemoryError:
            for p in params:
                self.residency.discard(p)
                for key in self._keys(p):
                    self.state[p].pop(key, None)
                self._own(p)
            self.defer_to_host(b)
            return
        self.deferred.remove(b)
        self.writes.note(self.plan.blocks[b])

    def defer_to_host(self, b=None) -> None:
        """The deferred blocks from b on (all of them by default) get their states on the host
        instead (k becomes b); those below the host's floor cannot, and are refused."""
        if not self.deferred:
            return
        b = self.deferred[0] if b is None else b
        blocks = [x for x in self.deferred if x >= b]
        if blocks[0] < self.floor:
            raise budgets.deferred_refusal_below_floor(blocks[0], self.floor)
        per_block, room = self.block_host_bytes(), budgets.host_headroom(self.pool)
        need = sum(per_block[x] for x in blocks)
        if room is not None and need > room:
            raise budgets.deferred_refusal_no_room(b, blocks[-1], room, need)
        _, down = self.rt.migrate(b)
        for x in down:
            for p in self.plan.blocks[x]:
                if not local(p).numel():
                    continue  # (its empty state is on the host already)
                st, host = self.state[p], self._host_state(p, fill=True)
                st.update({key: t for key, t in host.items() if key not in ("grad", "copy")})
                self._own(p)
                self._table_to_host(p, host)
            self.rt.moved_down(x)
        self.deferred = [x for x in self.deferred if x < b]
        self.writes.note([p for x in down for p in self.plan.blocks[x]])
        self.settings.gpu_blocks = b

    def _table_to_host(self, p, host):
        """The parameter's table entry points at its host state (``state[p]``) and staging (``host``)."""
        st = self.state[p]
        self.table.to_host(self.plan.index(p), st.get("master", local(p)).data_ptr(), st["exp_avg"].data_ptr(),
                           st["exp_avg_sq"].data_ptr(), _checks.address(st.get("max_exp_avg_sq")),
                           _checks.address(host.get("grad")), _checks.address(host.get("copy")))

    def clear(self) -> None:
        """Drops the state (a failed creation, or a rebuild): the entries of the parameters it is for
        leave ``optimizer.state`` (those of frozen parameters stay, as in torch)."""
        for p in self.plan.params:
            self.state.pop(p, None)
        self._owned = {}
        self.pool = self.unlocked = self.table = self.bound = self.amsgrad_bound = None
        self.staging = {}
        self._new_parts()
        self.deferred = []
        self._groups_set = None
        self.writes = WeightWrites(self.plan, self.rt, self.state, homes=self.home)

    # -- budgets (budgets.py) -------------------------------------------------------------------------

    def block_host_bytes(self) -> list[int]:
        """Per block, the pinned host bytes its state and staging take while the CPU updates it."""
        return budgets.block_host_bytes(self.plan, self.settings, self.cuda, self.home)

    def host_floor(self) -> int:
        """The smallest k for which the host can hold the states of blocks >= k, which k never goes
        below from now on (:func:`budgets.host_floor`: without CUDA, a state that does not fit is
        refused there, before anything is allocated)."""
        self.floor = budgets.host_floor(self.plan, self.settings, self.cuda, self.home)
        return self.floor

    def gpu_refusal(self, k, free):
        """The error for a state whose first k blocks must live on the GPU, where ``free`` bytes are
        left for them: the bytes on each side."""
        return budgets.gpu_refusal(self.plan, self.settings, self.cuda, self._state_bytes, k, free, self.home)

    def trimmed(self) -> None:
        """A pool of our own gives its wholly free slabs back to the system."""
        budgets.trim(self.pool, self.settings)

    # -- formats --------------------------------------------------------------------------------------

    def _state_code(self) -> int:
        return _checks.STATE_CODES[self.settings.state_dtype]

    def _keys(self, p):
        return formats.state_keys(self.plan, p, self.cuda)

    def _init_state(self, p, *, on_gpu):
        """The parameter's state, shaped like its local shard when it is sharded (FSDP2): each rank
        holds the master, m and v of its own shard only. A shard that is empty on this rank gets
        empty host state (nothing to update). On the GPU (``on_gpu``) the state is made there, from
        the weights, with nothing on the host."""
        if on_gpu and local(p).numel():
            self._register_on_gpu(p)
            self._gpu_state(p)
            return
        st = self.state[p]
        w = local(p)
        st["step"] = torch.zeros((), dtype=torch.float32)
        host = self._host_state(p, fill=True)
        st.update({key: t for key, t in host.items() if key not in ("grad", "copy")})
        handle = self.table.add(
            master=st.get("master", w).data_ptr(), exp_avg=st["exp_avg"].data_ptr(),
            exp_avg_sq=st["exp_avg_sq"].data_ptr(), max_exp_avg_sq=_checks.address(st.get("max_exp_avg_sq")),
            step=st["step"].data_ptr(), grad=_checks.address(host.get("grad")),
            dtype=_checks.DTYPE_CODES[p.dtype], copy=_checks.address(host.get("copy")),
            numel=w.numel(), group=self.plan.group_index[id(p)], amsgrad="max_exp_avg_sq" in st,
            state_dtype=self._state_code())
        assert handle == self.plan.index(p)
        self._own(p)

    def _register_on_gpu(self, p):
        """The parameter's step counter and its table entry as a GPU-resident one (no host buffers)."""
        st = self.state[p]
        st["step"] = torch.zeros((), dtype=torch.float32)
        handle = self.table.add(master=0, exp_avg=0, exp_avg_sq=0, max_exp_avg_sq=0, step=st["step"].data_ptr(),
                                grad=0, dtype=_checks.DTYPE_CODES[p.dtype], copy=0, numel=local(p).numel(),
                                group=self.plan.group_index[id(p)], amsgrad=self.plan.amsgrad(p), on_host=False,
                                state_dtype=self._state_code())
        assert handle == self.plan.index(p)
        self._own(p)

    def _gpu_state(self, p):
        """The parameter's state on the GPU: zero moments, the master from the weights, and the
        gradient buffer its updates read."""
        st, w, s = self.state[p], local(p), self.settings
        d = {key: like(torch.zeros(formats.key_shape(s, w, key), dtype=formats.key_dtype(s, key),
                                   device=self.device), w)
             for key in self._keys(p) if key != "master"}
        # (an fp32 weight is its own master)
        d["master"] = w.detach().float() if p.dtype != torch.float32 else w.detach()
        d["grad"] = torch.empty_like(w)
        self.residency.add(p, d)
        for key in self._keys(p):
            st[key] = d[key]
        self._own(p)

    def _host_state(self, p, *, fill):
        """The parameter's host tensors from the pool: its state (zero moments and the master from
        the weights with ``fill``) and, for CUDA parameters, its staging -- one buffer: the gradient
        is copied in, the CPU update reads each element's gradient before writing its new bf16/fp16
        weight over it, and the H2D copy sends it back. Registers the staging."""
        w = local(p)
        if w.numel():
            pool = self.unlocked if self.unlocked is not None and self.home(p) is not None else self.pool
            zeros, empty = pool.zeros, pool.empty
        else:
            def zeros(shape, dtype=torch.float32):
                return torch.zeros(shape, dtype=dtype)
            empty = zeros
        out, s = {}, self.settings
        for key in self._keys(p):
            make = zeros if fill and key != "master" else empty
            out[key] = like(make(formats.key_shape(s, w, key), formats.key_dtype(s, key)), w)
        if fill and "master" in out:
            out["master"].copy_(self.weights(p).detach())
        if self.cuda:
            # A streamed parameter's home is its staging: its gradients land there once its layer's
            # backward has read the weights, and the update writes the new weights over them, where
            # they stay (nothing goes back to the device). The others get a buffer of their own,
            # and the H2D copy sends the new weights back.
            home = self.home(p)
            buf = like(empty(w.shape, p.dtype), w) if home is None else home
            out["grad"] = buf
            if p.dtype != torch.float32:
                out["copy"] = buf
            self.staging[id(p)] = (buf, out.get("copy"))
        return out

    # -- checks ---------------------------------------------------------------------------------------

    def check_bound(self, p):
        """Refuses a parameter that changed device, dtype or shape after its state was created."""
        device, dtype, shape = self.bound[id(p)]
        w = local(p)
        if w.device != device or w.dtype != dtype or w.shape != shape:
            raise RuntimeError(
                f"parameter {self.plan.index(p)} is now {str(w.dtype).replace('torch.', '')} of shape "
                f"{tuple(w.shape)} on {w.device}, but HybridAdamW created its state at the first step for "
                f"{str(dtype).replace('torch.', '')} of shape {tuple(shape)} on {device}. Moving or casting "
                "parameters after the first step is not supported: move the model before the first step, "
                "or save optimizer.state_dict(), move the model back, and load that state into a new "
                "HybridAdamW built after the move")

    def sync_groups(self, param_groups) -> bool:
        """Gives the table the param groups' hyperparameters when they changed (an LR schedule).
        Returns whether the table had other values before (passes built since were built with
        those: in step(), an lr set between backward and step())."""
        now = tuple((float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]),
                     float(g["weight_decay"]), bool(g.get("maximize", False))) for g in param_groups)
        if now == self._groups_set:
            return False
        stale = self._groups_set is not None
        self.table.set_groups([native().GroupHyper(*v) for v in now])
        self._groups_set = now
        return stale

    # -- loads and what the loop did to optimizer.state (loads.py) -----------------------------------

    def load_entries(self, entries, *, reset_missing, sharded=False, reset=()):
        """Copies loaded state entries (parameter -> {key: tensor}, checked) into the host buffers;
        with ``reset_missing`` the parameters without an entry start afresh (step 0, zero moments,
        the master from the weights), else those in ``reset``."""
        fresh, mastered = loads.copy_in(self.plan, self.state, entries, reset_missing=reset_missing, reset=reset,
                                        weights=self.weights)
        # Masters made from the weights match them; loaded ones are checked against the weights at the
        # next step (WeightWrites.refresh). Entries without one (a torch checkpoint, a counter reset)
        # leave the weights' writes to be followed (Engine._follow_weight_writes).
        self.writes.note([p for p in fresh if "master" in self.state[p]], sharded=sharded)
        # A streamed parameter's loaded master is checked against its weights now, as the others' are
        # at the next step (WeightWrites.refresh: where a weight is not the master's rounding, the
        # master takes the weight); its home holds them now, which at the next step it may not (its
        # gradients are staged there). A held block's home stages gradients already: left as loaded.
        streamed = [p for p in mastered if self.home(p) is not None]
        self.writes.refresh([p for p in streamed if not self.rt.in_flight(self.plan.block_of[id(p)])])
        if not sharded:
            ids = {id(p) for p in streamed}
            self.writes.masters_loaded([p for p in mastered if id(p) not in ids])

    def _own(self, p) -> None:
        self._owned[id(p)] = dict(self.state[p])

    def rebind(self, state) -> None:
        """``optimizer.state`` is another dict now (``opt.state = defaultdict(dict)``): it is the one
        read and written from here on; what it holds is reconciled by :meth:`changes`."""
        self.state = state
        self.shadows.rebind(state)
        self.writes.rebind(state)

    def changes(self) -> tuple[dict, set]:
        """What the loop changed in ``optimizer.state`` since this store last wrote it, found by
        identity (:func:`loads.changes`)."""
        return loads.changes(self.plan, self.state, self._owned)

    def checked_entries(self, entries: dict, *, like=None) -> dict:
        """Entries the loop put in ``optimizer.state``, checked as a load checks them
        (:func:`loads.checked`) and shaped for :meth:`load_entries`."""
        return loads.checked(self.plan, entries)

    def restore(self, replaced: dict, removed: set, *, sharded: bool) -> None:
        """Applies :meth:`changes` as torch would see them, with nothing in flight: a removed entry
        starts afresh (step 0, zero moments, the master from the weights); a replaced tensor's
        values are copied into this store's buffer (in its format and place, after the checks of a
        load). ``optimizer.state[p]`` holds this store's buffers again either way."""
        entries = self.checked_entries(replaced)
        for p in (*replaced, *removed):
            cur = self.state.get(p)
            if not isinstance(cur, dict):
                cur = self.state[p] = {}
            cur.update(self._owned[id(p)])
        self.load_entries(entries, reset_missing=False, sharded=sharded, reset=removed)

    # -- placement: moves between host and GPU (residency.py) -----------------------------------------

    def migrate(self, k):
        """Starts moving states so that blocks < k are GPU-resident (never below the host's floor).
        Nothing here waits: states go down on the migration stream after the compute stream's last
        update of them; states go up once the block's in-flight CPU update has finished (at its
        forward wait), and the compute stream waits for them before its next work. A state that
        leaves the host gives its pinned memory back (to the pool, and the pool's free slabs to the
        system); one that comes back takes it again."""
        k = self.host_fit(max(k, self.floor))
        up, down = self.rt.migrate(k)  # blocks with a pass in flight go up once it is waited for
        for b in up:
            self.to_gpu(b)
        for b in down:
            self._to_host(b)
        self.settings.gpu_blocks = k

    def to_gpu(self, b):
        for p in self.plan.blocks[b]:  # a resident block does not speculate
            self.shadows.drop(p)
        self.residency.up(b, [(p, self.state[p], self._keys(p)) for p in self.plan.blocks[b]], self._went_up)

    def _went_up(self, p) -> list:
        """Parameter p's state is on the GPU (its copies queued): the table holds nothing of it on the
        host, and its staging is let go (returned: freed once the copies have read the host)."""
        leaving = [t for t in self.staging.pop(id(p), ()) if t is not None]
        self._own(p)
        self.table.to_device(self.plan.index(p))
        return leaving

    def _to_host(self, b):
        entries = [(p, self.state[p], self._host_state(p, fill=False), self._keys(p)) for p in self.plan.blocks[b]]
        self.residency.down(b, entries, self._came_down)

    def _came_down(self, p, host):
        """Parameter p's state is on the host (its copies queued): the table points at it."""
        self._own(p)
        self._table_to_host(p, host)

    def settle(self):
        """Completes every move (states waiting to go up go now)."""
        for b in self.rt.take_up():
            self.to_gpu(b)
        self.residency.settle()

    def host_fit(self, k) -> int:
        """k, or more where the states that k would bring back to the host do not fit there beside
        the margin (:func:`budgets.host_margin`), within the pool's capacity: those blocks stay on
        the GPU. The speculation shadows give way first (they are optional; speculation allocates
        them again within what is left)."""
        per_block = self.block_host_bytes()
        coming = [b for b in range(k, len(per_block)) if self.rt.on_gpu(b) or self.rt.moving_up_later(b)]
        need = sum(per_block[b] for b in coming)
        if not need:
            return k
        room = budgets.host_headroom(self.pool)
        if room is not None and need > room and self.shadows.entries:
            self.shadows.drop_all(self.wait)
            self.trimmed()
            room = budgets.host_headroom(self.pool)
        for b in coming:  # the lowest blocks stay up first: k rises past them
            if room is None or need <= room:
                break
            need -= per_block[b]
            k = b + 1
        return k

    def resident_bytes(self):
        rt = self.rt
        return sum(s for b, s in enumerate(self._state_bytes) if rt.on_gpu(b) or rt.moving_up_later(b))

    # -- speculation (shadows.py) ---------------------------------------------------------------------

    def shadow_plan(self, lowest_start):
        """From the last block down to ``lowest_start``: the offloaded blocks that have, or can get,
        shadows within the host headroom (:meth:`Shadows.plan_from`), once the host memory of states
        that went to the GPU has been given back where their copies have read it."""
        return self.shadows.plan_from(lowest_start, self.residency.free_left)

    def adopt(self, b, handles) -> bool:
        """Block b's speculative states become its state; the old ones its shadows. Returns whether
        some of them were updated in place with undo records: those are the state already, and their
        records are let go once the pass is known complete (Launcher.adopt_later)."""
        records = False
        for h in handles:
            p = self.plan.params[h]
            if not self.shadows.swap(p, self.state[p]):
                records = True
                continue
            self._own(p)
            self.table.adopt(h)
        return records
