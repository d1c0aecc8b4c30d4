"""HybridAdamW: a drop-in ``torch.optim.AdamW`` whose fp32 master weights and Adam states live in
pinned host memory and are updated by hytrain's native CPU workers, overlapping backward and the next
forward; the first ``gpu_blocks`` blocks may instead be updated on the GPU by the fused CUDA AdamW.

How a step runs:

* Parameters are grouped into *blocks*: the modules of the model's largest ``nn.ModuleList`` of repeated
  blocks, with the remaining parameters forming a head block (before them) and a tail block (after);
  or explicit ``blocks``; or, without a model, buckets of about ``bucket_elements`` in parameter order.
* A post-accumulate-grad hook counts each block's gradients. When a block's last gradient of the
  step's last micro-batch (``accumulation_steps``) has arrived, the block is launched while backward
  continues with earlier blocks: CPU parameters go to the native :class:`UpdateEngine`; CUDA
  parameters go through the native ``OffloadPipeline`` (gradients copied to pinned memory on a D2H
  stream, CPU update, new weights copied back on an H2D stream), or, for the first k blocks, are
  updated on the GPU with their states resident there.
* ``step()`` launches whatever is left, then waits (without a model), or returns at once with a model:
  forward hooks wait for each block's update just before it is used, so the updates also overlap the
  next forward.

Exact AdamW semantics (see ``docs/architecture.md``): gradient clipping (``max_grad_norm``) and loss
scaling (``torch.amp.GradScaler``) need every gradient before any update. In those modes the updates
are *deferred*: they start in ``step()`` once the global norm / overflow flag is known, and overlap the
next forward instead of backward. The first step is always deferred, because only ``step()`` reveals
whether a GradScaler drives the optimizer; fp16 parameters are assumed to be loss-scaled from the start.

Clipping on CUDA may still update offloaded blocks during backward, *speculatively* (``speculate``):
the CPU writes the new state beside the current one, as if the multiplier were 1. If the global norm
then needs no clipping, step() adopts the new state, which is bit for bit what the deferred update
would have written; if it does, the speculative result is dropped and the block is updated again from
its untouched state with the clip multiplier. After a step that clipped, the next one does not
speculate (clipping comes in runs, early in training).

The loop's own clipping (``torch.nn.utils.clip_grad_norm_`` between backward and step, as transformers'
Trainer, accelerate and Lightning do it) is exact: unless the optimizer clips itself (``max_grad_norm``)
or is told that nothing reads the gradients after backward (``release_grads=True``), ``.grad`` is kept
until ``step()``, and blocks whose gradients were changed after their hand-off are updated again from
the changed ones. Then, and with ``max_grad_norm``, the updates are deferred as above. The fast path
is ``max_grad_norm`` or :meth:`HybridAdamW.clip_grad_norm_` (what :mod:`hytrain.integrations` route the
loops' clipping to): the clip factor is applied inside the update, so the overlap is kept. With
``release_grads=True`` and no clipping, the ``.grad`` of CUDA parameters is released as soon as it has
been handed off (gradient memory returns during backward) and blocks are updated during backward.

The optimizer binds lazily, as torch's do: the state is created at the first ``step()`` for the
device and dtype the parameters have then, so the model may be moved or cast after the optimizer is
built. A move after the first step is refused with a RuntimeError (see ``docs/architecture.md``).
"""

from __future__ import annotations

import collections
import functools
import math
import os
import weakref

import torch
from torch import nn

