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

from .. import _checks, quant8
from .._native import native
from ..cuda_adam import CudaAdamW
from ..pool import CapacityError, PinnedPool, available_memory_bytes, format_bytes, memory_total_bytes
from .common import MOMENTS, PARAM_DTYPES, STATE_KEYS, convert_moment, dense, is_sharded, like, local, span
from .writes import WeightWatch

_STATE_AND_MASTER = ("master", *STATE_KEYS)
_MORE_ROOM = ("leave the GPU more room (a smaller batch, activation checkpointing, a larger gpu_memory_limit), "
              "or use a host with more memory")


def undo_capacity(n) -> int:
    """The escape entries of a parameter's undo record (the native adamw.h's rule)."""
    return native().undo_capacity(n)


def _rss_bytes() -> int:
    """The process's resident memory (0 where /proc is not there to tell)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def host_margin(available) -> int:
    """The host memory kept free beside the pinned state, where ``available`` bytes are: 1 GiB, and
    5 % of that or a tenth of the memory the process may use in all, whichever is more. Pinned
    pages cannot be swapped: the kernel, the page cache of the libraries the process runs, its own
    growth and the pool's slack live in this margin, and a state that leaves less gets the process
    killed by the kernel's OOM killer rather than refused (a 20 B state planned to within 1 GiB and
    5 % of a 135 GB host was)."""
    return (1 << 30) + max(available // 20, memory_total_bytes() // 10)


def check_params(params) -> torch.device:
    """The one device of dense, contiguous fp32/bf16/fp16 parameters (the shards of sharded ones)."""
    if not params:
        raise ValueError("HybridAdamW got an empty parameter list")
    devices = set()
    for i, p in enumerate(params):
        p = local(p)
        if p.dtype not in PARAM_DTYPES:
            raise TypeError(f"parameter {i} (shape {tuple(p.shape)}) has dtype {p.dtype}; HybridAdamW supports "
                            "float32, bfloat16 and float16")
        if p.layout != torch.strided or not dense(p):
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}, strides {p.stride()}) must be dense: "
                             "contiguous, channels_last or another layout without gaps or overlaps")
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
    """``state``: the optimizer's state dict (parameter -> {key: tensor}), filled by :meth:`create`:
    pinned host tensors for the blocks the CPU updates, GPU tensors for GPU-resident blocks (the
    host holds nothing of those). ``wait``: waits for blocks' updates in flight (the launcher's)."""

    def __init__(self, plan, settings, rt, state, wait):
        self.plan, self.settings, self.rt, self.state, self.wait = plan, settings, rt, state, wait
        self.device = None
        self.cuda = False
        self.pool = None
        self.table = None
        self.bound = None  # id(p) -> (device, dtype, shape) the state was created for
        self.amsgrad_bound = None  # each group's amsgrad when the state was created
        self.staging = {}  # id(p) -> (gradient staging, weight staging or None); host-resident CUDA parameters
        self.dev = {}  # id(p) -> device master/exp_avg/exp_avg_sq/max_exp_avg_sq/grad (resident blocks)
        self.shadow = {}  # id(p) -> spare host master/exp_avg/exp_avg_sq[/max_exp_avg_sq]/copy
        # id(p) -> the tensors this store last put in state[p]: they stay alive whatever the loop does
        # to optimizer.state (the native table holds their addresses), and tell what it changed there.
        self._owned = {}
        self.moves = {}  # block -> CUDA event: its states' asynchronous move has completed
        self.floor = 0  # the host holds the states of blocks >= floor only: k never goes below it
        self.deferred = []  # GPU-resident blocks whose states the first step makes (create)
        self._leaving = {}  # block -> (event, host tensors) freed once its move to the GPU has read them
        self._fused = {}  # ((id, address) of each parameter) -> CudaAdamW
        self._groups_set = None  # the hyperparameters the table has
        self._versions = {}  # id(p) -> (address, version) of the weights after our last write
        self.watch = None  # WeightWatch: fingerprints of the weights after our last write
        self.loaded_masters = set()  # ids of parameters whose master was loaded since the last step
        self._stream = None
        self._state_bytes = plan.sizes()[2]

    # -- creation -------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """The parameters' device, checked, before the state is placed."""
        self.device = check_params(self.plan.params)
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
        self.pool = pool if pool is not None else PinnedPool(self._pool_bytes(), slab_bytes=self._slab_bytes())
        if self.cuda and not self.pool.page_locked:
            raise ValueError("CUDA parameters need a page-locked pool (PinnedPool(pinned=True or 'auto') "
                             "on a machine where pinning works)")
        self.table = native().ParamTable()  # each parameter's host buffers; handle = its index
        if self.pool.page_locked:  # page-locking is the slow part: every slab at once, in parallel
            self.pool.reserve_for([n for b in range(later, len(plan)) for n in self._tensor_bytes(b)])
        for p in plan.params:
            b = plan.block_of[id(p)]
            if k <= b < later and local(p).numel():
                self._register_on_gpu(p)
            else:
                self._init_state(p, on_gpu=b < later)
        self.deferred = list(range(k, later))
        if pool is None:
            self.pool.trim()  # slabs the reservation made and the state did not need
        up, _ = self.rt.migrate(later)  # nothing is in flight: the first blocks are resident now
        for b in up:
            self.rt.moved_up(b)
        self.settings.gpu_blocks = later
        if self.cuda:
            self._stream = torch.cuda.Stream(self.device, priority=0)
        watched = [[p for p in blk if not is_sharded(p) and local(p).numel()
                    and (p.dtype != torch.float32 or self.cuda)]  # (fp32 CPU weights are their own master)
                   for blk in plan.blocks]
        self.watch = WeightWatch(watched, self.device) if any(watched) and self.settings.watch_writes else None
        self.bound = {id(p): (w.device, w.dtype, w.shape) for p in plan.params for w in (local(p),)}
        self.amsgrad_bound = [bool(g["amsgrad"]) for g in param_groups]

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
                self.dev.pop(id(p), None)
                for key in self._keys(p):
                    self.state[p].pop(key, None)
                self._own(p)
            self.defer_to_host(b)
            return
        self.deferred.remove(b)
        self.note_weight_versions(self.plan.blocks[b])

    def defer_to_host(self, b=None) -> None:
        """The deferred blocks from b on (all of them by default) get their states on the host
        instead (k becomes b); those below the host's floor cannot, and are refused."""
        if not self.deferred:
            return
        b = self.deferred[0] if b is None else b
        blocks = [x for x in self.deferred if x >= b]
        if blocks[0] < self.floor:
            raise CapacityError(
                f"the GPU could not hold the optimizer state of block {blocks[0]} in the first step, once "
                f"the other blocks' gradients were released, and the host can hold those of blocks "
                f"{self.floor} and after only: {_MORE_ROOM}")
        per_block, room = self.block_host_bytes(), self._host_headroom()
        need = sum(per_block[x] for x in blocks)
        if room is not None and need > room:
            raise CapacityError(
                f"the GPU could not hold the optimizer state of block {b} in the first step, once the other "
                f"blocks' gradients were released, and the host has {format_bytes(room)} left for the "
                f"{format_bytes(need)} of blocks {b} to {blocks[-1]} beside its margin: {_MORE_ROOM}")
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
        self.note_weight_versions([p for x in down for p in self.plan.blocks[x]])
        self.settings.gpu_blocks = b

    def _table_to_host(self, p, host):
        """The parameter's table entry points at its host state (``state[p]``) and staging (``host``)."""
        st = self.state[p]
        self.table.to_host(self.plan.index(p), st.get("master", local(p)).data_ptr(), st["exp_avg"].data_ptr(),
                           st["exp_avg_sq"].data_ptr(), _checks.address(st.get("max_exp_avg_sq")),
                           _checks.address(host.get("grad")), _checks.address(host.get("copy")))

    def block_host_bytes(self) -> list[int]:
        """Per block, the pinned host bytes its state and staging take while the CPU updates it."""
        return [sum(self._tensor_bytes(b)) for b in range(len(self.plan))]

    def host_floor(self) -> int:
        """The smallest k for which the host can hold the states of blocks >= k (the rest live on
        the GPU), within the memory this process can still take (or the given pool's room). Without
        CUDA every state lives on the host: one that does not fit is refused here, before anything
        is allocated."""
        per_block = self.block_host_bytes()
        room = self.host_room()
        if room is None:
            self.floor = 0
            return 0
        k, rest = 0, sum(per_block)
        while k < len(per_block) and rest > room:
            rest -= per_block[k]
            k += 1
        if k and not self.cuda:
            raise CapacityError(
                f"the optimizer state of {self._count()} parameters needs {format_bytes(sum(per_block))} of pinned "
                f"host memory ({self._what()}), but {self._room_text(room)}: "
                + ("pass a pool with a larger capacity, or none (" if self.settings.pool is not None else "")
                + "use a host with more memory, shard the model over more processes (--nproc / FSDP2), or "
                "train a smaller model" + (")" if self.settings.pool is not None else ""))
        self.floor = k
        return k

    def host_room(self) -> int | None:
        """The bytes the state may take on the host: what this process can still take, less a
        margin (:func:`host_margin`), or the room left in a pool given by the caller; None where the
        system does not tell."""
        pool = self.settings.pool
        if pool is not None:
            stats = pool.stats()
            return max(0, stats["capacity"] - stats["in_use"])
        room = available_memory_bytes()
        if room is None:
            return None
        return max(0, room - host_margin(room))

    def _room_text(self, room) -> str:
        if self.settings.pool is not None:
            return f"the pool given has room for {format_bytes(room)}"
        available = available_memory_bytes() or 0
        return (f"the host memory available to this process is {format_bytes(available)}, "
                f"{format_bytes(room)} of it for the state ({format_bytes(host_margin(available))} is kept "
                "for the rest)")

    def gpu_refusal(self, k, free) -> CapacityError:
        """The error for a state whose first k blocks must live on the GPU, where ``free`` bytes are
        left for them: the bytes on each side."""
        per_block = self.block_host_bytes()
        on_gpu = sum(self._state_bytes[:k])
        room = self.host_room()
        return CapacityError(
            f"the optimizer state of {self._count()} parameters does not fit: it needs "
            f"{format_bytes(sum(per_block))} of pinned host memory ({self._what()} and staging) for all "
            f"{len(per_block)} blocks; {self._room_text(room or 0)}, so the first {k} blocks must "
            f"keep theirs on the GPU ({format_bytes(on_gpu)}), but {format_bytes(max(0, free))} of GPU memory is left "
            "beside the weights, gradients and activations: use a host with more memory or a larger "
            "GPU, shard the model over more processes (--nproc / FSDP2), or train a smaller model")

    def _what(self) -> str:
        fmt = self.settings.state_format
        return "fp32 master, m and v" + ("" if fmt == "fp32" else f" in {fmt}")

    def _state_code(self) -> int:
        return _checks.STATE_CODES[self.settings.state_dtype]

    def _count(self) -> str:
        n = sum(local(p).numel() for p in self.plan.params)
        return f"{n / 1e9:.2f} B" if n >= 10**9 else f"{n / 1e6:.2f} M" if n >= 10**6 else str(n)

    def clear(self) -> None:
        """Drops the state (a failed creation, or a rebuild): the entries of the parameters it is for
        leave ``optimizer.state`` (those of frozen parameters stay, as in torch)."""
        for p in self.plan.params:
            self.state.pop(p, None)
        self._owned = {}
        self.pool = self.table = self.bound = self.amsgrad_bound = None
        self.staging, self.dev, self.shadow, self.moves, self._fused, self._leaving = {}, {}, {}, {}, {}, {}
        self.deferred = []
        self._groups_set = None
        self._versions = {}
        self.watch = None
        self.loaded_masters = set()

    def _pool_bytes(self) -> int:
        """A capacity for the default pool: the host bytes of the blocks from the floor on, as many
        again for speculation shadows (a capacity only: shadows are allocated when used, within
        ``host_memory_limit``), and room for the slabs' fragmentation (memory is reserved slab by
        slab as it is used)."""
        host = sum(self.block_host_bytes()[self.floor:])
        if self.cuda and self.settings.speculate is not False:
            host *= 2
        return host * 3 // 2 + (256 << 20)

    def _slab_bytes(self) -> int:
        """The default pool's slab: the largest block's host bytes (2 MiB multiples), at least 256 MiB.
        A block's tensors then pack into one or two slabs, and a hole one leaves is taken by the
        next's smaller tensors; in 256 MiB slabs, 20 B's 200 MB moments and staging left a quarter
        of each slab unused (20 GB of 131 GB reserved)."""
        largest = max(self.block_host_bytes(), default=0)
        return max(256 << 20, -(-largest // (2 << 20)) * (2 << 20))

    def _tensor_bytes(self, b) -> list[int]:
        """The pool bytes of every tensor :meth:`_host_state` makes for block b's parameters (each
        rounded up to the pool's alignment)."""
        out = []
        for p in self.plan.blocks[b]:
            n = local(p).numel()
            if not n:
                continue
            sizes = [self.plan.moment_bytes(n)] * 2 + ([4 * n] if self.plan.amsgrad(p) else [])  # m, v, max v
            if p.dtype != torch.float32 or self.cuda:
                sizes.append(4 * n)  # master
            if self.cuda:
                sizes.append(p.element_size() * n)  # staging
            out += self._in_pool(sizes)
        return out

    def _dtype(self, key) -> torch.dtype:
        """m and v in the state format's dtype; the master (and amsgrad's max v) in fp32."""
        return self.settings.state_dtype if key in MOMENTS else torch.float32

    def _shape(self, w, key) -> tuple:
        """m and v shaped for the state format (8-bit: flat buffers); the rest like the weights."""
        return self.settings.moment_shape(w.shape) if key in MOMENTS else w.shape

    def _keys(self, p):
        """The state's tensors (with the fp32 master for every CUDA or low-precision parameter)."""
        keys = list(MOMENTS) + (["max_exp_avg_sq"] if self.plan.amsgrad(p) else [])
        if p.dtype != torch.float32 or self.cuda:
            keys.append("master")
        return keys

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
        st, w = self.state[p], local(p)
        d = {key: like(torch.zeros(self._shape(w, key), dtype=self._dtype(key), device=self.device), w)
             for key in self._keys(p) if key != "master"}
        # (an fp32 weight is its own master)
        d["master"] = w.detach().float() if p.dtype != torch.float32 else w.detach()
        d["grad"] = torch.empty_like(w)
        self.dev[id(p)] = d
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
            zeros, empty = self.pool.zeros, self.pool.empty
        else:
            def zeros(shape, dtype=torch.float32):
                return torch.zeros(shape, dtype=dtype)
            empty = zeros
        out = {}
        for key in self._keys(p):
            out[key] = like((zeros if fill and key != "master" else empty)(self._shape(w, key), self._dtype(key)), w)
        if fill and "master" in out:
            out["master"].copy_(w.detach())
        if self.cuda:
            buf = like(empty(w.shape, p.dtype), w)
            out["grad"] = buf
            if p.dtype != torch.float32:
                out["copy"] = buf
            self.staging[id(p)] = (buf, out.get("copy"))
        return out

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
        """The weights as the optimizer wrote them (see writes.py): their version counters -- our own
        updates write them without counting (copies and kernels on their memory), so a counter that
        moved later means the loop wrote the weights (``model.load_state_dict``, an in-place edit) --
        and their fingerprints, for writes that leave the counter alone (``p.data``). Not for FSDP2
        shards (``sharded``), whose storage FSDP2 manages itself."""
        if sharded:
            return
        params = self.plan.params if params is None else params
        for p in params:
            if "master" in self.state[p]:
                self._versions[id(p)] = (local(p).data_ptr(), local(p)._version)
        if self.watch is not None:
            self.watch.note(params)

    def written_weights(self, *, sharded=False) -> list:
        """The parameters whose weights the loop wrote since :meth:`note_weight_versions`, of the
        blocks whose weights no pass of the optimizer is writing now."""
        if sharded:
            return []
        out = []
        for p in self.plan.params:
            seen = self._versions.get(id(p))
            w = local(p)
            if seen is not None and seen != (w.data_ptr(), w._version):
                out.append(p)
        # Blocks whose weights a pass of the optimizer may be writing now are not compared: those in
        # flight, speculated ones included (their speculative weights are copied in during backward).
        rt, phases = self.rt, native().BlockPhase
        quiet = [b for b in range(len(self.plan)) if not rt.in_flight(b) or rt.phase(b) == phases.held]
        if self.loaded_masters:  # masters loaded since: checked against the weights
            seen = {id(p) for p in out}
            out += [p for b in quiet for p in self.plan.blocks[b] if id(p) in self.loaded_masters and id(p) not in seen]
        if self.watch is not None:
            seen = {id(p) for p in out}
            out += [p for p in self.watch.written(quiet) if id(p) not in seen]
        return out

    def refresh_masters(self, params) -> list:
        """The weights are what the next update starts from, as with torch's optimizers; the fp32
        master (on the host, or on the GPU for a resident block) only adds the precision below their
        rounding. So each element whose weight is not its master's rounding (written by the loop, or a
        master loaded that the weights do not match) takes the weight's value; the others keep their
        master. Returns the parameters whose master changed (nothing in flight may read them)."""
        changed = []
        with torch.no_grad():
            for p in params:
                m, w = self.state[p]["master"], local(p).detach()
                w = w.to(m.device, non_blocking=False) if w.device != m.device else w
                differs = w != m.to(w.dtype)  # (NaN weights always differ: the master becomes NaN)
                if bool(differs.any()):
                    m.copy_(torch.where(differs, w.to(m.dtype), m))
                    changed.append(p)
        self.loaded_masters.difference_update(id(p) for p in params)
        self.note_weight_versions(params)
        return changed

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

    # -- loads ---------------------------------------------------------------------------------------------

    def load_entries(self, entries, *, reset_missing, sharded=False, reset=()):
        """Copies loaded state entries (parameter -> {key: tensor}, checked) into the host buffers;
        with ``reset_missing`` the parameters without an entry start afresh (step 0, zero moments,
        the master from the weights), else those in ``reset``."""
        plan, mastered, fresh = [], [], []
        for p in self.plan.params:
            mine = self.state[p]
            entry = entries.get(p)
            if entry is None:
                if reset_missing or p in reset:
                    fresh.append(p)
                    for key in ("step", *STATE_KEYS):
                        if key in mine:
                            plan.append((mine[key], None, key, p))
                    if "master" in mine:
                        plan.append((mine["master"], local(p).detach(), "master", p))
                continue
            if "master" in entry:
                mastered.append(p)
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
                plan.append((dst, val, key, p))
        with torch.no_grad():
            for dst, src, key, p in plan:
                if src is None:
                    dst.zero_()
                elif key in MOMENTS:  # m and v in the buffer's format (8-bit or floating)
                    dst.copy_(convert_moment(local(src), key, dst.dtype, local(p)))
                else:
                    dst.copy_(local(src))
        # Masters made from the weights match them; loaded ones are checked against the weights at the
        # next step (refresh_masters). Entries without one (a torch checkpoint, a counter reset) leave
        # the weights' writes to be followed (Engine._follow_weight_writes).
        self.note_weight_versions([p for p in fresh if "master" in self.state[p]], sharded=sharded)
        if not sharded:
            self.loaded_masters.update(id(p) for p in mastered)

    # -- what the loop did to optimizer.state -----------------------------------------------------------

    def _own(self, p) -> None:
        self._owned[id(p)] = dict(self.state[p])

    def rebind(self, state) -> None:
        """``optimizer.state`` is another dict now (``opt.state = defaultdict(dict)``): it is the one
        read and written from here on; what it holds is reconciled by :meth:`changes`."""
        self.state = state

    def changes(self) -> tuple[dict, set]:
        """What the loop changed in ``optimizer.state`` since this store last wrote it, found by
        identity (no copy, no read of the values): (parameter -> {key: the tensor put there} for
        replaced tensors, the parameters whose entry was removed or emptied). A key deleted from an
        entry that is otherwise there is refused, as torch's AdamW would fail on it too."""
        replaced, removed = {}, set()
        for p in self.plan.params:
            mine = self._owned.get(id(p))
            if not mine:
                continue  # no state here (an empty shard, or not made yet)
            cur = self.state.get(p)
            if cur is None or (isinstance(cur, dict) and not cur):
                removed.add(p)
                continue
            if cur is not mine and not isinstance(cur, dict):
                raise TypeError(f"optimizer.state[p] of parameter {self.plan.index(p)} is a "
                                f"{type(cur).__name__}, not a dict")
            diff = {}
            for key, t in mine.items():
                got = cur.get(key)
                if got is t:
                    continue
                if got is None:
                    raise KeyError(f"optimizer.state[p] of parameter {self.plan.index(p)} lost {key!r}; remove "
                                   "the whole entry (del optimizer.state[p]) to start that parameter afresh")
                diff[key] = got
            if diff:
                replaced[p] = diff
        return replaced, removed

    def checked_entries(self, entries: dict, *, like=None) -> dict:
        """Entries the loop put in ``optimizer.state`` (parameter -> {key: value}), checked as a load
        checks them -- a key of this optimizer's state, as many elements as the parameter, floating
        point (the counter: one value) -- and shaped for :meth:`load_entries`. ``like``: parameter ->
        the buffers they replace (their shapes), else the parameter's."""
        out = {}
        for p, entry in entries.items():
            want, i = local(p).numel(), self.plan.index(p)
            checked = {}
            for key, got in entry.items():
                if key not in ("step", "master", *STATE_KEYS):
                    raise ValueError(f"optimizer.state[p] of parameter {i} has {key!r}, which is not a state of "
                                     "AdamW (step, exp_avg, exp_avg_sq, max_exp_avg_sq, master)")
                got = torch.as_tensor(got)
                n = local(got).numel() if hasattr(got, "to_local") else got.numel()
                codes = key in MOMENTS and got.dtype == torch.uint8  # an 8-bit buffer (quant8)
                need = 1 if key == "step" else quant8.state_bytes(want) if codes else want
                if n != need:
                    raise ValueError(f"optimizer.state[p][{key!r}] of parameter {i} was replaced by a tensor of "
                                     f"{n} elements (shape {tuple(got.shape)}); it needs {need}")
                if not (got.is_floating_point() or key == "step" or codes):
                    raise TypeError(f"optimizer.state[p][{key!r}] of parameter {i} was replaced by a "
                                    f"{got.dtype} tensor; it needs a floating-point one")
                checked[key] = got.reshape(()) if key == "step" else got
            out[p] = checked
        return out

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

    # -- placement: moves between host and GPU ----------------------------------------------------------

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
            self._drop_shadow(p)
        compute = torch.cuda.current_stream(self.device)
        moving = []
        for p in self.plan.blocks[b]:
            st = self.state[p]
            d = {key: torch.empty_like(st[key], device=self.device)
                 for key in self._keys(p) if key != "master" or p.dtype != torch.float32}
            d["grad"] = torch.empty_like(local(p))
            moving.append((p, st, d))
        # Fresh allocations may reuse memory that queued compute-stream work still reads.
        self._stream.wait_stream(compute)
        leaving = []
        with torch.cuda.stream(self._stream):
            for p, st, d in moving:
                for key, t in d.items():
                    if key != "grad":
                        t.copy_(st[key], non_blocking=True)
                if p.dtype == torch.float32:
                    d["master"] = local(p).detach()  # fp32 weights are their own master (the last update wrote them)
                leaving += [st[key] for key in self._keys(p)]
                leaving += [t for t in self.staging.pop(id(p), ()) if t is not None]
                for key in self._keys(p):
                    st[key] = d[key]
                self._own(p)
                self.dev[id(p)] = d
                self.table.to_device(self.plan.index(p))
        done = torch.cuda.Event()
        done.record(self._stream)
        compute.wait_event(done)  # any later read of the state on the GPU follows the copy
        self._leaving[b] = (done, leaving)
        self.rt.moved_up(b)

    def _to_host(self, b):
        compute = torch.cuda.current_stream(self.device)
        hosts = [(p, self._host_state(p, fill=False)) for p in self.plan.blocks[b]]
        self._stream.wait_stream(compute)  # after the block's last update
        with torch.cuda.stream(self._stream):
            for p, host in hosts:
                st, d = self.state[p], self.dev.pop(id(p))
                for key in self._keys(p):
                    host[key].copy_(d[key], non_blocking=True)
                    if key != "master" or p.dtype != torch.float32:
                        d[key].record_stream(self._stream)  # freed only after the copy
                    st[key] = host[key]
                self._own(p)
                d["grad"].record_stream(self._stream)
                self._table_to_host(p, host)
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
        self._free_left()

    def settle(self):
        """Completes every move (states waiting to go up go now)."""
        for b in self.rt.take_up():
            self.to_gpu(b)
        for b in list(self.moves):
            self.moves.pop(b).synchronize()
        self._free_left(wait=True)

    def _free_left(self, wait=False):
        """The host memory of states that moved to the GPU, once their copies have read it: back to
        the pool, and the pool's wholly free slabs back to the system (a pool of our own)."""
        freed = False
        for b, (ev, _) in list(self._leaving.items()):
            if wait:
                ev.synchronize()
            if wait or ev.query():
                del self._leaving[b]
                freed = True
        if freed:
            self.trimmed()

    def host_fit(self, k) -> int:
        """k, or more where the states that k would bring back to the host do not fit there beside
        the margin (:func:`host_margin`), within the pool's capacity: those blocks stay on the GPU.
        The speculation shadows give way first (they are optional; speculation allocates them again
        within what is left)."""
        per_block = self.block_host_bytes()
        coming = [b for b in range(k, len(per_block)) if self.rt.on_gpu(b) or self.rt.moving_up_later(b)]
        need = sum(per_block[b] for b in coming)
        if not need:
            return k
        room = self._host_headroom()
        if room is not None and need > room and self.shadow:
            holding = [b for b in range(len(self.plan)) if any(id(p) in self.shadow for p in self.plan.blocks[b])]
            self.wait([b for b in holding if self.rt.in_flight(b)])  # their passes may read or write the shadows
            for b in holding:
                for p in self.plan.blocks[b]:
                    self._drop_shadow(p)
            self.trimmed()
            room = self._host_headroom()
        for b in coming:  # the lowest blocks stay up first: k rises past them
            if room is None or need <= room:
                break
            need -= per_block[b]
            k = b + 1
        return k

    def _host_headroom(self):
        """Bytes the host can still give the pool for states (the pool's free blocks included),
        beside the margin and within the pool's capacity; None where the system does not tell."""
        stats = self.pool.stats()
        room = available_memory_bytes()
        if room is None:
            return None
        room = room - host_margin(room) + stats["reserved"] - stats["in_use"]
        return max(0, min(room, stats["capacity"] - stats["in_use"]))

    def moving(self) -> list:
        return sorted(set(self.moves) | set(self._leaving))

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
        fused = CudaAdamW([span(d["master"]) for d in ds], [span(d["exp_avg"]) for d in ds],
                          [span(d["exp_avg_sq"]) for d in ds], [span(d["grad"]) for d in ds],
                          weights=[span(local(p)) for p in ps] if half else None, amsgrad=amsgrad,
                          max_exp_avg_sqs=[span(d["max_exp_avg_sq"]) for d in ds] if amsgrad else None,
                          seeds=[self.plan.index(p) for p in ps])  # the table's seeds: the handles
        self._fused[key] = fused
        return fused, True

    def drop_fused(self, ids):
        self._fused = {key: g for key, g in self._fused.items() if not any(i in ids for i, _ in key)}

    # -- speculation shadows ----------------------------------------------------------------------------

    def shadow_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for sh in self.shadow.values() for t in sh.values())

    def has_shadows(self, b) -> bool:
        return all(id(p) in self.shadow for p in self.plan.blocks[b])

    def _shadow_bytes(self, b) -> int:
        return 0 if self.has_shadows(b) else sum(self._shadow_tensor_bytes(b))

    def _records(self, p) -> bool:
        """Whether parameter p speculates with an undo record (fp32 states without amsgrad; see the
        native adamw.h) rather than a copy of its state."""
        n = local(p).numel()
        return (self.settings.state_dtype == torch.float32 and not self.plan.amsgrad(p) and 0 < n < 2 ** 32)

    def _shadow_tensor_bytes(self, b) -> list[int]:
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
                sizes = [st[key].numel() * st[key].element_size() for key in _STATE_AND_MASTER if key in st]
                if p.dtype != torch.float32:
                    sizes.append(p.element_size() * n)
            out += self._in_pool(sizes)
        return out

    def _in_pool(self, sizes) -> list[int]:
        """Each size rounded up to the pool's alignment."""
        pool = self.settings.pool
        align = pool.alignment if pool is not None else 256
        return [-(-size // align) * align for size in sizes]

    def _set_shadow(self, p, sh):
        self.shadow[id(p)] = sh
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

    def _drop_shadow(self, p):
        if self.shadow.pop(id(p), None) is not None:
            self.table.clear_shadow(self.plan.index(p))

    def reserve_shadows(self, blocks) -> None:
        """Page-locks, on many threads at once, the memory these blocks' shadows are about to take
        beyond what the pool's free blocks already hold (slabs of the pool's size, into which the
        shadows are carved); :meth:`trimmed` gives back what they leave."""
        if not blocks or not self.pool.page_locked:
            return
        stats = self.pool.stats()
        short = sum(n for b in blocks for n in self._shadow_tensor_bytes(b)) - (stats["reserved"] - stats["in_use"])
        if short > 0:
            slab = self.pool.slab_bytes
            self.pool.reserve_for([slab] * -(-short // slab))

    def trimmed(self) -> None:
        """A pool of our own gives its wholly free slabs back to the system."""
        if self.settings.pool is None:
            self.pool.trim()

    def allocate_shadows(self, b) -> bool:
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
                          for key in _STATE_AND_MASTER if key in st}
                if p.dtype != torch.float32:
                    sh["copy"] = like(self.pool.empty(local(p).shape, p.dtype), local(p))
                self._set_shadow(p, sh)
        except MemoryError:
            for p in self.plan.blocks[b]:
                self._drop_shadow(p)
            return False
        return True

    def shadow_plan(self, lowest_start):
        """From the last block down to ``lowest_start``: each offloaded block that has, or can get,
        shadows within the host headroom (what ``host_memory_limit`` and the pool leave); stops at
        the first that cannot (the native BlockRuntime.plan_shadows). States coming back to the
        host take precedence: a move down drops the shadows where it needs their memory."""
        rt, n = self.rt, len(self.plan)
        has = [self.has_shadows(b) for b in range(n)]
        need = [0 if has[b] else self._shadow_bytes(b) for b in range(n)]
        room = 0
        # Host headroom, read only if some block needs memory, and only once the host memory of
        # states that went to the GPU has been given back (their copies may still read it).
        self._free_left()
        if not all(has[max(0, lowest_start):]) and not self._leaving:
            stats = self.pool.stats()
            free = stats["reserved"] - stats["in_use"]
            room = min(self.settings.host_memory_limit - _rss_bytes() + free, stats["capacity"] - stats["in_use"])
        return rt.plan_shadows(lowest_start, has, need, max(0, room))

    def adopt(self, b, handles) -> bool:
        """Block b's speculative states become its state; the old ones its shadows. Returns whether
        some of them were updated in place with undo records: those are the state already, and their
        records are let go once the pass is known complete (Launcher.adopt_later)."""
        records = False
        for h in handles:
            p = self.plan.params[h]
            st, sh = self.state[p], self.shadow[id(p)]
            if "codes" in sh:
                records = True
                continue
            for key in _STATE_AND_MASTER:
                if key in st:
                    st[key], sh[key] = sh[key], st[key]
            self._own(p)
            self.table.adopt(h)
        return records
