"""The state store: every parameter's fp32 master, m and v (torch's ``optimizer.state``), created at
the first step in the pinned pool for the device and dtype the parameters have then, registered
once in the native ``ParamTable``; staging for CUDA parameters; placement (pinned host memory, or
the GPU for resident blocks) and the asynchronous moves between the two on a migration stream;
speculation shadows (borrowed from an idle GPU-resident block's host state, or allocated within the
host limit). The native ``BlockRuntime`` keeps each block's placement and decides what moves; this
part moves the tensors. It is where state formats and memory budgets live."""

from __future__ import annotations

import os

import torch

from .. import _checks
from .._native import native
from ..cuda_adam import CudaAdamW
from ..pool import CapacityError, PinnedPool, available_memory_bytes
from .common import PARAM_DTYPES, STATE_KEYS, local

_STATE_AND_MASTER = ("master", *STATE_KEYS)


def _rss_bytes() -> int:
    """The process's resident memory (0 where /proc is not there to tell)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def check_params(params) -> torch.device:
    """The one device of dense, contiguous fp32/bf16/fp16 parameters (the shards of sharded ones)."""
    if not params:
        raise ValueError("HybridAdamW got an empty parameter list")
    devices = set()
    for i, p in enumerate(params):
        p = local(p)
        if p.dtype not in PARAM_DTYPES:
            raise TypeError(f"parameter {i} has dtype {p.dtype}; HybridAdamW supports float32, "
                            "bfloat16 and float16")
        if p.layout != torch.strided or not p.is_contiguous():
            raise ValueError(f"parameter {i} must be a dense contiguous tensor")
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"parameter {i} is on {p.device}; HybridAdamW supports CPU and CUDA")
        devices.add(p.device)
    if len(devices) > 1:
        raise ValueError(f"parameters are on mixed devices ({sorted(map(str, devices))}); put them on one")
    device = devices.pop()
    if device.type == "cuda" and not native().cuda_available():
        raise RuntimeError("CUDA parameters need hytrain built with CUDA (this build has no GPU support)")
    return device


class StateStore:
    """``state``: the optimizer's state dict (parameter -> {key: tensor}), filled by :meth:`create`.
    ``wait``: waits for blocks' updates in flight (the launcher's), needed before a borrowed host
    state is given back."""

    def __init__(self, plan, settings, rt, state, wait):
        self.plan, self.settings, self.rt, self.state, self.wait = plan, settings, rt, state, wait
        self.device = None
        self.cuda = False
        self.pool = None
        self.table = None
        self.bound = None  # id(p) -> (device, dtype, shape) the state was created for
        self.amsgrad_bound = None  # each group's amsgrad when the state was created
        self.staging = {}  # id(p) -> (gradient staging, weight staging or None); CUDA parameters
        self.dev = {}  # id(p) -> device master/exp_avg/exp_avg_sq/max_exp_avg_sq/grad (resident blocks)
        self.shadow = {}  # id(p) -> spare host master/exp_avg/exp_avg_sq[/max_exp_avg_sq]/copy
        self.lent = {}  # block -> the GPU-resident block whose idle host state and staging are its shadows
        self.moves = {}  # block -> CUDA event: its states' asynchronous move has completed
        self._signatures = []
        self._fused = {}  # ((id, address) of each parameter) -> CudaAdamW
        self._groups_set = None  # the hyperparameters the table has
        self._versions = {}  # id(p) -> (address, version) of the weights after our last write
        self._stream = None
        self._state_bytes = plan.sizes()[2]

    # -- creation -------------------------------------------------------------------------------------

    def create(self, param_groups) -> None:
        """Creates the state for the device and dtype the parameters have now."""
        plan = self.plan
        self.device = check_params(plan.params)
        self.cuda = self.device.type == "cuda"
        if self.settings.gpu_blocks and not self.cuda:
            raise ValueError("gpu_blocks > 0 needs CUDA parameters (these are on the CPU)")
        self.check_room()
        pool = self.settings.pool
        self.pool = pool if pool is not None else PinnedPool(self._pool_bytes(), slab_bytes="256MiB")
        if self.cuda and not self.pool.page_locked:
            raise ValueError("CUDA parameters need a page-locked pool (PinnedPool(pinned=True or 'auto') "
                             "on a machine where pinning works)")
        self.table = native().ParamTable()  # each parameter's host buffers; handle = its index
        if self.pool.page_locked:  # page-locking is the slow part: every slab at once, in parallel
            self.pool.reserve_for(self._tensor_bytes())
        for p in plan.params:
            self._init_state(p)
        if pool is None:
            self.pool.trim()  # slabs the reservation made and the state did not need
        signatures = {}  # blocks that can lend each other host state have equal signatures
        self._signatures = [signatures.setdefault(
            tuple((tuple(local(p).shape), p.dtype, "max_exp_avg_sq" in self.state[p]) for p in blk),
            len(signatures)) for blk in plan.blocks]
        if self.cuda:
            self._stream = torch.cuda.Stream(self.device, priority=0)
        self.bound = {id(p): (w.device, w.dtype, w.shape) for p in plan.params for w in (local(p),)}
        self.amsgrad_bound = [bool(g["amsgrad"]) for g in param_groups]

    def host_bytes(self) -> int:
        """The pinned host bytes the state and staging take (shadows come later, within the host
        limit): the tensors :meth:`_init_state` makes."""
        return sum(self._tensor_bytes())

    def check_room(self) -> None:
        """Refuses, before anything is allocated, a state that does not fit: in the host memory
        this process can still take, and on the GPU the states of the first ``gpu_blocks`` blocks
        when k is fixed."""
        need = self.host_bytes()
        n = sum(local(p).numel() for p in self.plan.params)
        count = f"{n / 1e9:.2f} B" if n >= 10**9 else f"{n / 1e6:.2f} M"
        # A given pool refuses what it cannot hold itself (PoolExhaustedError, nothing half made);
        # the pool made here is bounded by what the host can still give.
        room = available_memory_bytes() if self.settings.pool is None else None
        if room is not None and need > room:
            raise CapacityError(
                f"the optimizer state of {count} parameters needs {_size(need)} of pinned host memory "
                f"(fp32 master, m and v{' and staging' if self.cuda else ''}), but the host memory available to this process is "
                f"{_size(room)}: use a host with more memory, shard the model over more processes "
                "(--nproc / FSDP2), or train a smaller model")
        k = self.settings.gpu_blocks
        if self.cuda and k and not self.settings.auto:
            on_gpu = sum(self._state_bytes[:k])
            free, _ = torch.cuda.mem_get_info(self.device)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            if on_gpu > free:
                raise CapacityError(
                    f"gpu_blocks={k} keeps {_size(on_gpu)} of optimizer states on the GPU, but "
                    f"{_size(free)} of its memory is free: lower gpu_blocks, or use gpu_blocks='auto' "
                    "(it keeps on the GPU what fits beside the activations)")

    def clear(self) -> None:
        """Drops the state (a failed creation, or a rebuild)."""
        self.state.clear()
        self.pool = self.table = self.bound = self.amsgrad_bound = None
        self.staging, self.dev, self.shadow, self.lent, self.moves, self._fused = {}, {}, {}, {}, {}, {}
        self._groups_set = None
        self._versions = {}

    def _pool_bytes(self) -> int:
        """A capacity for the default pool: the state and staging bytes, plus room for the slabs'
        fragmentation (the capacity is a limit; memory is reserved slab by slab as it is used)."""
        total = 0
        for p in self.plan.params:
            per = 8 + (4 if self.plan.amsgrad(p) else 0)
            if p.dtype != torch.float32 or self.cuda:
                per += 4  # master
            if self.cuda:
                per += p.element_size()  # staging: the gradient lands there, the new weights replace it
                if self.settings.speculate is not False:  # a capacity only: shadows are allocated when used
                    per += per - (4 if p.dtype == torch.float32 else 0)
            total += local(p).numel() * per + 6 * 256
        return total * 3 // 2 + (256 << 20)

    def _tensor_bytes(self) -> list[int]:
        """The byte size of every pool tensor :meth:`_init_state` makes, in order."""
        out = []
        for p in self.plan.params:
            n = local(p).numel()
            if not n:
                continue
            out += [4 * n] * (2 + (1 if self.plan.amsgrad(p) else 0))  # m, v, max v
            if p.dtype != torch.float32 or self.cuda:
                out.append(4 * n)  # master
            if self.cuda:
                out.append(p.element_size() * n)  # staging
        return out

    def _init_state(self, p):
        """The parameter's host state, shaped like its local shard when it is sharded (FSDP2): each
        rank holds the master, m and v of its own shard only. A shard that is empty on this rank gets
        empty state (nothing to update)."""
        st = self.state[p]
        w = local(p)
        if w.numel():
            zeros, empty = self.pool.zeros, self.pool.empty
        else:
            def zeros(shape, dtype=torch.float32):
                return torch.zeros(shape, dtype=dtype)
            empty = zeros
        st["step"] = torch.zeros((), dtype=torch.float32)
        st["exp_avg"] = zeros(w.shape, torch.float32)
        st["exp_avg_sq"] = zeros(w.shape, torch.float32)
        if self.plan.amsgrad(p):
            st["max_exp_avg_sq"] = zeros(w.shape, torch.float32)
        if p.dtype != torch.float32 or self.cuda:
            st["master"] = empty(w.shape, torch.float32)
            st["master"].copy_(w.detach())
        if self.cuda:
            # One staging buffer: the gradient is copied in, the CPU update reads each element's
            # gradient before writing its new bf16/fp16 weight over it, and the H2D copy sends it back.
            buf = empty(w.shape, p.dtype)
            self.staging[id(p)] = (buf, buf if p.dtype != torch.float32 else None)
        staging = self.staging.get(id(p))
        half = p.dtype != torch.float32
        handle = self.table.add(
            master=st.get("master", w).data_ptr(), exp_avg=st["exp_avg"].data_ptr(),
            exp_avg_sq=st["exp_avg_sq"].data_ptr(), max_exp_avg_sq=_checks.address(st.get("max_exp_avg_sq")),
            step=st["step"].data_ptr(), grad=staging[0].data_ptr() if staging else 0,
            dtype=_checks.DTYPE_CODES[p.dtype], copy=staging[1].data_ptr() if staging and half else 0,
            numel=w.numel(), group=self.plan.group_index[id(p)], amsgrad="max_exp_avg_sq" in st)
        assert handle == self.plan.index(p)

    def _restate(self, p):
        """The parameter's state entries name other buffers now (adopted shadows, a donor's spare set)."""
        st = self.state[p]
        self.table.set_state(self.plan.index(p), st.get("master", local(p)).data_ptr(), st["exp_avg"].data_ptr(),
                             st["exp_avg_sq"].data_ptr(), _checks.address(st.get("max_exp_avg_sq")))

    # -- checks and what follows the loop's writes ------------------------------------------------------

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

    def note_weight_versions(self, params=None, *, sharded=False):
        """The weights' version counters as of now: our own updates write them without counting
        (copies and kernels on their memory), so a counter that moved later means the loop wrote the
        weights (``model.load_state_dict``, an in-place edit). Not for FSDP2 shards (``sharded``),
        whose storage FSDP2 manages itself."""
        if sharded:
            return
        for p in (self.plan.params if params is None else params):
            if "master" in self.state[p]:
                self._versions[id(p)] = (local(p).data_ptr(), local(p)._version)

    def written_weights(self, *, sharded=False) -> list:
        """The parameters whose weights the loop wrote since :meth:`note_weight_versions`."""
        if sharded:
            return []
        out = []
        for p in self.plan.params:
            seen = self._versions.get(id(p))
            w = local(p)
            if seen is not None and seen != (w.data_ptr(), w._version):
                out.append(p)
        return out

    def refresh_masters(self, params) -> None:
        """Each parameter's fp32 master (host, and on the GPU for a resident block) from its weights:
        what the next update starts from (nothing in flight may read them)."""
        for p in params:
            w, st = local(p).detach(), self.state[p]
            if self.rt.on_gpu(self.plan.block_of[id(p)]) and p.dtype != torch.float32:
                self.dev[id(p)]["master"].copy_(w)
            st["master"].copy_(w)
        self.note_weight_versions(params)

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

    # -- the host copy of GPU-resident blocks, loads ----------------------------------------------------

    def host_current(self) -> None:
        """GPU-resident blocks' states copied into their host state; borrowers give the donors' host
        buffers back for a step (they hold state again). Call with nothing in flight."""
        for r in set(self.lent.values()):
            self.reclaim(r)
        for b in self.rt.resident():
            for p in self.plan.blocks[b]:
                st, d = self.state[p], self.dev[id(p)]
                for key in _STATE_AND_MASTER:
                    if key in st:
                        st[key].copy_(d[key])

    def refresh_device_copies(self) -> None:
        for b in self.rt.resident():  # GPU-resident blocks: the device copies follow the host state
            for p in self.plan.blocks[b]:
                st, d = self.state[p], self.dev[id(p)]
                for key in _STATE_AND_MASTER:
                    if key in st:
                        d[key].copy_(st[key])

    def load_entries(self, entries, *, reset_missing, sharded=False):
        """Copies loaded state entries (parameter -> {key: tensor}, checked) into the host buffers;
        with ``reset_missing`` the parameters without an entry start afresh (step 0, zero moments,
        the master from the weights)."""
        plan = []
        for p in self.plan.params:
            mine = self.state[p]
            entry = entries.get(p)
            if entry is None:
                if reset_missing:
                    for key in ("step", *STATE_KEYS):
                        if key in mine:
                            plan.append((mine[key], None))
                    if "master" in mine:
                        plan.append((mine["master"], local(p).detach()))
                continue
            for key, val in entry.items():
                if key == "master" and key not in mine:
                    if p.dtype != torch.float32:
                        raise ValueError(f"parameter {self.plan.index(p)}: unexpected state 'master'")
                    dst = local(p)  # fp32 parameters updated in place are their own master
                elif key in mine:
                    dst = mine[key]
                else:
                    raise ValueError(f"parameter {self.plan.index(p)}: state {key!r} does not fit this "
                                     "optimizer (amsgrad differs?)")
                plan.append((dst, val))
        with torch.no_grad():
            for dst, src in plan:
                if src is None:
                    dst.zero_()
                else:
                    dst.copy_(local(src))
        self.refresh_device_copies()
        self.note_weight_versions(sharded=sharded)  # the loaded masters are what the next update starts from

    # -- placement: moves between host and GPU ----------------------------------------------------------

    def migrate(self, k):
        """Starts moving states so that blocks < k are GPU-resident. Nothing here waits: states go
        down on the migration stream after the compute stream's last update of them; states go up
        once the block's in-flight CPU update has finished (at its forward wait), and the compute
        stream waits for them only at the block's first GPU update."""
        up, down = self.rt.migrate(k)  # blocks with a pass in flight go up once it is waited for
        for b in up:
            self.to_gpu(b)
        for b in down:
            self._to_host(b)
        self.settings.gpu_blocks = k

    def to_gpu(self, b):
        for p in self.plan.blocks[b]:  # a resident block does not speculate; nothing reads its shadows now
            self._drop_shadow(p)
        self.lent.pop(b, None)  # a donor's state entries already name the spare set
        compute = torch.cuda.current_stream(self.device)
        states = []
        for p in self.plan.blocks[b]:
            st = self.state[p]
            d = {key: torch.empty(st[key].shape, dtype=torch.float32, device=self.device)
                 for key in STATE_KEYS if key in st}
            if p.dtype != torch.float32:
                d["master"] = torch.empty(local(p).shape, dtype=torch.float32, device=self.device)
            d["grad"] = torch.empty_like(local(p))
            states.append((p, st, d))
        # Fresh allocations may reuse memory that queued compute-stream work still reads.
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            for p, st, d in states:
                for key, t in d.items():
                    if key != "grad":
                        t.copy_(st[key], non_blocking=True)
                if p.dtype == torch.float32:
                    d["master"] = local(p)  # fp32 weights are their own master
                self.dev[id(p)] = d
        done = torch.cuda.Event()
        done.record(self._stream)
        self.moves[b] = done
        self.rt.moved_up(b)

    def _to_host(self, b):
        self.reclaim(b)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # after the block's last update
        with torch.cuda.stream(self._stream):
            for p in self.plan.blocks[b]:
                st, d = self.state[p], self.dev.pop(id(p))
                for key in _STATE_AND_MASTER:
                    if key in st:
                        st[key].copy_(d[key], non_blocking=True)
                        if key != "master" or p.dtype != torch.float32:
                            d[key].record_stream(self._stream)  # freed only after the copy
                d["grad"].record_stream(self._stream)
        self.drop_fused({id(p) for p in self.plan.blocks[b]})
        done = torch.cuda.Event()
        done.record(self._stream)
        self.moves[b] = done
        self.rt.moved_down(b)

    def migration_done(self, b, *, host):
        """Before block b's states are used: the host waits for a move down (normally long done);
        the compute stream waits for a move up."""
        ev = self.moves.pop(b, None)
        if ev is None:
            return
        if host:
            ev.synchronize()
        else:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def settle(self):
        """Completes every move (states waiting to go up go now)."""
        for b in self.rt.take_up():
            self.to_gpu(b)
        for b in list(self.moves):
            self.moves.pop(b).synchronize()

    def resident_bytes(self):
        rt = self.rt
        return sum(s for b, s in enumerate(self._state_bytes) if rt.on_gpu(b) or rt.moving_up_later(b))

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
        fused = CudaAdamW([d["master"] for d in ds], [d["exp_avg"] for d in ds], [d["exp_avg_sq"] for d in ds],
                          [d["grad"] for d in ds], weights=[local(p) for p in ps] if half else None,
                          amsgrad=amsgrad, max_exp_avg_sqs=[d["max_exp_avg_sq"] for d in ds] if amsgrad else None)
        self._fused[key] = fused
        return fused, True

    def drop_fused(self, ids):
        self._fused = {key: g for key, g in self._fused.items() if not any(i in ids for i, _ in key)}

    # -- speculation shadows ----------------------------------------------------------------------------

    def has_shadows(self, b) -> bool:
        return all(id(p) in self.shadow for p in self.plan.blocks[b])

    def _shadow_bytes(self, b) -> int:
        return sum(local(p).numel() * 4 * sum(1 for key in _STATE_AND_MASTER if key in self.state[p])
                   + (local(p).numel() * p.element_size() if p.dtype != torch.float32 else 0)
                   for p in self.plan.blocks[b] if id(p) not in self.shadow)

    def _set_shadow(self, p, sh):
        self.shadow[id(p)] = sh
        copy = sh.get("copy")
        self.table.set_shadow(self.plan.index(p), sh["master"].data_ptr(), sh["exp_avg"].data_ptr(),
                              sh["exp_avg_sq"].data_ptr(), _checks.address(sh.get("max_exp_avg_sq")),
                              copy.data_ptr() if copy is not None else 0)

    def _drop_shadow(self, p):
        if self.shadow.pop(id(p), None) is not None:
            self.table.clear_shadow(self.plan.index(p))

    def borrow(self, b, r):
        """Block b's shadows are donor r's idle host state (r is GPU-resident, of the same shapes)."""
        for p, q in zip(self.plan.blocks[b], self.plan.blocks[r]):
            st = self.state[q]
            sh = {key: st[key] for key in _STATE_AND_MASTER if key in st}
            if p.dtype != torch.float32:
                sh["copy"] = self.staging[id(q)][0]
            self._set_shadow(p, sh)
        self.lent[b] = r

    def allocate_shadows(self, b) -> bool:
        """Block b's own shadows from the pool; False (and none) where its capacity is reached."""
        try:
            for p in self.plan.blocks[b]:
                st = self.state[p]
                sh = {key: self.pool.empty(st[key].shape, torch.float32) for key in _STATE_AND_MASTER if key in st}
                if p.dtype != torch.float32:
                    sh["copy"] = self.pool.empty(local(p).shape, p.dtype)
                self._set_shadow(p, sh)
        except MemoryError:
            for p in self.plan.blocks[b]:
                self._drop_shadow(p)
            return False
        return True

    def reclaim(self, r):
        """Donor r is about to need its host state again (it moves down): its borrower stops
        speculating once its pass in flight (which may read or write that memory) is done."""
        for b in [b for b, d in self.lent.items() if d == r]:
            if self.rt.in_flight(b):
                self.wait([b])
            for p in self.plan.blocks[b]:
                self._drop_shadow(p)
            del self.lent[b]

    def shadow_plan(self, lowest_start):
        """From the last block down to ``lowest_start``: (block, donor or None) for each offloaded
        block that can have shadows, borrowed from a GPU-resident donor of the same shapes whose host
        state nothing reads, or allocated within the host limit and the pool's capacity; stops at the
        first that cannot (the native BlockRuntime.plan_shadows)."""
        rt, n = self.rt, len(self.plan)
        has = [self.has_shadows(b) for b in range(n)]
        taken = set(self.lent.values())
        ready = []
        for r in range(n):
            ev = self.moves.get(r)
            ready.append(rt.on_gpu(r) and r not in taken and (ev is None or ev.query()))
        need = [0 if has[b] else self._shadow_bytes(b) for b in range(n)]
        room = 0
        if not all(has[max(0, lowest_start):]):  # host headroom, read only if some block needs memory
            stats = self.pool.stats()
            free = stats["reserved"] - stats["in_use"]
            room = min(self.settings.host_memory_limit - _rss_bytes() + free, stats["capacity"] - stats["in_use"])
        plan = rt.plan_shadows(lowest_start, has, self._signatures, ready, need, room)
        return [(b, donor if donor >= 0 else None) for b, donor in plan]

    def adopt(self, b, handles) -> None:
        """Block b's speculative states become its state; the old ones its shadows (a donor's state
        entries follow the spare set)."""
        donor = self.lent.get(b)
        twin = {} if donor is None else {id(p): q for p, q in zip(self.plan.blocks[b], self.plan.blocks[donor])}
        for h in handles:
            p = self.plan.params[h]
            st, sh = self.state[p], self.shadow[id(p)]
            for key in _STATE_AND_MASTER:
                if key in st:
                    st[key], sh[key] = sh[key], st[key]
                    if donor is not None:
                        self.state[twin[id(p)]][key] = sh[key]
            self.table.adopt(h)
            if donor is not None:
                self._restate(twin[id(p)])
