"""Binding: the state is created at the first ``step()`` for the device and dtype the parameters have
then -- the pinned pool, each parameter's fp32 master, m and v (and staging for CUDA parameters), each
registered once in the native ``ParamTable``, the native engine and pipeline, forward hooks and the
scheduler. On failure nothing is left half made. A move after that is refused (``_check_bound``)."""

from __future__ import annotations

import collections

import torch

from .._native import native
from ..cpu_adam import simd_paths
from ..meter import Meter
from ..pool import PinnedPool
from ..trace import Timeline
from .. import _checks
from . import distributed
from .common import PARAM_DTYPES, STATE_KEYS, local


class HostState:
    """The host side of a HybridAdamW: state creation, the parameter table, checks on parameters."""

    def _bind(self):
        """Creates host state, pools, staging, the native engine and the device side for the device
        and dtype the parameters have now. On failure nothing is left half made."""
        try:
            self._create_state()
        except BaseException:
            for h in self._model_hooks:
                h.remove()
            self._model_hooks = []
            self.state.clear()
            self._engine = self._pipeline = self._scheduler = self._meter = self.timeline = self._pool = None
            self._table = None
            self._rt = native().BlockRuntime([len(b) for b in self._blocks], self.accumulation_steps)
            raise
        self._bound = {id(p): (w.device, w.dtype, w.shape) for p in self._params for w in (local(p),)}
        self._amsgrad_bound = [bool(g["amsgrad"]) for g in self.param_groups]
        self._note_weight_versions()
        if self._pending_state:
            pending, self._pending_state = self._pending_state, None
            try:
                self._load_entries(pending, reset_missing=False)
            except BaseException:
                self._pending_state = pending
                raise

    def _create_state(self):
        self.device = self._check_params(self._params)
        self._cuda = self.device.type == "cuda"
        if self.gpu_blocks and not self._cuda:
            raise ValueError("gpu_blocks > 0 needs CUDA parameters (these are on the CPU)")
        pool = self._settings["pool"]
        self._pool = pool if pool is not None else PinnedPool(self._pool_bytes(self._params), slab_bytes="256MiB")
        if self._cuda and not self._pool.page_locked:
            raise ValueError("CUDA parameters need a page-locked pool (PinnedPool(pinned=True or 'auto') "
                             "on a machine where pinning works)")
        self._staging = {}  # id(p) -> (gradient staging, weight staging or None); CUDA parameters
        self._table = native().ParamTable()  # each parameter's host buffers; handle = its index
        self._groups_set = None  # the hyperparameters the table has (set_groups when they change)
        for p in self._params:
            self._init_state(p)
        self._engine = native().UpdateEngine(self._settings["workers"], self._settings["slice_elements"],
                                             simd_paths()["selected"])
        self._pipeline = None
        if self._cuda:
            # The weight copies gate the next forward: give them the higher priority.
            self._pipeline = native().OffloadPipeline(self._engine, self.device.index, 0, -1)
        self._loss_scaling = any(p.dtype == torch.float16 for p in self._params)
        # Python objects the native runtime cannot hold: storage kept alive while passes are in flight,
        # gradients until their copies land, shadow tensors, device states, CUDA events.
        self._alive = {}  # block -> what the workers read (CPU path) / the weights written (pipeline)
        self._landing = collections.deque()  # (D2H ticket, gradients it reads) until the copy lands
        self._shadow = {}  # id(p) -> spare host master/exp_avg/exp_avg_sq[/max_exp_avg_sq]/copy
        self._lent = {}  # block -> the GPU-resident block whose idle host state and staging are its shadows
        signatures = {}  # blocks that can lend each other host state have equal signatures
        self._signatures = [signatures.setdefault(
            tuple((tuple(local(p).shape), p.dtype, "max_exp_avg_sq" in self.state[p]) for p in blk),
            len(signatures))
            for blk in self._blocks]
        self._last_clipped = True  # whether the last step's multiplier differed from 1 (or none yet)
        self._dev_state = {}  # id(p) -> device master/exp_avg/exp_avg_sq/max_exp_avg_sq/grad
        self._gpu_groups = {}  # ((id, address) of each parameter) -> CudaAdamW
        self.timeline = Timeline(self.device if self._cuda else None) if self._settings["trace"] else None
        if self.timeline is not None:
            self.timeline.pipeline = self._pipeline
        self._pass_owner = {}
        self._mig_stream = None
        self._mig_events = {}  # block -> CUDA event: its states' asynchronous move has completed
        self._meter_owner = {}
        if self._cuda:
            self._mig_stream = torch.cuda.Stream(self.device, priority=0)
            self._migrate(self.gpu_blocks)
            self._settle_migrations()
        model = self._settings["model"]
        if model is not None:
            self._install_forward_hooks(model)
        if self._cuda and self._layer_hooks:
            # Iterations are numbered from the first, which ran before the state existed.
            self._meter = Meter(self.device, self._pipeline, len(self._blocks), first_index=1)
        self._agree_group = None  # sharded with k chosen each step: the ranks agree on k (_schedule)
        if self._cuda and self._layer_hooks and self.accumulation_steps == 1:
            # Fixed k too: its predictions are what a run is checked against.
            self._start_scheduler(self._gpu_memory_request)
            if self._shard_group is not None and self.auto:
                self._agree_group = distributed.host_group(self._shard_group)

    def _note_weight_versions(self, params=None):
        """The weights' version counters as of now: our own updates write them without counting
        (copies and kernels on their memory), so a counter that moved later means the loop wrote the
        weights (``model.load_state_dict``, an in-place edit)."""
        if self._shard_group is not None:
            return  # FSDP2 manages the shards' storage itself: not followed
        for p in (self._params if params is None else params):
            if "master" in self.state[p]:
                self._weight_versions[id(p)] = (local(p).data_ptr(), local(p)._version)

    def _follow_weight_writes(self) -> set:
        """Weights the loop wrote since the last step (a rollback with ``model.load_state_dict``)
        are what the next update starts from, as with torch's optimizers: each such parameter's fp32
        master (host, and on the GPU for a resident block) is refreshed from its weights. Returns the
        blocks whose speculative pass read the old master (redone in step())."""
        out = set()
        if self._shard_group is not None:
            return out
        written = []
        for p in self._params:
            seen = self._weight_versions.get(id(p))
            w = local(p)
            if seen is not None and seen != (w.data_ptr(), w._version):
                written.append(p)
        if not written:
            return out
        speculated = set(self._rt.in_phase(native().BlockPhase.speculated))
        self.synchronize()  # nothing in flight reads the masters being refreshed
        for p in written:
            w, st = local(p).detach(), self.state[p]
            b = self._block_of[id(p)]
            if self._rt.on_gpu(b) and p.dtype != torch.float32:
                self._dev_state[id(p)]["master"].copy_(w)
            st["master"].copy_(w)
            if b in speculated:
                out.add(b)
        self._note_weight_versions(written)
        return out

    def _check_bound(self, p):
        """Refuses a parameter that changed device, dtype or shape after its state was created."""
        device, dtype, shape = self._bound[id(p)]
        w = local(p)
        if w.device != device or w.dtype != dtype or w.shape != shape:
            raise RuntimeError(
                f"parameter {self._index_of[id(p)]} is now {str(w.dtype).replace('torch.', '')} of shape "
                f"{tuple(w.shape)} on {w.device}, but HybridAdamW created its state at the first step for "
                f"{str(dtype).replace('torch.', '')} of shape {tuple(shape)} on {device}. Moving or casting "
                "parameters after the first step is not supported: move the model before the first step, "
                "or save optimizer.state_dict(), move the model back, and load that state into a new "
                "HybridAdamW built after the move")

    @staticmethod
    def _check_params(params) -> torch.device:
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

    def _pool_bytes(self, params) -> int:
        """A capacity for the default pool: the state and staging bytes, plus room for the slabs'
        fragmentation (the capacity is a limit; memory is reserved slab by slab as it is used)."""
        total = 0
        for p in params:
            per = 8 + (4 if self._group_of[id(p)]["amsgrad"] else 0)
            if p.dtype != torch.float32 or self._cuda:
                per += 4  # master
            if self._cuda:
                per += p.element_size()  # staging: the gradient lands there, the new weights replace it
                if self.speculate is not False:  # a capacity only: shadows are allocated when used
                    per += per - (4 if p.dtype == torch.float32 else 0)
            total += local(p).numel() * per + 6 * 256
        return total * 3 // 2 + (256 << 20)

    def _init_state(self, p):
        """The parameter's host state, shaped like its local shard when it is sharded (FSDP2): each
        rank holds the master, m and v of its own shard only. A shard that is empty on this rank gets
        empty state (nothing to update)."""
        st = self.state[p]
        w = local(p)
        if w.numel():
            zeros, empty = self._pool.zeros, self._pool.empty
        else:
            def zeros(shape, dtype=torch.float32):
                return torch.zeros(shape, dtype=dtype)
            empty = zeros
        st["step"] = torch.zeros((), dtype=torch.float32)
        st["exp_avg"] = zeros(w.shape, torch.float32)
        st["exp_avg_sq"] = zeros(w.shape, torch.float32)
        if self._group_of[id(p)]["amsgrad"]:
            st["max_exp_avg_sq"] = zeros(w.shape, torch.float32)
        if p.dtype != torch.float32 or self._cuda:
            st["master"] = empty(w.shape, torch.float32)
            st["master"].copy_(w.detach())
        if self._cuda:
            # One staging buffer: the gradient is copied in, the CPU update reads each element's
            # gradient before writing its new bf16/fp16 weight over it, and the H2D copy sends it back.
            buf = empty(w.shape, p.dtype)
            self._staging[id(p)] = (buf, buf if p.dtype != torch.float32 else None)
        self._register(p)

    def _register(self, p):
        """Registers the parameter's host buffers in the native table (its handle is its index)."""
        st = self.state[p]
        w = local(p)
        staging = self._staging.get(id(p))
        half = p.dtype != torch.float32
        handle = self._table.add(
            master=st.get("master", w).data_ptr(), exp_avg=st["exp_avg"].data_ptr(),
            exp_avg_sq=st["exp_avg_sq"].data_ptr(), max_exp_avg_sq=_checks.address(st.get("max_exp_avg_sq")),
            step=st["step"].data_ptr(), grad=staging[0].data_ptr() if staging else 0,
            dtype=_checks.DTYPE_CODES[p.dtype], copy=staging[1].data_ptr() if staging and half else 0,
            numel=w.numel(), group=self._group_index[id(p)], amsgrad="max_exp_avg_sq" in st)
        assert handle == self._index_of[id(p)]

    def _restate(self, p):
        """The parameter's state entries name other buffers now (adopted shadows, a donor's spare set)."""
        st = self.state[p]
        self._table.set_state(self._index_of[id(p)], st.get("master", local(p)).data_ptr(), st["exp_avg"].data_ptr(),
                              st["exp_avg_sq"].data_ptr(), _checks.address(st.get("max_exp_avg_sq")))

    def _group_values(self):
        return tuple((float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]),
                      float(g["weight_decay"]), bool(g.get("maximize", False))) for g in self.param_groups)

    def _sync_groups(self) -> bool:
        """Gives the table the param groups' hyperparameters when they changed (an LR schedule).
        Returns whether the table had other values before (passes built since were built with
        those: in step(), an lr set between backward and step())."""
        now = self._group_values()
        if now == self._groups_set:
            return False
        stale = self._groups_set is not None
        self._table.set_groups([native().GroupHyper(*v) for v in now])
        self._groups_set = now
        return stale

    def _sync_host(self, b):
        """Copies a GPU-resident block's master weights and states into its host state."""
        for p in self._blocks[b]:
            st, d = self.state[p], self._dev_state[id(p)]
            for key in (*STATE_KEYS, "master"):
                if key in st:
                    st[key].copy_(d[key])
