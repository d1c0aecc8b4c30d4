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
        # FSDP2-sharded parameters: each rank holds the state of its own shards; the norm and the
        # overflow flag are agreed over this group.
        self._shard_group = distributed.shard_group(self._params)
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
        n_workers = workers if workers is not None else distributed.default_workers()
        self._settings = dict(pool=pool, workers=_checks.integer("workers", n_workers, lo=1),
                              slice_elements=_checks.integer("slice_elements", slice_elements, lo=1024),
                              trace=bool(trace), model=model if blocks is None else None)
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.overlap = bool(overlap)
        # Each block's phase in a step and its placement: the native runtime (block_runtime.h).
        self._rt = native().BlockRuntime([len(b) for b in self._blocks], self.accumulation_steps)
        self._steps_taken = 0
        self._bound = None  # id(p) -> (device, dtype, shape) the state was created for (first step)
        self._pending_load = None  # a state_dict loaded before the state exists
        self._spec_from = None  # blocks >= this (offloaded, with shadows) speculate in the next backward
        self._clip_request = None  # max_norm of a clip_grad_norm_ call for the coming step
        self._sq_parts = {}  # block -> squared gradient norm of a block handed off early (device scalar)
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
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(grad_hook, ref))
                       for p in self._params]

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
                _checks.adamw_hparams(step=1, lr=g["lr"], betas=g["betas"], eps=g["eps"],
                                      weight_decay=g["weight_decay"], grad_scale=1.0)
            except (TypeError, ValueError) as e:
                raise type(e)(f"param_groups[{i}]: {e}") from None

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
        if self.bound and not self._deferred() and self._rt.any_submitted():
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
                return loss  # overflow: skip the step entirely, state untouched (torch's behaviour)
            mult = self._multiplier(grad_scale)
            if not math.isfinite(mult):
                self._drop_held()
                raise RuntimeError(f"the gradient multiplier is {mult} (non-finite gradient norm)")
            changed = self._changed_blocks()
            # Forward order (the next forward needs block 0 first), offloaded blocks first so that
            # their copies start before the GPU updates queue up on the compute stream.
            if self._meter is not None:
                self._meter.launched()
            clipped = mult != 1.0 or bool(changed)
            if mult == 1.0:
                self._adopt(keep=changed)
            rt, phases = self._rt, native().BlockPhase
            for b in rt.launch_order():
                phase = rt.phase(b)
                if phase == phases.held:
                    if b in changed:
                        self._restage(b, mult)
                    elif rt.on_gpu(b):
                        self._gpu_update(b, [(self._params[h], None) for h in rt.handed(b)], mult)
                        rt.launch(b)
                    else:
                        self._pipeline.release(b, mult)
                        rt.launch(b)
                elif not rt.submitted(b):
                    self._launch(b, mult, release=False)
            for b in rt.in_phase(phases.speculated):  # after the GPU updates: these may wait on the host
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
            self._rt.end_step()
        except BaseException:
            if self.bound:
                self._drop_held()  # whatever was not released yet: as before the backward
            if self._meter is not None:
                self._meter.current = None  # a step not taken is not measured
            raise
        finally:
            self._rt.abandon_step()
            self._sq_parts = {}
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
        self._host_state_current()
        return super().state_dict()

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
                    dst = local(p)  # fp32 parameters updated in place are their own master
                elif mine is not None and key in mine:
                    dst = mine[key]
                elif mine is None and key in ("step", "master", *STATE_KEYS):
                    dst = None
                else:
                    raise ValueError(f"parameter {i}: unexpected state {key!r}")
                _check_state_value(i, key, val, torch.Size([]) if key == "step" else local(p).shape)
                plan.append((dst, val))
        if not self.bound:
            self._pending_load = {"state": dict(state_dict["state"]), "param_groups": groups}
            self._load_group_values(groups)
            return
        for dst, src in plan:
            dst.copy_(src)
        self._refresh_device_copies()
        self._load_group_values(groups)

    def _load_group_values(self, groups):
        for g_saved, g in zip(groups, self.param_groups):
            for k, v in g_saved.items():
                if k != "params":
                    g[k] = v

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


def _check_state_value(i, key, val, shape) -> None:
    """A loaded state tensor must have the shape of the buffer it goes into and a floating dtype."""
    if not isinstance(val, torch.Tensor) or val.shape != shape:
        raise ValueError(f"parameter {i}: state {key!r} has shape {getattr(val, 'shape', None)}, "
                         f"expected {tuple(shape)}")
    if not torch.is_floating_point(val):
        raise TypeError(f"parameter {i}: state {key!r} must be floating point, got {val.dtype}")
