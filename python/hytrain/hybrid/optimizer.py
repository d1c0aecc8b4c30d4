"""HybridAdamW's ``torch.optim`` face: arguments and their checks, ``step``, ``zero_grad``,
``clip_grad_norm_``, ``state_dict`` / ``load_state_dict``, and the public views. The parts it is built
from live beside it, one file each: ``state`` (binding at the first step, the parameter table),
``hooks``, ``launch``, ``residency``, ``speculation``, ``scheduling``."""

from __future__ import annotations

import functools
import math
import weakref

import torch
from torch import nn

from .. import _checks
from .._native import native
from ..blocks import detect_blocks
from ..pool import PinnedPool, physical_memory_bytes
from . import distributed
from .common import STATE_KEYS, is_sharded, local
from .fence import Fence
from .hooks import Hooks, grad_hook
from .launch import Launch
from .residency import Residency
from .scheduling import Scheduling
from .speculation import Speculation
from .state import HostState


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


class HybridAdamW(HostState, Hooks, Residency, Scheduling, Launch, Speculation, torch.optim.Optimizer):
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
        workers: CPU update threads (default: this process's share of the node's cores -- under
            torchrun the cores divided by LOCAL_WORLD_SIZE -- less one, for the training thread).
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

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 max_grad_norm=None, model=None, blocks=None, gpu_blocks="auto",
                 accumulation_steps=1, workers=None, pool=None, overlap=True,
                 bucket_elements=4 << 20, slice_elements=1 << 18, trace=False,
                 gpu_memory_limit=None, schedule_every=1, speculate="auto", host_memory_limit=None,
                 release_grads=None, fence=True):
        _validate_hparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
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
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=bool(amsgrad),
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused)
        _check_flags(defaults, "HybridAdamW")
        self._setup_done = False
        super().__init__(params, defaults)
        self.auto = isinstance(gpu_blocks, str)
        if self.auto and gpu_blocks != "auto":
            raise ValueError(f"gpu_blocks must be an integer >= 0 or 'auto', got {gpu_blocks!r}")
        k = 0 if (gpu_blocks is None or self.auto) else _checks.integer("gpu_blocks", gpu_blocks, lo=0)
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
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(fence, bool):
            raise TypeError(f"fence must be True or False, got {fence!r}")
        self.fence = fence
        # Default: every usable core but one, which the training thread needs to keep the GPU fed.
        n_workers = workers if workers is not None else distributed.default_workers()
        self._settings = dict(pool=pool, workers=_checks.integer("workers", n_workers, lo=1),
                              slice_elements=_checks.integer("slice_elements", slice_elements, lo=1024),
                              trace=bool(trace), model=model if blocks is None else None,
                              blocks=blocks, bucket_elements=bucket_elements)
        self.overlap = bool(overlap)
        self._steps_taken = 0
        self._loss_scaling = False
        self.speculation_counts = {"adopted": 0, "redone": 0}  # speculated block updates, so far
        self.last_grad_norm = None  # the last step's global gradient norm (before clipping), when clipping
        self._parked = {}  # parameter -> saved state of a parameter without state here (frozen)
        self._pending_state = None  # parameter -> state entry, loaded when the state is created
        self._setup()

    def _setup(self):
        """What follows from the param groups: the parameters with state (those that require
        gradients; torch skips the others), blocks, the native runtime and the gradient hooks. Run
        again, with the state carried over, when the set of parameters changes."""
        everything = [p for g in self.param_groups for p in g["params"]]
        _check_param_list(everything)
        self._params = [p for p in everything if p.requires_grad]
        self._frozen = [p for p in everything if not p.requires_grad]
        if not self._params:
            raise ValueError("HybridAdamW got no parameter that requires gradients")
        # FSDP2-sharded parameters: each rank holds the state of its own shards; the norm and the
        # overflow flag are agreed over this group.
        self._shard_group = distributed.shard_group(self._params)
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        self._group_index = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        settings = self._settings
        model = settings["model"]
        self._compiled = model is not None and _is_compiled(model)
        self._blocks = self._make_blocks(self._params, _uncompiled(model), settings["blocks"],
                                         settings["bucket_elements"])
        self._block_of = {}
        for i, b in enumerate(self._blocks):
            for p in b:
                if id(p) in self._block_of:
                    raise ValueError("a parameter appears in two blocks")
                self._block_of[id(p)] = i
        if self.gpu_blocks > len(self._blocks):
            raise ValueError(f"gpu_blocks={self.gpu_blocks} but there are only {len(self._blocks)} blocks")
        self._amsgrad_bound = [bool(g["amsgrad"]) for g in self.param_groups]
        # Each block's phase in a step and its placement: the native runtime (block_runtime.h).
        self._rt = native().BlockRuntime([len(b) for b in self._blocks], self.accumulation_steps)
        self._bound = None  # id(p) -> (device, dtype, shape) the state was created for (first step)
        self._weight_versions = {}  # id(p) -> (address, version) of the weights after our last write
        self._spec_from = None  # blocks >= this (offloaded, with shadows) speculate in the next backward
        self._clip_chain = []  # max_norm of each clip_grad_norm_ call on this step's gradients
        self._clip_prehooks = []  # while clips are pending: hooks that apply them before more gradients
        self._sq_parts = {}  # block -> squared gradient norm of a block handed off early (device scalar)
        self._grad_norm = None  # this step's global gradient norm, once computed
        self._handed = {}  # id(p) -> (gradient, its version) handed off while the caller keeps .grad
        self._hyper_at_handoff = None  # the groups' hyperparameters the speculative passes used
        self.timeline = None
        self._meter = None
        self._scheduler = None
        self._last_summary = {}
        self._prediction = None  # the scheduler's simulated iteration for the k in use
        self._model_hooks = []
        self._layer_hooks = False  # whether each repeated layer waits for its blocks (and is measured)
        self._fence = Fence(self)
        # The optimizer is reached through a weak reference: hooks left on the parameters do not
        # keep a discarded optimizer alive, and do nothing once it is gone.
        ref = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(grad_hook, ref))
                       for p in self._params]
        self._setup_done = True

    def _teardown(self):
        """Undoes _setup and the binding (after a synchronize): hooks off, native objects and state
        dropped."""
        self.synchronize()
        self._fence.disarm(force=True)
        self._remove_clip_prehooks()
        for h in (*self._hooks, *self._model_hooks):
            h.remove()
        self._hooks, self._model_hooks = [], []
        self.state.clear()
        for name in ("_engine", "_pipeline", "_scheduler", "_meter", "_pool", "_table"):
            setattr(self, name, None)
        self.timeline = None
        self._bound = None
        self._setup_done = False

    def _rebuild(self):
        """The set of parameters changed (add_param_group, a frozen parameter that now has a
        gradient): the state of every parameter that has one is carried over (host copies), the
        parts are set up again, and the state is loaded when it is created at the next step."""
        carried = dict(self._parked)
        if self._pending_state:
            carried.update(self._pending_state)
        if self.bound:
            self._host_state_current()
            for p in self._params:
                carried[p] = {k: v.detach().clone() for k, v in self.state[p].items()}
        self._teardown()
        self._setup()
        self._parked = {p: e for p, e in carried.items() if id(p) not in self._index_of}
        self._pending_state = {p: e for p, e in carried.items() if id(p) in self._index_of} or None

    def __del__(self):
        # Work in flight reads and writes memory this object keeps alive: wait for it before going.
        try:
            if getattr(self, "_bound", None) is not None:
                self.synchronize()
        except Exception:  # noqa: BLE001 -- nobody is left to report a failed update to
            pass
        try:
            fence = getattr(self, "_fence", None)
            if fence is not None:
                fence.disarm(force=True)
            for h in (*getattr(self, "_model_hooks", ()), *getattr(self, "_hooks", ())):
                h.remove()
        except Exception:  # noqa: BLE001
            pass

    @property
    def bound(self) -> bool:
        """Whether the state exists (it is created at the first ``step()``, as torch's optimizers do,
        for the device and dtype the parameters have then)."""
        return self._bound is not None

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
        return {"gpu": self._rt.resident(), "moving": sorted(self._mig_events),
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
        if self._rt.any_submitted() or self._rt.any_arrived():
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

    def synchronize(self) -> None:
        """Waits for every queued update and state move (the parameters are then current for the
        current stream)."""
        if not self.bound:
            return
        # Held blocks (between backward and step) have nothing to wait for until step() releases them.
        held = native().BlockPhase.held
        self._wait_blocks([b for b in self._rt.in_flight_blocks() if self._rt.phase(b) != held])
        if self._cuda:
            self._settle_migrations()
        self._fence.disarm()

    def _anything_in_flight(self) -> bool:
        return self.bound and bool(self._rt.in_flight_blocks())

    def _fence_wait(self, blocks) -> None:
        """The fence saw an operation on these blocks' parameters or gradients (see fence.py)."""
        rt, held = self._rt, native().BlockPhase.held
        self._wait_blocks(sorted(b for b in blocks if rt.in_flight(b) and rt.phase(b) != held))

    def export_trace(self, path) -> str:
        """Writes the recorded iterations (``trace=True``) as Chrome-trace JSON; returns the path."""
        if not self._settings["trace"]:
            raise RuntimeError("tracing is off: create HybridAdamW(..., trace=True)")
        if self.timeline is None:
            raise RuntimeError("nothing traced yet: the timeline starts at the first step")
        self.synchronize()
        return self.timeline.export(path)

    def _validate_group_values(self):
        for i, g in enumerate(self.param_groups):
            try:
                _validate_hparams(lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"])
                _check_flags(g, f"param_groups[{i}]")
            except (TypeError, ValueError) as e:
                raise type(e)(f"param_groups[{i}]: {e}") from None
            if self.bound and bool(g["amsgrad"]) != self._amsgrad_bound[i]:
                raise ValueError(f"param_groups[{i}]: amsgrad was switched to {bool(g['amsgrad'])} after the "
                                 f"first step created the state with amsgrad={self._amsgrad_bound[i]}; "
                                 "HybridAdamW cannot change it mid-run (torch's AdamW fails on it too): "
                                 "save the state, and load it into a new optimizer")

    def _global_norm(self) -> float | None:
        """This step's global gradient 2-norm before any multiplier (None without gradients), computed
        once: one squared norm per block -- taken at the hand-off for blocks whose gradients were
        released, now for the others -- summed in block order, so that the result does not depend on
        which blocks were handed off early (a resumed run's first step hands none off). With sharded
        parameters the ranks' sums are added up."""
        if self._grad_norm is None:
            parts = []
            for b in range(len(self._blocks)):
                part = self._sq_parts.get(b)
                if part is None and not (self.release_grads and self._rt.submitted(b)):
                    grads = [g for g in (local(p.grad) for p in self._blocks[b] if p.grad is not None) if g.numel()]
                    part = self._sq_norm(grads) if grads else None
                if part is not None:
                    parts.append(part)
            if self._shard_group is not None:  # every rank's squared norm of its shards, summed
                total = (torch.stack(parts).sum() if parts else
                         torch.zeros((), dtype=torch.float64, device=local(self._params[0]).device))
                self._grad_norm = math.sqrt(float(distributed.all_reduce(total, self._shard_group)))
            elif parts:
                self._grad_norm = math.sqrt(float(torch.stack(parts).sum()))
        return self._grad_norm

    def _chain_coef(self, norm) -> float:
        """The factor of the clips asked for on this step's gradients (clip_grad_norm_ calls), applied
        one after the other as torch's clip_grad_norm_ would have rescaled them."""
        c = 1.0
        for max_norm in self._clip_chain:
            c *= min(1.0, max_norm / (norm * c + 1e-6))
        return c

    def _multiplier(self, grad_scale):
        inv = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        if not self._clip_chain and self.max_grad_norm is None:
            return inv
        norm = self._global_norm()
        if norm is None:
            return inv
        total = norm * inv
        self.last_grad_norm = total
        if not math.isfinite(total):
            return total  # refused by step(): clipping by a non-finite norm would poison every weight
        if self._clip_chain:  # the loop clipped: its clips, not max_grad_norm, as torch would have
            return inv * self._chain_coef(total)
        return inv * min(1.0, self.max_grad_norm / (total + 1e-6))

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """Clips the gradients to a global 2-norm of ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_(parameters, max_norm)`` would, and returns the norm before
        clipping (a 0-d tensor), computed on the gradients of now at every call. The factor is
        applied inside the coming update instead of rescaling ``.grad``, so the updates handed off
        during backward keep their overlap (speculative results are adopted when the factor is 1);
        if more gradients are accumulated before ``step()`` (a clip after each micro-batch), the
        factor is applied to ``.grad`` first, as torch's in-place clip would have been. The
        integrations in :mod:`hytrain.integrations` route the training loops' clipping here.
        ``max_norm=inf`` only measures the norm. ``foreach`` is accepted for signature
        compatibility and ignored."""
        if not (isinstance(max_norm, (int, float)) and math.isinf(max_norm) and max_norm > 0):
            max_norm = _checks.real("max_norm", max_norm, lo=0.0, lo_open=True)  # inf: the norm only
        if float(norm_type) != 2.0:
            raise ValueError(f"HybridAdamW.clip_grad_norm_ supports norm_type=2 only, got {norm_type!r}")
        self._grad_norm = None  # gradients may have been added or changed since the last call
        total = self._global_norm()
        total = 0.0 if total is None else total
        total *= self._chain_coef(total)  # clips asked for earlier on these same gradients
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"the total norm of the gradients is {total}: non-finite, so it cannot be clipped")
        self._clip_chain.append(float(max_norm))
        if not self._clip_prehooks:
            ref = weakref.ref(self)
            self._clip_prehooks = [p.register_hook(functools.partial(_before_more_gradients, ref))
                                   for p in self._params if p.requires_grad]
        return torch.tensor(total)

    def _apply_pending_clips(self):
        """More gradients are about to be accumulated into clipped ones: the clips asked for are
        applied to ``.grad`` now, as torch's in-place clip_grad_norm_ would have done."""
        if not self._clip_chain:
            return
        self._grad_norm = None
        norm = self._global_norm()
        coef = self._chain_coef(norm) if norm is not None and math.isfinite(norm) else 1.0
        self._clip_chain = []
        self._grad_norm = None
        if coef != 1.0:
            grads = [local(p.grad) for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coef)

    def _remove_clip_prehooks(self):
        hooks, self._clip_prehooks = self._clip_prehooks, []
        for h in hooks:
            h.remove()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._fence.disarm()
        self._remove_clip_prehooks()
        self._validate_group_values()
        if any(p.requires_grad and p.grad is not None for p in self._frozen):
            self._rebuild()  # a parameter without state has a gradient now (unfrozen): it gets state
        try:
            if not self.bound:
                self._bind()
            grad_scale = getattr(self, "grad_scale", None)
            found_inf = getattr(self, "found_inf", None)
            if found_inf is not None and self._shard_group is not None:  # skipped on all ranks or none
                found_inf = distributed.all_reduce(found_inf.detach().clone(), self._shard_group, op="max")
            if grad_scale is not None or found_inf is not None:
                if not self._loss_scaling and self._rt.any_submitted():
                    self._drop_held()
                    raise RuntimeError("a GradScaler started driving HybridAdamW after updates had begun "
                                       "overlapping backward; create the optimizer with loss scaling in use "
                                       "from the first step")
                self._loss_scaling = True
            if found_inf is not None and float(found_inf) != 0.0:
                self._drop_held()
                return loss  # overflow: skip the step entirely, state untouched (torch's behaviour)
            mult = self._multiplier(grad_scale)
            if not math.isfinite(mult):
                self._drop_held()
                raise RuntimeError(f"the gradient multiplier is {mult} (non-finite gradient norm)")
            rt, phases = self._rt, native().BlockPhase
            changed = self._changed_blocks()
            rewritten = self._follow_weight_writes() - changed  # speculated from masters now refreshed
            # Every gradient this step reads is checked before anything is applied: a refused step
            # leaves every parameter and state as it was.
            fresh = {b: self._grads(b) for b in range(len(self._blocks)) if not rt.submitted(b) or b in changed}
            # Hyperparameters changed since the hand-offs (an lr set between backward and step()):
            # held passes are released with the new ones, speculative results are redone.
            stale = self._sync_groups()
            if self._meter is not None:
                self._meter.launched()
            clipped = mult != 1.0 or bool(changed)
            if mult == 1.0 and not stale:
                self._adopt(keep=changed | rewritten)
            # Forward order (the next forward needs block 0 first), offloaded blocks first so that
            # their copies start before the GPU updates queue up on the compute stream.
            for b in rt.launch_order():
                phase = rt.phase(b)
                if phase == phases.held:
                    if b in changed:
                        self._restage(b, mult, fresh[b])
                    elif rt.on_gpu(b):
                        self._gpu_update(b, [(self._params[h], None) for h in rt.handed(b)], mult)
                        rt.launch(b)
                    else:
                        self._pipeline.release(b, mult, self._table, rt.handed(b))
                        rt.launch(b)
                elif not rt.submitted(b):
                    self._launch(b, mult, release=False, pairs=fresh[b])
            for b in rt.in_phase(phases.speculated):  # after the GPU updates: these may wait on the host
                if b in changed:
                    self._restage(b, mult, fresh[b])
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
            self._rt.end_step()
        except BaseException:
            if self.bound:
                self._drop_held()  # whatever was not released yet: as before the backward
                try:
                    self.synchronize()  # nothing is left in flight
                except Exception:  # noqa: BLE001 -- the error being raised is the one to report
                    pass
            if self._meter is not None:
                self._meter.current = None  # a step not taken is not measured
            raise
        finally:
            self._rt.abandon_step()
            self._sq_parts = {}
            self._handed = {}
            self._clip_chain = []
            self._grad_norm = None
            if self.timeline is not None:
                self.timeline.current.k = self.gpu_blocks
                self.timeline.next_iteration()
        if self.fence and self._anything_in_flight():
            self._fence.arm()  # updates outlive step(): any other path to the weights waits for them
        return loss

    def zero_grad(self, set_to_none: bool = True):
        self._fence.disarm()
        if not set_to_none:
            self.synchronize()  # the workers may still read the gradients being zeroed
        # Dropping .grad needs no wait: the updates in flight keep the gradients they read alive.
        super().zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        """As torch's: the new group's parameters get state at the next step (the state of the
        others is carried over; the state is created again, so this costs one re-pinning)."""
        super().add_param_group(param_group)
        if self._setup_done:
            self._rebuild()

    def state_dict(self):
        """torch's format, with CPU tensors (GPU-resident blocks are copied into their host state).
        As with torch's optimizers the tensors are the optimizer's own buffers: save or copy them
        before training goes on (a GPU-resident block's host buffers may serve as a speculating
        block's shadows again from the step after next). Parameters without state (never stepped)
        have no entry, as in torch. Before the first step: the settings, and the state loaded by
        load_state_dict if any."""
        if self.bound:
            self._host_state_current()
        out = super().state_dict()
        extra = dict(self._parked)
        if not self.bound and self._pending_state:
            extra.update(self._pending_state)
        if extra:
            index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
            for p, entry in extra.items():
                out["state"][index[id(p)]] = entry
        return out

    def _host_state_current(self):
        """Waits for updates in flight and copies GPU-resident blocks' states into their host state;
        borrowers give the donors' host buffers back for a step (they hold state again)."""
        self.synchronize()
        for r in set(self._lent.values()):
            self._reclaim(r)
        for b in self._rt.resident():
            self._sync_host(b)

    def _refresh_device_copies(self):
        for b in self._rt.resident():  # GPU-resident blocks: the device copies follow the host state
            for p in self._blocks[b]:
                st, d = self.state[p], self._dev_state[id(p)]
                for key in (*STATE_KEYS, "master"):
                    if key in st:
                        d[key].copy_(st[key])

    def sharded_state_dict(self) -> dict:
        """The state for ``torch.distributed.checkpoint`` (``dcp.save`` / ``dcp.load``): ``{"state":
        {index: {key: tensor}}, "param_groups": [...]}``. The tensors are the optimizer's own host
        buffers; for sharded (FSDP2) parameters they are DTensors over the parameters' mesh, each
        rank's buffer its own shard of the global tensor, so a save writes every rank's shard once
        and a load -- at this or another world size -- reads each rank's shard straight into its
        buffers. ``step`` is a plain (replicated) tensor. Call :meth:`load_sharded_state_dict` with
        the dict after ``dcp.load``. Creates the state if the first step has not (the parameters
        must be where they will train)."""
        if not self.bound:
            self._validate_group_values()
            self._bind()
        self._host_state_current()
        state = {}
        for i, p in enumerate(self._params):
            st = self.state[p]
            entry = {"step": st["step"]}
            for key in ("master", *STATE_KEYS):
                if key in st:
                    entry[key] = self._as_global(p, st[key])
            state[i] = entry
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def _as_global(self, p, buf):
        """The host buffer as a DTensor over the parameter's ranks (a mesh of host tensors: the
        buffer itself is the local shard, nothing is copied)."""
        if not is_sharded(p):
            return buf
        from torch.distributed.tensor import DTensor

        out = DTensor.from_local(buf, distributed.host_mesh(p.device_mesh), p.placements, run_check=False,
                                 shape=p.shape, stride=p.stride())
        assert out.to_local().data_ptr() == buf.data_ptr() or not buf.numel()
        return out

    def load_sharded_state_dict(self, state_dict) -> None:
        """Completes a resume from ``dcp.load(sd, ...)`` where ``sd`` came from
        :meth:`sharded_state_dict`: the tensors are normally the optimizer's buffers, filled in place
        (any that are not -- replaced in the dict -- are copied in after the same checks as
        ``load_state_dict``); this applies the param groups' hyperparameters and refreshes the device
        copies of GPU-resident blocks."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("expected the dict from sharded_state_dict() (after dcp.load)")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the checkpoint has {len(groups)} param groups, the optimizer has "
                             f"{len(self.param_groups)}")
        if not self.bound:
            raise RuntimeError("load_sharded_state_dict needs the dict of this optimizer's sharded_state_dict()")
        plan = []
        for i, entry in state_dict["state"].items():
            if not isinstance(i, int) or not 0 <= i < len(self._params):
                raise ValueError(f"the checkpoint has state for unknown parameter index {i!r}")
            p = self._params[i]
            st = self.state[p]
            for key, val in entry.items():
                if key not in st:
                    raise ValueError(f"parameter {i}: unexpected state {key!r}")
                val, dst = local(val), st[key]
                _check_state_value(i, key, val, dst.shape)
                if val.numel() and val.data_ptr() != dst.data_ptr():
                    plan.append((dst, val))
        for dst, val in plan:
            dst.copy_(val)
        self._refresh_device_copies()
        self._load_group_values(groups)

    def load_state_dict(self, state_dict):
        """torch's semantics: the param groups' values are applied at once; the state is replaced --
        each parameter's entry loaded into its host buffers (``exp_avg``, ``exp_avg_sq``, ``step``,
        and ``master`` when saved by HybridAdamW), and a parameter without an entry starts afresh,
        as torch's AdamW would. Before the first step the state is kept and loaded when it is
        created. Everything is checked before anything changes."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must have 'state' and 'param_groups' (from optimizer.state_dict())")
        self.synchronize()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} param groups, the optimizer has {len(self.param_groups)}")
        index = {}
        for gi, (g_saved, g) in enumerate(zip(groups, self.param_groups)):
            if len(g_saved["params"]) != len(g["params"]):
                raise ValueError(f"saved param group {gi} has {len(g_saved['params'])} parameters, the "
                                 f"optimizer's has {len(g['params'])}")
            if self.bound and bool(g_saved.get("amsgrad", False)) != self._amsgrad_bound[gi]:
                raise ValueError(f"saved param group {gi} has amsgrad={bool(g_saved.get('amsgrad', False))}, but "
                                 f"this optimizer's state was created with amsgrad={self._amsgrad_bound[gi]}: load "
                                 "it into a new HybridAdamW before its first step")
            for i, p in zip(g_saved["params"], g["params"]):
                index[i] = p
        entries = {}
        for i, st in state_dict["state"].items():
            if i not in index:
                raise ValueError(f"state_dict has state for unknown parameter index {i}")
            p = index[i]
            entry = {}
            for key, val in st.items():
                if key not in ("step", "master", *STATE_KEYS):
                    raise ValueError(f"parameter {i}: unexpected state {key!r}")
                if key == "step" and not isinstance(val, torch.Tensor):
                    val = torch.tensor(float(_checks.real(f"parameter {i}: step", val, lo=0.0)))
                _check_state_value(i, key, val, torch.Size([]) if key == "step" else local(p).shape)
                entry[key] = val
            entries[p] = entry
        active = {id(p) for p in self._params}
        if self.bound:
            self._load_entries({p: e for p, e in entries.items() if id(p) in active}, reset_missing=True)
        else:
            self._pending_state = {p: e for p, e in entries.items() if id(p) in active} or None
        self._parked = {p: e for p, e in entries.items() if id(p) not in active}
        self._load_group_values(groups)

    def _load_group_values(self, groups):
        """As torch: each group becomes the saved one (with our parameters), missing keys from the
        defaults."""
        for g_saved, g in zip(groups, self.param_groups):
            params = g["params"]
            g.clear()
            g.update({k: v for k, v in g_saved.items() if k != "params"})
            g["params"] = params
            for k, v in self.defaults.items():
                g.setdefault(k, v)

    def _load_entries(self, entries, *, reset_missing):
        """Copies loaded state entries (parameter -> {key: tensor}, checked) into the host buffers;
        with ``reset_missing`` the parameters without an entry start afresh (step 0, zero moments,
        the master from the weights)."""
        plan = []
        for p in self._params:
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
                        raise ValueError(f"parameter {self._index_of[id(p)]}: unexpected state 'master'")
                    dst = local(p)  # fp32 parameters updated in place are their own master
                elif key in mine:
                    dst = mine[key]
                else:
                    raise ValueError(f"parameter {self._index_of[id(p)]}: state {key!r} does not fit this "
                                     "optimizer (amsgrad differs?)")
                plan.append((dst, val))
        with torch.no_grad():
            for dst, src in plan:
                if src is None:
                    dst.zero_()
                else:
                    dst.copy_(local(src))
        self._refresh_device_copies()
        self._note_weight_versions()  # the loaded masters are what the next update starts from

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