from . import _checks
from .blocks import detect_blocks, repeated_layers
from ._native import native
from .cpu_adam import simd_paths
from .cuda_adam import CudaAdamW
from .pool import PinnedPool, physical_memory_bytes
from .meter import Meter
from .trace import Timeline

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _rss_bytes() -> int:
    """The process's resident memory (0 where /proc is not there to tell)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _check_param_list(params) -> None:
    """What no later move or cast can change: tensors, leaves, each once, floating point."""
    if not params:
        raise ValueError("HybridAdamW got an empty parameter list")
    seen = set()
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {i} is a {type(p).__name__}, not a tensor")
        if id(p) in seen:
            raise ValueError(f"parameter {i} appears more than once")
        seen.add(id(p))
        if not p.is_leaf:
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is not a leaf tensor; "
                             "optimize the leaf (e.g. the nn.Parameter), not a result of an operation")
        if not p.is_floating_point():
            raise TypeError(f"parameter {i} has dtype {p.dtype}; HybridAdamW supports float32, bfloat16 "
                            "and float16")


def _grad_hook(ref, p):
    opt = ref()
    if opt is not None:
        opt._on_grad(p)


class HybridAdamW(torch.optim.Optimizer):
    """AdamW with host-resident fp32 master weights and states, updated by native CPU workers.

    Args:
        params: parameters (fp32, bf16 or fp16, leaves, all on the CPU or all on one CUDA device) or
            param-group dicts.
        lr, betas, eps, weight_decay, amsgrad: as ``torch.optim.AdamW``.
        max_grad_norm: global-norm clipping of the (unscaled) gradients, as ``clip_grad_norm_``;
            each step's norm before clipping is then in ``last_grad_norm``.
        model: the module the parameters belong to; enables block detection and just-in-time waits.
        blocks: explicit blocks, each a module or a list of parameters (forward order).
        gpu_blocks: k, the number of leading blocks (forward order) updated on the GPU by the fused
            CUDA AdamW with their states resident there (CUDA parameters only; see
            :meth:`set_gpu_blocks`), or ``"auto"`` (the default): the native ``KSplitScheduler``
            chooses k every ``schedule_every`` steps from costs measured on the compute stream, within
            the GPU memory left for resident states, and the states migrate asynchronously. Auto needs
            ``model`` (its forward hooks measure the forward) and ``accumulation_steps=1``; otherwise,
            and on the CPU, it keeps k = 0.
        gpu_memory_limit: bytes of GPU memory the process may use (default: the device's memory, or
            its per-process fraction when set); the scheduler's budget for resident states is this
            less the largest non-state use seen, less a margin.
        schedule_every: how often (in steps) the scheduler may change k.
        speculate: offloaded blocks updated during backward under clipping (see the module notes):
            ``"auto"`` (the default; the scheduler picks from which block on, where it shortens the
            iteration), an int s (blocks >= s, whenever the previous step did not clip; True: 0),
            or False. Each speculated parameter needs a second fp32 master, m and v (and staging for
            its new weights) in pinned memory: borrowed from a GPU-resident block of the same shapes
            where there is one (its host copy is idle), else allocated within ``host_memory_limit``.
        host_memory_limit: bytes of host memory the process may use before speculation stops
            allocating (default: 75 % of the machine's memory, which leaves room for the rest of
            the process, page cache and the system).
        accumulation_steps: micro-batches per step; blocks are updated after the last one.
        workers: CPU update threads (default: the usable cores less one, for the training thread).
        pool: a :class:`hytrain.PinnedPool` for master weights, states and staging (default: a new one).
        overlap: False updates everything inside ``step()`` and waits for it there (what overlap
            buys, for benchmarks).
        trace: record a timeline of recent iterations (:meth:`export_trace`).
        release_grads: whether ``.grad`` may be released once a block's gradients are handed off
            during backward. Default: True with ``max_grad_norm`` (the optimizer clips), else False
            (the loop may clip or rescale them before ``step()``; see the module notes). True
            without ``max_grad_norm`` promises that nothing reads or changes the gradients after
            backward, and updates blocks while backward goes on.
    """

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale/found_inf instead of unscaling

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 amsgrad=False, max_grad_norm=None, model=None, blocks=None, gpu_blocks="auto",
                 accumulation_steps=1, workers=None, pool=None, overlap=True,
                 bucket_elements=4 << 20, slice_elements=1 << 18, trace=False,
                 gpu_memory_limit=None, schedule_every=1, speculate="auto", host_memory_limit=None,
                 release_grads=None):
        _checks.adamw_hparams(step=1, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, grad_scale=1.0)
        if max_grad_norm is not None:
            max_grad_norm = _checks.real("max_grad_norm", max_grad_norm, lo=0.0, lo_open=True)
        self.max_grad_norm = max_grad_norm
        if release_grads is None:
            release_grads = max_grad_norm is not None
        if not isinstance(release_grads, bool):
            raise TypeError(f"release_grads must be True, False or None, got {release_grads!r}")
        if max_grad_norm is not None and not release_grads:
            raise ValueError("release_grads=False is for clipping outside the optimizer; with max_grad_norm "
                             "the optimizer clips itself and releases the gradients during backward")
        self.release_grads = release_grads
        self.accumulation_steps = _checks.integer("accumulation_steps", accumulation_steps, lo=1)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=bool(amsgrad))
        super().__init__(params, defaults)
        self._params = [p for g in self.param_groups for p in g["params"]]
        _check_param_list(self._params)
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        self._group_index = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._blocks = self._make_blocks(self._params, model, blocks, bucket_elements)
        self._block_of = {}
        for i, b in enumerate(self._blocks):
            for p in b:
                if id(p) in self._block_of:
                    raise ValueError("a parameter appears in two blocks")
                self._block_of[id(p)] = i
        self.auto = isinstance(gpu_blocks, str)
        if self.auto and gpu_blocks != "auto":
            raise ValueError(f"gpu_blocks must be an integer >= 0 or 'auto', got {gpu_blocks!r}")
        k = 0 if (gpu_blocks is None or self.auto) else _checks.integer("gpu_blocks", gpu_blocks, lo=0)
        if k > len(self._blocks):
            raise ValueError(f"gpu_blocks={k} but there are only {len(self._blocks)} blocks")
        self.gpu_blocks = k
        self.schedule_every = _checks.integer("schedule_every", schedule_every, lo=1)
        if gpu_memory_limit is not None:
            gpu_memory_limit = _checks.integer("gpu_memory_limit", gpu_memory_limit, lo=1)
        self._gpu_memory_request = gpu_memory_limit
        if speculate is True or speculate is None:
            speculate = 0
        if speculate not in ("auto", False):
            speculate = _checks.integer("speculate", speculate, lo=0)
        self.speculate = speculate
        if host_memory_limit is None:
            host_memory_limit = int(physical_memory_bytes() * 0.75)
        self.host_memory_limit = _checks.integer("host_memory_limit", host_memory_limit, lo=1)
        if pool is not None and not isinstance(pool, PinnedPool):
            raise TypeError(f"pool must be a hytrain.PinnedPool, got {type(pool).__name__}")
        # Default: every usable core but one, which the training thread needs to keep the GPU fed.
        n_workers = workers if workers is not None else max(1, len(os.sched_getaffinity(0)) - 1)
        self._settings = dict(pool=pool, workers=_checks.integer("workers", n_workers, lo=1),
                              slice_elements=_checks.integer("slice_elements", slice_elements, lo=1024),
                              trace=bool(trace), model=model if blocks is None else None)
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.overlap = bool(overlap)
        n = len(self._blocks)
        self._arrivals = [0] * n
        self._expected = [len(b) for b in self._blocks]
        self._submitted = [False] * n
        self._steps_taken = 0
        self._bound = None  # id(p) -> (device, dtype, shape) the state was created for (first step)
        self._pending_load = None  # a state_dict loaded before the state exists
        self._spec_from = None  # blocks >= this (offloaded, with shadows) speculate in the next backward
        self._clip_request = None  # max_norm of a clip_grad_norm_ call for the coming step
        self._sq_parts = []  # squared gradient norms of the blocks handed off early (device scalars)
        self._grad_norm = None  # this step's global gradient norm, once computed
        self._handed = {}  # id(p) -> (gradient, its version) handed off while the caller keeps .grad
        self.speculation_counts = {"adopted": 0, "redone": 0}  # speculated block updates, so far
        self.last_grad_norm = None  # the last step's global gradient norm (before clipping), when clipping
        self.timeline = None
        self._meter = None
        self._scheduler = None
        self._last_summary = {}
        self._prediction = None  # the scheduler's simulated iteration for the k in use
        self._model_hooks = []
        # The optimizer is reached through a weak reference: hooks left on the parameters do not
        # keep a discarded optimizer alive, and do nothing once it is gone.
        ref = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, ref))
                       for p in self._params]

    # ---- binding: the state is created at the first step ------------------------------------------

    @property
    def bound(self) -> bool:
        """Whether the state exists (it is created at the first ``step()``, as torch's optimizers do,
        for the device and dtype the parameters have then)."""
        return self._bound is not None

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
            raise
        self._bound = {id(p): (p.device, p.dtype, p.shape) for p in self._params}
        if self._pending_load is not None:
            pending, self._pending_load = self._pending_load, None
            self.load_state_dict(pending)

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
        for p in self._params:
            self._init_state(p)
        self._engine = native().UpdateEngine(self._settings["workers"], self._settings["slice_elements"],
                                             simd_paths()["selected"])
        self._pipeline = None
        if self._cuda:
            # The weight copies gate the next forward: give them the higher priority.
            self._pipeline = native().OffloadPipeline(self._engine, self.device.index, 0, -1)
        self._loss_scaling = any(p.dtype == torch.float16 for p in self._params)
        n = len(self._blocks)
        self._inflight = {}  # block -> what the workers read (CPU path) / the weights written (pipeline)
        self._landing = collections.deque()  # (D2H ticket, gradients it reads) until the copy lands
        self._held = {}  # block -> parameters handed off early, awaiting step()'s multiplier
        self._shadow = {}  # id(p) -> spare host master/exp_avg/exp_avg_sq[/max_exp_avg_sq]/copy
        self._lent = {}  # block -> the GPU-resident block whose idle host state and staging are its shadows
        self._signatures = [tuple((tuple(p.shape), p.dtype, "max_exp_avg_sq" in self.state[p]) for p in blk)
                            for blk in self._blocks]  # blocks that can lend each other host state
        self._speculated = {}  # block -> parameters updated speculatively in this backward
        self._last_clipped = True  # whether the last step's multiplier differed from 1 (or none yet)
        self._on_gpu = [False] * n
        self._dev_state = {}  # id(p) -> device master/exp_avg/exp_avg_sq/max_exp_avg_sq/grad
        self._gpu_groups = {}  # ((id, address) of each parameter) -> CudaAdamW
        self.timeline = Timeline(self.device if self._cuda else None) if self._settings["trace"] else None
        if self.timeline is not None:
            self.timeline.pipeline = self._pipeline
        self._pass_owner = {}
        self._mig_stream = None
        self._mig_events = {}  # block -> CUDA event: its states' asynchronous move has completed
        self._pending_up = set()  # blocks to move to the GPU once their in-flight CPU update is done
        self._meter_owner = {}
        if self._cuda:
            self._mig_stream = torch.cuda.Stream(self.device, priority=0)
            self._migrate(self.gpu_blocks)
            self._settle_migrations()
        model = self._settings["model"]
        if model is not None:
            self._install_forward_hooks(model)
        if self._cuda and self._model_hooks:
            # Iterations are numbered from the first, which ran before the state existed.
            self._meter = Meter(self.device, self._pipeline, len(self._blocks), first_index=1)
        if self._cuda and self._model_hooks and self.accumulation_steps == 1:
            # Fixed k too: its predictions are what a run is checked against.
            self._start_scheduler(self._gpu_memory_request)

    def _check_bound(self, p):
        """Refuses a parameter that changed device, dtype or shape after its state was created."""
        device, dtype, shape = self._bound[id(p)]
        if p.device != device or p.dtype != dtype or p.shape != shape:
            raise RuntimeError(
                f"parameter {self._index_of[id(p)]} is now {str(p.dtype).replace('torch.', '')} of shape "
                f"{tuple(p.shape)} on {p.device}, but HybridAdamW created its state at the first step for "
                f"{str(dtype).replace('torch.', '')} of shape {tuple(shape)} on {device}. Moving or casting "
                "parameters after the first step is not supported: move the model before the first step, "
                "or save optimizer.state_dict(), move the model back, and load that state into a new "
                "HybridAdamW built after the move")

    # ---- setup ------------------------------------------------------------------------------------

    @staticmethod
    def _check_params(params) -> torch.device:
        if not params:
            raise ValueError("HybridAdamW got an empty parameter list")
        devices = set()
        for i, p in enumerate(params):
            if p.dtype not in _PARAM_DTYPES:
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

    def _make_blocks(self, all_params, model, blocks, bucket_elements):
        if blocks is not None:
            out = []
            for b in blocks:
                ps = list(b.parameters()) if isinstance(b, nn.Module) else list(b)
                out.append([p for p in ps if id(p) in self._group_of])
            covered = {id(p) for b in out for p in b}
            missing = [p for p in all_params if id(p) not in covered]
            if missing:
                raise ValueError(f"{len(missing)} optimizer parameter(s) are in no block of `blocks`")
            return [b for b in out if b]
        if model is not None:
            if not isinstance(model, nn.Module):
                raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
            out = detect_blocks(model, all_params)
            covered = {id(p) for b in out for p in b}
            extra = [p for p in all_params if id(p) not in covered]
            if extra:  # optimizer parameters outside the model: one more block at the end
                out.append(extra)
            return out
        out, cur, size = [], [], 0
        for p in all_params:
            cur.append(p)
            size += p.numel()
            if size >= bucket_elements:
                out.append(cur)
                cur, size = [], 0
        if cur:
            out.append(cur)
        return out

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
            total += p.numel() * per + 6 * 256
        return total * 3 // 2 + (256 << 20)

    def _init_state(self, p):
        st = self.state[p]
        st["step"] = torch.zeros((), dtype=torch.float32)
        st["exp_avg"] = self._pool.zeros(p.shape, torch.float32)
        st["exp_avg_sq"] = self._pool.zeros(p.shape, torch.float32)
        if self._group_of[id(p)]["amsgrad"]:
            st["max_exp_avg_sq"] = self._pool.zeros(p.shape, torch.float32)
        if p.dtype != torch.float32 or self._cuda:
            st["master"] = self._pool.empty(p.shape, torch.float32)
            st["master"].copy_(p.detach())
        if self._cuda:
            # One staging buffer: the gradient is copied in, the CPU update reads each element's
            # gradient before writing its new bf16/fp16 weight over it, and the H2D copy sends it back.
            buf = self._pool.empty(p.shape, p.dtype)
            self._staging[id(p)] = (buf, buf if p.dtype != torch.float32 else None)

    def _install_forward_hooks(self, model):
        """Just-in-time waits: head blocks (and optimizer parameters outside the model) before the
        model's forward, each repeated layer's blocks before that layer, tail blocks after the last
        layer (before anything after it can use them). And the model's ``state_dict()`` (a checkpoint
        save outside any forward) waits for every update in flight."""
        self._model_hooks.append(model.register_state_dict_pre_hook(lambda *_: self.synchronize()))
        layers = repeated_layers(model)
        n = len(self._blocks)
        if layers is None:
            everything = list(range(n))
            self._model_hooks.append(model.register_forward_pre_hook(
                lambda *_: self._before_forward(everything, everything[:1])))
            return
        layer_ids = [sorted({self._block_of[id(p)] for p in child.parameters() if id(p) in self._block_of})
                     for child in layers]
        in_layers = {b for ids in layer_ids for b in ids}
        first_layer = min(in_layers) if in_layers else n
        head = [b for b in range(n) if b not in in_layers and b < first_layer]
        tail = [b for b in range(n) if b not in in_layers and b > first_layer]
        model_params = {id(p) for p in model.parameters()}
        outside = [b for b in tail if not any(id(p) in model_params for p in self._blocks[b])]
        tail = [b for b in tail if b not in outside]
        self._model_hooks.append(model.register_forward_pre_hook(
            lambda *_: self._before_forward(head + outside, head)))
        for child, ids in zip(layers, layer_ids):
            self._model_hooks.append(child.register_forward_pre_hook(
                lambda *_, ids=ids: self._before_forward(ids, ids)))
        if tail:
            self._model_hooks.append(layers[len(layers) - 1].register_forward_hook(
                lambda *_: self._before_forward(tail, tail)))

    def _before_forward(self, wait_for, marks):
        meter = self._meter if (self._meter is not None and torch.is_grad_enabled()
                                and not any(self._arrivals)) else None
        before = None
        if meter is not None:
            meter.start(self._deferred())
            before = meter.before_wait()
        self._wait_blocks(wait_for)
        if meter is not None:
            meter.after_wait(marks, before)
        if self.timeline is not None and torch.is_grad_enabled():
            for b in marks:
                self.timeline.mark("forward", b)

    # ---- k: which blocks the GPU updates ----------------------------------------------------------

    def set_gpu_blocks(self, k: int, *, wait: bool = True) -> None:
        """Makes the first ``k`` blocks (forward order) GPU-updated, moving their fp32 master weights
        and Adam states to the device, and the others CPU-updated (states back in pinned memory).
        Call between steps. ``wait=True`` returns with the move complete; ``wait=False`` only starts
        it, as the scheduler does (see ``_migrate``). The results do not depend on k (both AdamW
        kernels agree bit for bit). With ``gpu_blocks="auto"`` the scheduler may change k again.
        Before the first step this only records k (the state does not exist yet)."""
        k = _checks.integer("gpu_blocks", k, lo=0)
        if k > len(self._blocks):
            raise ValueError(f"gpu_blocks={k} but there are only {len(self._blocks)} blocks")
        if any(self._submitted) or any(self._arrivals):
            raise RuntimeError("set_gpu_blocks must be called between steps, not between backward and step()")
        if not self.bound:
            self.gpu_blocks = k
            return
        if k and not self._cuda:
            raise ValueError("gpu_blocks > 0 needs CUDA parameters (these are on the CPU)")
        if wait:
            self.synchronize()
        if self._cuda:
            self._migrate(k)
        if wait and self._cuda:
            self._settle_migrations()

    def _migrate(self, k):
        """Starts moving states so that blocks < k are GPU-resident. Nothing here waits: states go
        down on the migration stream after the compute stream's last update of them; states go up
        once the block's in-flight CPU update has finished (at its forward wait), and the compute
        stream waits for them only at the block's first GPU update."""
        for b in range(len(self._blocks)):
            if b < k and not self._on_gpu[b]:
                if b in self._inflight:
                    self._pending_up.add(b)
                else:
                    self._to_gpu(b)
            elif b >= k:
                self._pending_up.discard(b)
                if self._on_gpu[b]:
                    self._to_host(b)
        self.gpu_blocks = k

    def _to_gpu(self, b):
        self._pending_up.discard(b)
        for p in self._blocks[b]:  # a resident block does not speculate; nothing reads its shadows now
            self._shadow.pop(id(p), None)
        self._lent.pop(b, None)  # a donor's state entries already name the spare set
        compute = torch.cuda.current_stream(self.device)
        states = []
        for p in self._blocks[b]:
            st = self.state[p]
            d = {key: torch.empty(st[key].shape, dtype=torch.float32, device=self.device)
                 for key in _STATE_KEYS if key in st}
            if p.dtype != torch.float32:
                d["master"] = torch.empty(p.shape, dtype=torch.float32, device=self.device)
            d["grad"] = torch.empty_like(p)
            states.append((p, st, d))
        # Fresh allocations may reuse memory that queued compute-stream work still reads.
        self._mig_stream.wait_stream(compute)
        with torch.cuda.stream(self._mig_stream):
            for p, st, d in states:
                for key, t in d.items():
                    if key != "grad":
                        t.copy_(st[key], non_blocking=True)
                if p.dtype == torch.float32:
                    d["master"] = p  # fp32 weights are their own master
                self._dev_state[id(p)] = d
        done = torch.cuda.Event()
        done.record(self._mig_stream)
        self._mig_events[b] = done
        self._on_gpu[b] = True

    def _to_host(self, b):
        self._reclaim(b)
        self._mig_stream.wait_stream(torch.cuda.current_stream(self.device))  # after the block's last update
        with torch.cuda.stream(self._mig_stream):
            for p in self._blocks[b]:
                st, d = self.state[p], self._dev_state.pop(id(p))
                for key in (*_STATE_KEYS, "master"):
                    if key in st:
                        st[key].copy_(d[key], non_blocking=True)
                        if d[key] is not p:
                            d[key].record_stream(self._mig_stream)  # freed only after the copy
                d["grad"].record_stream(self._mig_stream)
        self._drop_gpu_groups({id(p) for p in self._blocks[b]})
        done = torch.cuda.Event()
        done.record(self._mig_stream)
        self._mig_events[b] = done
        self._on_gpu[b] = False

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
        for b in list(self._pending_up):
            if b not in self._inflight:
                self._to_gpu(b)
        for b in list(self._mig_events):
            self._mig_events.pop(b).synchronize()

    # ---- the scheduler ----------------------------------------------------------------------------

    def _block_sizes(self):
        numel, weight, state = [], [], []
        for blk in self._blocks:
            n = w = s = 0
            for p in blk:
                e = p.numel()
                n += e
                w += e * p.element_size()
                per = 8 + (4 if self._group_of[id(p)]["amsgrad"] else 0) + p.element_size()
                if p.dtype != torch.float32:
                    per += 4  # master
                s += e * per
            numel.append(max(1, n))
            weight.append(w)
            state.append(s)
        return numel, weight, state

    def _start_scheduler(self, limit):
        numel, weight, self._state_bytes = self._block_sizes()
        self._scheduler = native().KSplitScheduler(numel, weight, self._state_bytes,
                                                   every=self.schedule_every, deferred=self._deferred())
        if limit is None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            fraction = 1.0
            getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
            if getter is not None:
                try:
                    fraction = float(getter(self.device))
                except (RuntimeError, TypeError):
                    fraction = 1.0
            limit = int(total * fraction)
        self.gpu_memory_limit = limit
        self._nonstate_peak = 0
        self._scheduler.memory_budget = 0.0  # nothing resident until a step's peak has been seen
        self._probe_gpu_rate()

    def _probe_gpu_rate(self):
        """alpha's GPU side before any block runs there: the fused AdamW on 4 M scratch elements."""
        n = 1 << 22
        dtype = self._blocks[0][0].dtype
        t = [torch.zeros(n, device=self.device) for _ in range(3)]
        g = torch.full((n,), 1e-3, dtype=dtype, device=self.device)
        w = torch.empty(n, dtype=dtype, device=self.device) if dtype != torch.float32 else None
        fused = CudaAdamW([t[0]], [t[1]], [t[2]], [g], weights=[w] if w is not None else None)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fused.step(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        start.record()
        for i in range(3):
            fused.step(step=2 + i, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        end.record()
        end.synchronize()
        self._scheduler.observe_rate(native().Phase.gpu, start.elapsed_time(end) / 1e3 / 3 / n)

    def _resident_bytes(self):
        return sum(s for b, s in enumerate(self._state_bytes) if self._on_gpu[b] or b in self._pending_up)

    def _schedule(self, record):
        """After a step's launches: feed the last complete iteration's costs, refresh the memory
        budget, and let the scheduler pick k for the next step (migrations start now)."""
        summary = self._meter.harvest(record, self._scheduler) if record is not None else None
        if summary is not None:
            self._last_summary = {k: v for k, v in summary.items() if k != "nonstate_peak_bytes"}
        if self._scheduler is None:
            return
        self._scheduler.deferred = self._deferred()
        self._scheduler.overlap = self.overlap
        self._scheduler.early_copies = self._early_handoff()
        self._scheduler.speculative_min = self._speculation_floor()
        self._scheduler.speculative_fixed = self.speculate != "auto"  # predictions as the run does
        if not self.auto:
            if self._scheduler.ready():
                self._prediction = self._scheduler.predict(self.gpu_blocks)
                self._speculate_as_predicted()
            return
        if summary is None:
            return  # no measured iteration yet: no budget, no decision
        # The most memory seen in use apart from resident states, sampled as each block's gradients
        # completed (backward is where activations and gradients meet), plus a margin for what falls
        # between samples (the loss, temporary buffers).
        self._nonstate_peak = max(self._nonstate_peak, summary["nonstate_peak_bytes"])
        margin = (1 << 30) + self.gpu_memory_limit // 20
        self._scheduler.memory_budget = float(max(0, self.gpu_memory_limit - self._nonstate_peak - margin))
        k = self._scheduler.decide(self.gpu_blocks)
        if k != self.gpu_blocks:
            self._migrate(k)
        if self._scheduler.ready():
            self._prediction = self._scheduler.last_prediction()
            self._speculate_as_predicted()

    def _speculate_as_predicted(self):
        if self.speculate == "auto":
            self._speculate_from(self._prediction["speculative_from"])

    @property
    def blocks(self) -> list[list[nn.Parameter]]:
        """The blocks, in forward order: the parameters updated together (a copy of the lists)."""
        return [list(b) for b in self._blocks]

    @property
    def scheduler(self):
        """The native ``KSplitScheduler`` (for inspection: ``costs()``, ``predict(k)``), or None: it
        exists on CUDA with a model and ``accumulation_steps=1``, from the first step on."""
        return self._scheduler

    def residency(self) -> dict:
        """Where the blocks' states are: ``gpu`` (resident blocks), ``moving`` (blocks whose states are
        still in an asynchronous move), ``lent`` (speculating block -> the GPU-resident block whose idle
        host state it borrows as shadows). Empty before the first step."""
        if not self.bound:
            return {"gpu": [], "moving": [], "lent": {}}
        return {"gpu": [b for b, on in enumerate(self._on_gpu) if on], "moving": sorted(self._mig_events),
                "lent": dict(self._lent)}

    def schedule_stats(self) -> dict:
        """What the scheduler saw and predicts: k, the predicted iteration (``predicted_iter_s``,
        ``predicted_gpu_idle_s``), the measured compute-stream iteration and the share of it spent
        waiting for updated weights (``gpu_wait_frac``), and the memory budget for resident states."""
        out = {"k": self.gpu_blocks, "speculative_from": self._spec_from, **self._last_summary}
        p = self._prediction
        if p is not None:
            out["predicted_iter_s"] = p["iter_s"]
            out["predicted_gpu_idle_s"] = p["gpu_idle_s"]
        if self._scheduler is not None and self.auto:
            out["state_budget_bytes"] = self._scheduler.memory_budget
        return out

    def _sync_host(self, b):
        """Copies a GPU-resident block's master weights and states into its host state."""
        for p in self._blocks[b]:
            st, d = self.state[p], self._dev_state[id(p)]
            for key in (*_STATE_KEYS, "master"):
                if key in st:
                    st[key].copy_(d[key])

    # ---- the pipeline -----------------------------------------------------------------------------

    def _deferred(self) -> bool:
        """Whether updates wait for step(): the multiplier (clipping, loss scaling) or the gradients
        themselves (kept for the caller, who may clip or rescale them) are known only then."""
        return (not self.overlap or self._steps_taken == 0 or self.max_grad_norm is not None
                or self._loss_scaling or not self.release_grads)

    def _early_handoff(self) -> bool:
        """Deferred without loss scaling (CUDA): each block's gradients leave the GPU during backward
        (with the block's share of the squared norm when the optimizer clips); the updates wait for
        step(), or run speculatively and are checked there."""
        return (self._cuda and self.overlap and self._steps_taken > 0 and not self._loss_scaling
                and (self.max_grad_norm is not None or not self.release_grads))

    def _sq_norm(self, grads):
        """The squared 2-norm of some gradients as a 0-d float64 device tensor (no fp32 copies)."""
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return torch.stack(norms).double().square().sum()

    def _hand_off(self, b):
        """Early hand-off of block b (see _early_handoff): offloaded blocks are staged on hold (or
        speculate), GPU-resident blocks copy their gradients into their update buffers. ``.grad`` is
        released (``release_grads``), or kept for the caller with its version noted, so that step()
        can tell whether the caller changed it (clip_grad_norm_, unscaling) and redo the block."""
        pairs = self._grads(b)
        if self.release_grads:
            if pairs:
                self._sq_parts.append(self._sq_norm([g for _, g in pairs]))
        else:
            for p in self._blocks[b]:
                if p.grad is not None:
                    self._handed[id(p)] = (p.grad, p.grad._version)
        if self._on_gpu[b]:
            for p, g in pairs:
                self._dev_state[id(p)]["grad"].copy_(g)
            self._held[b] = [p for p, _ in pairs]
            if self.release_grads:
                for p, _ in pairs:
                    p.grad = None
            self._submitted[b] = True
        else:
            spec = (self._spec_from is not None and b >= self._spec_from and not self._last_clipped
                    and self._has_shadows(b))
            self._launch(b, 1.0, release=self.release_grads, hold=not spec, speculative=spec)
            if pairs:
                (self._speculated if spec else self._held)[b] = [p for p, _ in pairs]

    def _on_grad(self, p):
        b = self._block_of[id(p)]
        if self._submitted[b] and not self.release_grads:
            return  # another backward into kept gradients: step() sees them changed and redoes the block
        if self._submitted[b]:
            raise RuntimeError(
                f"gradients arrived for block {b} after it was already updated in this step: call "
                f"optimizer.step() after every {self.accumulation_steps} backward pass(es) "
                "(accumulation_steps)")
        self._arrivals[b] += 1
        if self._bound is None:
            return  # the first step is deferred: its state is created, and its updates run, in step()
        if self._arrivals[b] >= self._expected[b] * self.accumulation_steps:
            if self.timeline is not None:
                self.timeline.mark("backward", b)
            if self._meter is not None:
                self._meter.backward_done(b, self._resident_bytes if self._scheduler is not None else None)
            if not self._deferred():
                self._launch(b, 1.0, release=True)
            elif self._early_handoff():
                self._hand_off(b)
        self._release_landed()

    def _grads(self, b):
        """The block's (parameter, gradient) pairs, gradients validated and contiguous."""
        out = []
        for p in self._blocks[b]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse or g.layout != torch.strided:
                raise RuntimeError(f"HybridAdamW does not support sparse gradients (shape {tuple(p.shape)})")
            self._check_bound(p)
            if g.dtype != p.dtype or g.shape != p.shape or g.device != p.device:
                raise RuntimeError(f"gradient of a parameter of shape {tuple(p.shape)} has dtype {g.dtype}, "
                                   f"shape {tuple(g.shape)}, device {g.device}: it must match the parameter "
                                   f"({p.dtype}, {p.device})")
            out.append((p, g if g.is_contiguous() else g.contiguous()))
        return out

    def _row(self, p, grad_addr, grad_scale, step, copy_addr, out=None):
        """One native job row; ``out``: a shadow the new state is written to (else in place)."""
        group = self._group_of[id(p)]
        st = self.state[p]
        half = p.dtype != torch.float32
        outs = (0, 0, 0, 0) if out is None else (
            out["master"].data_ptr(), out["exp_avg"].data_ptr(), out["exp_avg_sq"].data_ptr(),
            _checks.address(out.get("max_exp_avg_sq")))
        return (st.get("master", p).data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(),
                _checks.address(st.get("max_exp_avg_sq")), grad_addr, _checks.DTYPE_CODES[p.dtype],
                copy_addr if half else 0, _checks.DTYPE_CODES[p.dtype] if half else 1,
                p.numel(), float(group["lr"]), float(group["betas"][0]), float(group["betas"][1]),
                float(group["eps"]), float(group["weight_decay"]), step, True,
                bool(group["amsgrad"]), float(grad_scale), *outs)

    def _pass_row(self, p, grad_scale, step, out=None):
        """An offloaded parameter's update row (reading the gradient in staging; writing the new
        state in place, or to the shadow ``out``) and the H2D copy of its new weights."""
        grad_host, weight_host = self._staging[id(p)]
        if out is not None:
            weight_host = out.get("copy")
        row = self._row(p, grad_host.data_ptr(), grad_scale, step, _checks.address(weight_host), out)
        src = weight_host if weight_host is not None else (out or self.state[p])["master"]
        return row, (p.data_ptr(), src.data_ptr(), p.numel() * p.element_size())

    def _launch(self, b, grad_scale, *, release, hold=False, speculative=False):
        """Starts block b's update with gradient multiplier ``grad_scale``. ``release`` drops the
        parameters' ``.grad`` (the GPU memory returns once the gradient copy has landed). ``hold``
        (offloaded blocks): copy the gradients out now, update on OffloadPipeline.release.
        ``speculative`` (offloaded blocks): the new state goes to the block's shadows and the new
        weights come from the shadow staging; the gradients stay in staging (see _adopt, _redo)."""
        pairs = self._grads(b)
        if self.timeline is not None:
            self._pass_owner[b] = self.timeline.current
        if self._meter is not None and self._cuda and not self._on_gpu[b]:
            self._meter_owner[b] = self._meter.current
        if not self._cuda:
            rows = []
            for p, g in pairs:
                self.state[p]["step"] += 1
                rows.append(self._row(p, g.data_ptr(), grad_scale, int(self.state[p]["step"].item()),
                                      p.data_ptr()))
            self._engine.submit(b, rows)
            # The workers read the gradients and write the weights: both stay alive until waited for.
            self._inflight[b] = [t for p, g in pairs for t in (g, p.detach())]
        elif self._on_gpu[b]:
            self._gpu_update(b, pairs, grad_scale)
        elif pairs:
            self._migration_done(b, host=True)  # states that came down from the GPU have landed
            d2h, rows, h2d = [], [], []
            for p, g in pairs:
                d2h.append((self._staging[id(p)][0].data_ptr(), g.data_ptr(), p.numel() * p.element_size()))
                row, copy = self._pass_row(p, grad_scale, int(self.state[p]["step"].item()) + 1,
                                           self._shadow[id(p)] if speculative else None)
                rows.append(row)
                h2d.append(copy)
            self._pipeline.stage(b, d2h, rows, h2d, torch.cuda.current_stream(self.device).cuda_stream, hold)
            for p, _ in pairs:
                self.state[p]["step"] += 1
            self._landing.append((self._pipeline.d2h_issued, [g for _, g in pairs]))
            # The H2D copies write these weights: their storage stays alive until the pass is waited
            # for, even if the caller replaces the parameters' data meanwhile.
            self._inflight[b] = [p.detach() for p, _ in pairs]
        self._submitted[b] = True
        if release and self._cuda:
            for p, _ in pairs:
                p.grad = None

    def _gpu_update(self, b, pairs, grad_scale):
        """pairs: (parameter, gradient), or (parameter, None) when the gradient is already in the
        parameter's update buffer (early hand-off)."""
        self._migration_done(b, host=False)  # states that went up: the compute stream waits for them
        groups = {}
        for p, g in pairs:
            d = self._dev_state[id(p)]
            if g is not None:
                d["grad"].copy_(g)
            st = self.state[p]
            st["step"] += 1
            groups.setdefault((self._group_index[id(p)], p.dtype, int(st["step"].item())), []).append(p)
        timed = self.timeline is not None or self._meter is not None
        first = False
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.device))
        for (gi, dtype, step), ps in groups.items():
            # The fused kernel's tables hold the weights' addresses: a parameter whose storage was
            # replaced gets a new group.
            key = tuple((id(p), p.data_ptr()) for p in ps)
            fused = self._gpu_groups.get(key)
            if fused is None:
                first = True  # building the group's tables is not the update's cost: not measured
                self._drop_gpu_groups({id(p) for p in ps})
                ds = [self._dev_state[id(p)] for p in ps]
                half = dtype != torch.float32
                amsgrad = bool(self.param_groups[gi]["amsgrad"])
                fused = CudaAdamW([d["master"] for d in ds], [d["exp_avg"] for d in ds],
                                  [d["exp_avg_sq"] for d in ds], [d["grad"] for d in ds],
                                  weights=list(ps) if half else None, amsgrad=amsgrad,
                                  max_exp_avg_sqs=[d["max_exp_avg_sq"] for d in ds] if amsgrad else None)
                self._gpu_groups[key] = fused
            group = self.param_groups[gi]
            fused.step(step=step, lr=float(group["lr"]), betas=group["betas"], eps=float(group["eps"]),
                       weight_decay=float(group["weight_decay"]), grad_scale=float(grad_scale))
        if timed:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            if self.timeline is not None:
                self.timeline.gpu_update(b, start, end)
            if self._meter is not None and not first:
                self._meter.gpu_update(b, start, end)

    def _drop_gpu_groups(self, ids):
        self._gpu_groups = {key: g for key, g in self._gpu_groups.items()
                            if not any(i in ids for i, _ in key)}

    def _drop_held(self):
        """A step that cannot be taken: held updates are cancelled, speculative ones dropped (their
        blocks get back the weights of their untouched state), and step counts restored, so that the
        states and weights are as before the backward."""
        for b, ps in self._held.items():
            if not self._on_gpu[b]:
                self._pipeline.cancel(b)
                for p in ps:
                    self.state[p]["step"] -= 1
        self._held.clear()
        for b, ps in self._speculated.items():
            self._wait_blocks([b])  # the compute stream now follows the speculative weight copies
            for p in ps:
                p.data.copy_(self.state[p]["master"], non_blocking=True)  # the weights are its rounding
                self.state[p]["step"] -= 1
        self._speculated.clear()

    # ---- speculation (see the module notes) -------------------------------------------------------

    def _has_shadows(self, b) -> bool:
        return all(id(p) in self._shadow for p in self._blocks[b])

    def _shadow_bytes(self, b) -> int:
        return sum(p.numel() * 4 * sum(1 for key in ("master", *_STATE_KEYS) if key in self.state[p])
                   + (p.numel() * p.element_size() if p.dtype != torch.float32 else 0)
                   for p in self._blocks[b] if id(p) not in self._shadow)

    def _speculation_allowed(self) -> bool:
        """Whether the next backward may speculate: clipping on CUDA, and the last step did not clip."""
        return self.speculate is not False and self._early_handoff() and not self._last_clipped

    def _donors(self) -> dict:
        """GPU-resident blocks whose host state and staging nothing reads (moved up, not lent yet),
        by parameter signature: they can be a speculating block's shadows at no memory cost."""
        taken = set(self._lent.values())
        out = {}
        for r, resident in enumerate(self._on_gpu):
            ev = self._mig_events.get(r)
            if resident and r not in taken and (ev is None or ev.query()):
                out.setdefault(self._signatures[r], []).append(r)
        return out

    def _borrow(self, b, r):
        for p, q in zip(self._blocks[b], self._blocks[r]):
            st = self.state[q]
            sh = {key: st[key] for key in ("master", *_STATE_KEYS) if key in st}
            if p.dtype != torch.float32:
                sh["copy"] = self._staging[id(q)][0]
            self._shadow[id(p)] = sh
        self._lent[b] = r

    def _reclaim(self, r):
        """Donor r is about to need its host state again (it moves down): its borrower stops
        speculating once its pass in flight (which may read or write that memory) is done."""
        for b in [b for b, d in self._lent.items() if d == r]:
            if b in self._inflight:
                self._wait_blocks([b])
            for p in self._blocks[b]:
                self._shadow.pop(id(p), None)
            del self._lent[b]

    def _shadow_plan(self, lowest_start):
        """From the last block down to ``lowest_start``: (block, donor or None) for each offloaded
        block that can have shadows, borrowed from a donor or allocated within the host limit and the
        pool's capacity; stops at the first that cannot."""
        donors = self._donors() if any(self._on_gpu) else {}
        room = None  # host headroom, read only if some block needs new memory
        plan = []
        for b in range(len(self._blocks) - 1, lowest_start - 1, -1):
            if self._on_gpu[b]:
                break
            donor = None
            if not self._has_shadows(b):
                spare = donors.get(self._signatures[b])
                if spare:
                    donor = spare.pop()
                else:
                    if room is None:
                        stats = self._pool.stats()
                        free = stats["reserved"] - stats["in_use"]
                        room = min(self.host_memory_limit - _rss_bytes() + free,
                                   stats["capacity"] - stats["in_use"])
                    room -= self._shadow_bytes(b)
                    if room < 0:
                        break
            plan.append((b, donor))
        return plan

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
                              for key in ("master", *_STATE_KEYS) if key in st}
                        if p.dtype != torch.float32:
                            sh["copy"] = self._pool.empty(p.shape, p.dtype)
                        self._shadow[id(p)] = sh
                        allocated = True
                except MemoryError:  # the pool's capacity: speculation starts above this block
                    for p in self._blocks[b]:
                        self._shadow.pop(id(p), None)
                    break
            self._spec_from = b
        if allocated and self._meter is not None:
            self._meter.pending = None  # the allocation stalled this iteration: not a measurement

    def _adopt(self, keep=()):
        """The multiplier is 1: the speculative states are the step's result; the old ones become
        the shadows (the passes still writing them are waited for before anything reads them).
        Blocks in ``keep`` (their gradients changed after the hand-off) stay speculated for _restage."""
        adopted = [b for b in self._speculated if b not in keep]
        self.speculation_counts["adopted"] += len(adopted)
        for b in adopted:
            ps = self._speculated.pop(b)
            donor = self._lent.get(b)
            twin = {} if donor is None else {id(p): q for p, q in zip(self._blocks[b], self._blocks[donor])}
            for p in ps:
                st, sh = self.state[p], self._shadow[id(p)]
                for key in ("master", *_STATE_KEYS):
                    if key in st:
                        st[key], sh[key] = sh[key], st[key]
                        if donor is not None:  # the donor's state entries follow the spare set
                            self.state[twin[id(p)]][key] = sh[key]

    def _redo(self, b, mult):
        """Clipping fired: block b is updated again from its untouched state with the multiplier;
        the gradients are still in staging. (The pipeline lets the speculative pass finish first.)"""
        rows, h2d = [], []
        for p in self._speculated[b]:
            row, copy = self._pass_row(p, mult, int(self.state[p]["step"].item()))
            rows.append(row)
            h2d.append(copy)
        if self.timeline is not None:
            self._pass_owner[b] = self.timeline.current
        if self._meter is not None:
            self._meter_owner[b] = self._meter.current
        self._pipeline.stage(b, [], rows, h2d, torch.cuda.current_stream(self.device).cuda_stream, False)
        self._inflight[b] = [p.detach() for p in self._speculated[b]]
        del self._speculated[b]  # (until here a failure leaves it to _drop_held)
        self.speculation_counts["redone"] += 1

    def _changed_blocks(self) -> set:
        """Blocks handed off during backward that cannot be released as they are: the caller changed
        their gradients since (``clip_grad_norm_``, unscaling, replacing or dropping ``.grad``; seen by
        the gradients' identity and version counters), or replaced their parameters' storage (which the
        staged weight copies would write). Parameters moved to another device or dtype are refused."""
        out = set()
        for b, ps in (*self._held.items(), *self._speculated.items()):
            for p in self._blocks[b]:
                self._check_bound(p)
            staged = self._inflight.get(b) if not self._on_gpu[b] else None
            if staged and any(w.data_ptr() != p.data_ptr() for w, p in zip(staged, ps)):
                if self.release_grads:
                    raise RuntimeError(f"the parameters of block {b} were given new storage between backward "
                                       "and step(): their update was staged for the old storage, and their "
                                       "gradients are released (release_grads=True)")
                out.add(b)
                continue
            if self.release_grads:
                continue
            for p in self._blocks[b]:
                seen, g = self._handed.get(id(p)), p.grad
                if (seen is None) != (g is None) or (g is not None and (g is not seen[0] or g._version != seen[1])):
                    out.add(b)
                    break
        return out

    def _restage(self, b, mult):
        """Block b's gradients changed after its hand-off: its held pass is cancelled, or its
        speculative one dropped (it wrote only the shadows), and the block is updated from the
        gradients there now (the new copies wait for the old pass on the device)."""
        if self._on_gpu[b]:
            self._held.pop(b)
            self._gpu_update(b, self._grads(b), mult)
            return
        if b in self._held:
            self._pipeline.cancel(b)
            ps = self._held.pop(b)
        else:
            ps = self._speculated.pop(b)
        for p in ps:
            self.state[p]["step"] -= 1
        self._launch(b, mult, release=False)

    def _release_landed(self):
        if not self._landing:
            return
        done = self._pipeline.d2h_completed
        while self._landing and self._landing[0][0] <= done:
            self._landing.popleft()

    def _wait_blocks(self, ids):
        for b in ids:
            if b not in self._inflight:
                continue
            try:
                if self._cuda:
                    self._pipeline.wait_ready(b, torch.cuda.current_stream(self.device).cuda_stream)
                else:
                    self._engine.wait(b)
            finally:
                del self._inflight[b]
            owner = self._pass_owner.pop(b, None)
            info = None
            if owner is not None:
                info = self._pipeline.last_pass(b) if self._cuda else self._engine.timing(b)
                owner.passes[b] = info
            metered = self._meter_owner.pop(b, None)
            if metered is not None:
                metered.passes[b] = info if info is not None else self._pipeline.last_pass(b)
        for b in ids:
            if b in self._pending_up:
                self._to_gpu(b)
        self._release_landed()

    def synchronize(self) -> None:
        """Waits for every queued update and state move (the parameters are then current for the
        current stream)."""
        if not self.bound:
            return
        # Held blocks (between backward and step) have nothing to wait for until step() releases them.
        self._wait_blocks([b for b in self._inflight if b not in self._held])
        if self._cuda:
            self._settle_migrations()

    def export_trace(self, path) -> str:
        """Writes the recorded iterations (``trace=True``) as Chrome-trace JSON; returns the path."""
        if not self._settings["trace"]:
            raise RuntimeError("tracing is off: create HybridAdamW(..., trace=True)")
        if self.timeline is None:
            raise RuntimeError("nothing traced yet: the timeline starts at the first step")
        self.synchronize()
        return self.timeline.export(path)

    # ---- torch.optim.Optimizer API ----------------------------------------------------------------

    def _validate_group_values(self):
        for i, g in enumerate(self.param_groups):
            try:
                _checks.adamw_hparams(step=1, lr=g["lr"], betas=g["betas"], eps=g["eps"],
                                      weight_decay=g["weight_decay"], grad_scale=1.0)
            except (TypeError, ValueError) as e:
                raise type(e)(f"param_groups[{i}]: {e}") from None

    def _global_norm(self) -> float | None:
        """This step's global gradient 2-norm before any multiplier (None without gradients), computed
        once: the parts of blocks whose gradients were released, and the gradients still there."""
        if self._grad_norm is None:
            grads = [p.grad for b in range(len(self._blocks)) if not (self.release_grads and self._submitted[b])
                     for p in self._blocks[b] if p.grad is not None]
            parts = list(self._sq_parts)
            if grads:
                parts.append(self._sq_norm(grads))
            if parts:
                self._grad_norm = math.sqrt(float(torch.stack(parts).sum()))
        return self._grad_norm

    def _multiplier(self, grad_scale):
        inv = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        max_norm = self._clip_request if self._clip_request is not None else self.max_grad_norm
        if max_norm is None or self._global_norm() is None:
            return inv
        total = self._global_norm() * inv
        self.last_grad_norm = total
        if not math.isfinite(total):
            return total  # refused by step(): clipping by a non-finite norm would poison every weight
        return inv * min(1.0, max_norm / (total + 1e-6))

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """Clips this step's gradients to a global 2-norm of ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_(parameters, max_norm)`` called between backward and step(),
        and returns the norm before clipping (a 0-d tensor). The clip factor is applied inside the
        coming update instead of rescaling ``.grad``, so the updates handed off during backward keep
        their overlap (speculative results are adopted when the factor is 1). The integrations in
        :mod:`hytrain.integrations` route the training loops' clipping here. ``max_norm=inf`` only
        measures the norm. ``foreach`` is accepted for signature compatibility and ignored."""
        if not (isinstance(max_norm, (int, float)) and math.isinf(max_norm) and max_norm > 0):
            max_norm = _checks.real("max_norm", max_norm, lo=0.0, lo_open=True)  # inf: the norm only
        if float(norm_type) != 2.0:
            raise ValueError(f"HybridAdamW.clip_grad_norm_ supports norm_type=2 only, got {norm_type!r}")
        if self.bound and not self._deferred() and any(self._submitted):
            raise RuntimeError("clip_grad_norm_ was called after the updates had started during backward "
                               "(release_grads=True without max_grad_norm): create HybridAdamW with "
                               "max_grad_norm=... to clip, or with release_grads=False")
        total = self._global_norm()
        total = 0.0 if total is None else total
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"the total norm of the gradients is {total}: non-finite, so it cannot be clipped")
        self._clip_request = max_norm
        return torch.tensor(total)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._validate_group_values()
        try:
            if not self.bound:
                self._bind()
            grad_scale = getattr(self, "grad_scale", None)
            found_inf = getattr(self, "found_inf", None)
            if grad_scale is not None or found_inf is not None:
                if not self._loss_scaling and any(self._submitted):
                    self._drop_held()
                    raise RuntimeError("a GradScaler started driving HybridAdamW after updates had begun "
                                       "overlapping backward; create the optimizer with loss scaling in use "
                                       "from the first step")
                self._loss_scaling = True
            if found_inf is not None and float(found_inf) != 0.0:
                return loss  # overflow: skip the step entirely, state untouched (torch's behaviour)
            mult = self._multiplier(grad_scale)
            if not math.isfinite(mult):
                self._drop_held()
                raise RuntimeError(f"the gradient multiplier is {mult} (non-finite gradient norm)")
            changed = self._changed_blocks()
            # Forward order (the next forward needs block 0 first), offloaded blocks first so that
            # their copies start before the GPU updates queue up on the compute stream.
            n = len(self._blocks)
            if self._meter is not None:
                self._meter.launched()
            clipped = mult != 1.0 or bool(changed)
            if mult == 1.0:
                self._adopt(keep=changed)
            for b in sorted(range(n), key=lambda b: (self._on_gpu[b], b)):
                if b in changed and b in self._held:
                    self._restage(b, mult)
                elif b in self._held:
                    held = self._held.pop(b)
                    if self._on_gpu[b]:
                        self._gpu_update(b, [(p, None) for p in held], mult)
                    else:
                        self._pipeline.release(b, mult)
                elif not self._submitted[b]:
                    self._launch(b, mult, release=False)
            for b in sorted(self._speculated):  # after the GPU updates: these may wait on the host
                if b in changed:
                    self._restage(b, mult)
                else:
                    self._redo(b, mult)
            self._steps_taken += 1
            self._last_clipped = clipped
            if self._meter is not None:
                self._schedule(self._meter.end_iteration())
            if self._scheduler is None or self.speculate != "auto":
                self._speculate_from(self._speculation_floor())
            if not self._model_hooks or not self.overlap:
                self.synchronize()
        except BaseException:
            if self.bound:
                self._drop_held()  # whatever was not released yet: as before the backward
            if self._meter is not None:
                self._meter.current = None  # a step not taken is not measured
            raise
        finally:
            self._arrivals = [0] * len(self._blocks)
            self._submitted = [False] * len(self._blocks)
            self._sq_parts = []
            self._handed = {}
            self._clip_request = None
            self._grad_norm = None
            if self.timeline is not None:
                self.timeline.current.k = self.gpu_blocks
                self.timeline.next_iteration()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if not set_to_none:
            self.synchronize()  # the workers may still read the gradients being zeroed
        super().zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        if hasattr(self, "_blocks"):
            raise NotImplementedError("HybridAdamW does not support add_param_group after construction; "
                                      "pass every parameter group to the constructor")
        super().add_param_group(param_group)

    def state_dict(self):
        """torch's format, with CPU tensors (GPU-resident blocks are copied into their host state).
        As with torch's optimizers the tensors are the optimizer's own buffers: save or copy them
        before training goes on (a GPU-resident block's host buffers may serve as a speculating
        block's shadows again from the step after next). Before the first step: the settings, and the
        state loaded by load_state_dict if any."""
        if not self.bound:
            out = super().state_dict()
            if self._pending_load is not None:
                out["state"] = self._pending_load["state"]
            return out
        self.synchronize()
        for r in set(self._lent.values()):  # borrowers stop for a step: the donors' buffers hold state
            self._reclaim(r)
        for b in range(len(self._blocks)):
            if self._on_gpu[b]:
                self._sync_host(b)
        return super().state_dict()

    def load_state_dict(self, state_dict):
        """Loads torch-format state (``exp_avg``, ``exp_avg_sq``, ``step``, and ``master`` when saved by
        HybridAdamW) into the existing host buffers; before the first step it is kept and loaded when
        the state is created. Everything is checked before anything changes."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must have 'state' and 'param_groups' (from optimizer.state_dict())")
        self.synchronize()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} param groups, the optimizer has {len(self.param_groups)}")
        index = {}
        for g_saved, g in zip(groups, self.param_groups):
            if len(g_saved["params"]) != len(g["params"]):
                raise ValueError("a saved param group has a different number of parameters")
            for i, p in zip(g_saved["params"], g["params"]):
                index[i] = p
        plan = []
        for i, st in state_dict["state"].items():
            if i not in index:
                raise ValueError(f"state_dict has state for unknown parameter index {i}")
            p = index[i]
            mine = self.state[p] if self.bound else None
            for key, val in st.items():
                if mine is not None and key == "master" and key not in mine and p.dtype == torch.float32:
                    dst = p.data  # fp32 parameters updated in place are their own master
                elif mine is not None and key in mine:
                    dst = mine[key]
                elif mine is None and key in ("step", "master", *_STATE_KEYS):
                    dst = None
                else:
                    raise ValueError(f"parameter {i}: unexpected state {key!r}")
                shape = torch.Size([]) if key == "step" else p.shape
                if not isinstance(val, torch.Tensor) or val.shape != shape:
                    raise ValueError(f"parameter {i}: state {key!r} has shape "
                                     f"{getattr(val, 'shape', None)}, expected {tuple(shape)}")
                if not torch.is_floating_point(val):
                    raise TypeError(f"parameter {i}: state {key!r} must be floating point, got {val.dtype}")
                plan.append((dst, val))
        if not self.bound:
            self._pending_load = {"state": dict(state_dict["state"]), "param_groups": groups}
            self._load_group_values(groups)
            return
        for dst, src in plan:
            dst.copy_(src)
        for b in range(len(self._blocks)):  # GPU-resident blocks: refresh the device copies
            if self._on_gpu[b]:
                for p in self._blocks[b]:
                    st, d = self.state[p], self._dev_state[id(p)]
                    for key in (*_STATE_KEYS, "master"):
                        if key in st:
                            d[key].copy_(st[key])
        self._load_group_values(groups)

    def _load_group_values(self, groups):
        for g_saved, g in zip(groups, self.param_groups):
            for k, v in g_saved.items():
                if k != "params":
                    g[k] = v