def _before_more_gradients(ref, grad):
    """A parameter's pre-accumulation hook while clips are pending (see clip_grad_norm_)."""
    opt = ref()
    if opt is not None:
        opt._apply_pending_clips()


def _scalar(name, x) -> float:
    """A hyperparameter: a real number, or a one-element tensor (torch accepts both)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(x.shape)}")
        return float(x)
    return x


def _validate_hparams(*, lr, betas, eps, weight_decay):
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError("betas must be either both floats or both Tensors")
    _checks.adamw_hparams(step=1, lr=_scalar("lr", lr), betas=tuple(_scalar("beta", b) for b in betas),
                          eps=_scalar("eps", eps), weight_decay=_scalar("weight_decay", weight_decay),
                          grad_scale=1.0)


# torch.optim.AdamW's implementation switches: values that change nothing here are accepted.
_REFUSED_FLAGS = {
    "capturable": "HybridAdamW does not support capturable=True (its step is not CUDA-graph capturable)",
    "differentiable": "HybridAdamW does not support differentiable=True (its update is not part of autograd)",
}


def _check_flags(group, where) -> None:
    for name, why in _REFUSED_FLAGS.items():
        if group.get(name):
            raise ValueError(f"{where}: {why}")
    if not isinstance(group.get("maximize", False), bool):
        raise TypeError(f"{where}: maximize must be True or False, got {group.get('maximize')!r}")
    if group.get("foreach") not in (None, True, False) or group.get("fused") not in (None, True, False):
        raise TypeError(f"{where}: foreach and fused must be None, True or False")


def _is_compiled(model) -> bool:
    """Whether the model runs through torch.compile: an OptimizedModule, or compiled in place."""
    return type(model).__name__ == "OptimizedModule" or getattr(model, "_compiled_call_impl", None) is not None


def _uncompiled(model):
    return getattr(model, "_orig_mod", model) if model is not None and _is_compiled(model) else model


def _check_state_value(i, key, val, shape) -> None:
    """A loaded state tensor must have the shape of the buffer it goes into and a floating dtype."""
    if key == "step" and isinstance(val, torch.Tensor) and val.numel() == 1:
        shape = val.shape  # torch keeps step as a 0-d tensor; older checkpoints as one element
    if not isinstance(val, torch.Tensor) or val.shape != shape:
        raise ValueError(f"parameter {i}: state {key!r} has shape {getattr(val, 'shape', None)}, "
                         f"expected {tuple(shape)}")
    if not torch.is_floating_point(val):
        raise TypeError(f"parameter {i}: state {key!r} must be floating point, got {val.dtype}")
