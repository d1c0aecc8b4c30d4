"""HybridAdamW, the ``torch.optim`` face: arguments and their checks, ``param_groups``, ``step``,
``zero_grad``, ``clip_grad_norm_``, ``state_dict`` / ``load_state_dict``, ``synchronize`` and the public
views. It owns one :class:`~hytrain.hybrid.engine.Engine` and delegates to it; the parts the engine is
built from live beside it, one file each (see engine.py)."""

from __future__ import annotations

import math

import torch

from .. import _checks
from . import state_dicts
from .engine import Engine
from .settings import SETTINGS_VIEWS, check_flags, check_group_values, settings, validate_hparams, view


class HybridAdamW(torch.optim.Optimizer):
    """AdamW with host-resident fp32 master weights and states, updated by native CPU workers.

    Args:
        params: parameters (fp32, bf16 or fp16, leaves, all on the CPU or all on one CUDA device) or
            param-group dicts.
        lr, betas, eps, weight_decay, amsgrad: as ``torch.optim.AdamW``, eps=0 too (its group keys: settings.py).
        max_grad_norm: global-norm clipping of the (unscaled) gradients, as ``clip_grad_norm_``;
            each step's norm before clipping is then in ``last_grad_norm``.
        model: the module the parameters belong to; enables block detection and just-in-time waits.
        blocks: explicit blocks, each a module or a list of parameters (forward order).
        gpu_blocks: k, the number of leading blocks (forward order) updated on the GPU by the fused
            CUDA AdamW with their states resident there (CUDA parameters only; see
            :meth:`set_gpu_blocks`), or ``"auto"`` (the default): the native ``KSplitScheduler``
            starts with as many blocks on the GPU as fit beside the first step's peak, then chooses
            k every ``schedule_every`` steps from costs measured on the compute stream (this needs
            ``model``; otherwise k stays; k = 0 on the CPU). A resident
            block's state is on the GPU only; k never goes below the blocks the host cannot hold,
            and a state that fits on neither side raises :class:`hytrain.CapacityError` first.
        gpu_memory_limit: bytes of GPU memory the process may use (default: the device's memory, or
            its per-process fraction when set); the scheduler's budget for resident states is this
            less the largest non-state use seen, less a margin.
        schedule_every: how often (in steps) the scheduler may change k.
        speculate: offloaded blocks updated during backward under clipping (see the module notes):
            ``"auto"`` (the default; the scheduler picks from which block on, where it shortens the
            iteration), an int s (blocks >= s, whenever the previous step did not clip; True: 0),
            or False. Each speculated parameter needs a second fp32 master, m and v (and staging for
            its new weights) in pinned memory, allocated within ``host_memory_limit``.
        host_memory_limit: bytes of host memory the process may use before speculation stops
            allocating (default: 75 % of the machine's memory, which leaves room for the rest of
            the process, page cache and the system).
        accumulation_steps: micro-batches per step; blocks are updated after the last one.
        state_format: ``"fp32"`` (default); ``"bf16"``: m and v stochastically rounded to bfloat16 (8 bytes of
            state per parameter, not 12); ``"8bit"``: blockwise-quantised m and v (about 6). Neither with amsgrad.
        workers: CPU update threads (default: this process's share of the node's cores -- under
            torchrun the cores divided by LOCAL_WORLD_SIZE -- less one, for the training thread, and at
            most 32 for each NUMA node it runs on: the memory bandwidth binds before that).
        pool: a :class:`hytrain.PinnedPool` for master weights, states and staging (default: a new one).
        overlap: False updates everything inside ``step()`` and waits for it there (what overlap
            buys, for benchmarks).
        trace: record a timeline of recent iterations (:meth:`export_trace`): True keeps the last 3, an
            integer that many.
        release_grads: whether ``.grad`` may be released once a block's gradients are handed off
            during backward. Default: True with ``max_grad_norm`` (the optimizer clips), else False
            (the loop may clip or rescale them before ``step()``; see the module notes). True
            without ``max_grad_norm`` promises that nothing reads or changes the gradients after
            backward, and updates blocks while backward goes on.
        watch_writes: writes to the weights between steps are seen however they are made (``.data``,
            raw pointers, other threads; see ``hybrid/writes.py``): the next update starts from the
            written weights, as torch's does. False sees only writes that move the parameters'
            version counters (in-place operations on them, ``load_state_dict``), and saves two reads
            of the weights per step.
        fence: where updates outlive ``step()`` (``model=`` with ``overlap``), True (the default) keeps torch's
            promise that whatever comes after it sees the updated values: while a block is in flight, a
            ``TorchFunctionMode`` on the training thread makes each torch operation on one of its parameters (or a
            view, or an FSDP2 shard of one), on a gradient its update still reads or on its ``optimizer.state`` wait
            for that block first (an EMA of the weights, ``load_state_dict``, a weight used outside its layer);
            metadata (shape, ``.grad`` itself) never waits, and other threads, ``DisableTorchFunction`` code and raw
            pointers are not seen. False leaves only the forward hooks (each block waited for before its layer
            runs): for loops that touch the weights only through forward and the state through ``state_dict()`` or
            after ``synchronize()``, as ``hytrain train`` does; it saves about 6 us per operation while a block is
            in flight (docs/performance.md).
    """

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale/found_inf instead of unscaling

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 max_grad_norm=None, model=None, blocks=None, gpu_blocks="auto",
                 accumulation_steps=1, workers=None, pool=None, overlap=True,
                 bucket_elements=4 << 20, slice_elements=1 << 18, trace=False,
                 gpu_memory_limit=None, schedule_every=1, speculate="auto", host_memory_limit=None,
                 release_grads=None, fence=True, state_format="fp32", watch_writes=True):
        validate_hparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._settings = settings(
            max_grad_norm=max_grad_norm, release_grads=release_grads, accumulation_steps=accumulation_steps,
            gpu_blocks=gpu_blocks, schedule_every=schedule_every, gpu_memory_limit=gpu_memory_limit,
            speculate=speculate, host_memory_limit=host_memory_limit, fence=fence, overlap=overlap,
            workers=workers, slice_elements=slice_elements, trace=trace, pool=pool, model=model, blocks=blocks,
            bucket_elements=bucket_elements, state_format=state_format, watch_writes=watch_writes)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=bool(amsgrad),
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused, decoupled_weight_decay=True)
        check_flags(defaults, "HybridAdamW")
        self._engine = None
        super().__init__(params, defaults)
        check_group_values(self.param_groups, state_format=state_format)
        self._engine = Engine(self.param_groups, self.state, self._settings)

    def _follow_params(self):
        """A parameter swapped in the groups (accelerate's FSDP2 preparation), or one without state with a
        gradient now: a new engine over the groups as they are."""
        engine = self._engine
        if engine.plan.stale(self.param_groups) or any(p.grad is not None for p in engine.plan.frozen):
            self._rebuild()

    def _rebuild(self):
        """The set of parameters changed (add_param_group, an unfrozen parameter): a new engine, with
        every state carried over (copies) and loaded when the state is made at the next step."""
        self._engine.reconcile(self.state)
        carried = {**{p: e for p, e in self.state.items() if e}, **self._engine.carry()}
        self._engine.close()
        self._engine = Engine(self.param_groups, self.state, self._settings)
        self._engine.take(carried)

    def __del__(self):  # work in flight uses memory the engine keeps alive: wait for it, drop the hooks
        try:
            if getattr(self, "_engine", None) is not None:
                self._engine.close()
        except Exception:  # noqa: BLE001 -- nobody is left to report a failed update to
            pass

    def __getstate__(self):
        raise TypeError("a HybridAdamW cannot be pickled or copied: its state lives in pinned memory that "
                        "native workers update; save optimizer.state_dict() and load it into a new HybridAdamW")

    # -- the views ------------------------------------------------------------------------------------

    def __getattr__(self, name):  # the settings read as attributes (_SETTINGS_VIEWS)
        if name in SETTINGS_VIEWS:
            return getattr(self.__dict__["_settings"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    bound = view("bound", "Whether the state exists (it is created at the first ``step()``, as torch's "
                  "optimizers do, for the device and dtype the parameters have then).")
    device = view("store.device", "The parameters' device, once the state exists.")
    scheduler = view("planner.scheduler", "The native ``KSplitScheduler`` (for inspection: ``costs()``, "
                      "``predict(k)``), or None: it exists on CUDA with a model, from the first step on.")
    gpu_memory_limit = view("planner.gpu_memory_limit", "The GPU memory the planner budgets within (bytes).")
    timeline = view("timeline", "The recorded iterations (``trace=True``), from the first step on.")
    speculation_counts = view("speculation_counts", "Speculated block updates so far: adopted and redone.")
    state_format = view("settings.state_format", "The format of m and v: 'fp32', 'bf16', '8bit' (at construction).")
    last_grad_norm = view("intake.last_grad_norm", "The last step's global gradient norm before clipping "
                           "(when clipping), else None.")

    @property
    def blocks(self) -> list[list[torch.nn.Parameter]]:
        """The blocks, in forward order: the parameters updated together (a copy of the lists)."""
        return [list(b) for b in self._engine.plan.blocks]

    def residency(self) -> dict:
        """Where the states are: ``gpu`` (resident blocks; their state is on the GPU only), ``moving``
        (blocks in an asynchronous move), ``floor`` (k's lowest: the host holds blocks >= it), and the
        bytes of state on each side (``host_bytes`` with staging) and of ``shadow_bytes``."""
        return self._engine.residency()

    def schedule_stats(self) -> dict:
        """What the scheduler saw and predicts: k, the predicted iteration (``predicted_iter_s``,
        ``predicted_gpu_idle_s``), the measured compute-stream iteration and the share of it spent
        waiting for updated weights (``gpu_wait_frac``), and the memory budget for resident states;
        where speculation starts (``speculative_from``), the shadows made (``shadow_allocations``:
        blocks, seconds, per step that made some), locked at the first step (``shadows_ahead``), and
        the page-locking and giving back done for them (``shadow_pool_work``: kind, start, end in
        ``time.perf_counter()`` seconds, bytes)."""
        return self._engine.planner.stats()

    def set_gpu_blocks(self, k: int, *, wait: bool = True) -> None:
        """Makes the first ``k`` blocks (forward order) GPU-updated, moving their fp32 master weights
        and Adam states to the device, and the others CPU-updated (states back in pinned memory).
        Call between steps. ``wait=True`` returns with the move complete; ``wait=False`` only starts
        it, as the scheduler does. The results do not depend on k (both AdamW kernels agree bit for
        bit). With ``gpu_blocks="auto"`` the scheduler may change k again. Before the first step this
        only records k (the state does not exist yet)."""
        k = _checks.integer("gpu_blocks", k, lo=0)
        if k > len(self._engine.plan):
            raise ValueError(f"gpu_blocks={k} but there are only {len(self._engine.plan)} blocks")
        self._engine.set_gpu_blocks(k, wait)

    def synchronize(self) -> None:
        """Waits for every queued update and state move (the parameters are then current for the
        current stream)."""
        self._engine.synchronize()

    def export_trace(self, path) -> str:
        """Writes the recorded iterations (``trace=True``) as Chrome-trace JSON; returns the path."""
        if not self._settings.trace:
            raise RuntimeError("tracing is off: create HybridAdamW(..., trace=True)")
        if self._engine.timeline is None:
            raise RuntimeError("nothing traced yet: the timeline starts at the first step")
        self.synchronize()
        return self._engine.timeline.export(path)

    # -- the step -------------------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, *, loss_scale=None):
        """Clips the gradients to a global 2-norm of ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_(parameters, max_norm)`` would, and returns the norm before
        clipping (a 0-d tensor), computed on the gradients of now at every call. The factor is
        applied inside the coming update instead of rescaling ``.grad``, so the updates handed off
        during backward keep their overlap (speculative results are adopted when the factor is 1);
        if more gradients are accumulated before ``step()`` (a clip after each micro-batch), the
        factor is applied to ``.grad`` first, as torch's in-place clip would have been. The
        integrations in :mod:`hytrain.integrations` route the training loops' clipping here.
        ``max_norm=inf`` only measures the norm. ``foreach`` is accepted for signature
        compatibility and ignored. ``loss_scale``: the gradients are still scaled by this (a
        GradScaler's ``get_scale()``, which leaves the unscaling to this optimizer's step): the norm
        returned and clipped is that of the unscaled gradients, as after ``scaler.unscale_``, without
        rewriting ``.grad`` (which keeps the hand-offs under loss scaling)."""
        if not (isinstance(max_norm, (int, float)) and math.isinf(max_norm) and max_norm > 0):
            max_norm = _checks.real("max_norm", max_norm, lo=0.0, lo_open=True)  # inf: the norm only
        if float(norm_type) != 2.0:
            raise ValueError(f"HybridAdamW.clip_grad_norm_ supports norm_type=2 only, got {norm_type!r}")
        scale = 1.0 if loss_scale is None else _checks.real("loss_scale", loss_scale, lo=0.0, lo_open=True)
        self._follow_params()  # (parameters swapped in the groups since: their gradients are the ones clipped)
        return torch.tensor(self._engine.intake.clip(max_norm, error_if_nonfinite, scale))

    @torch.no_grad()
    def step(self, closure=None):
        """As ``torch.optim.AdamW.step``: updates every parameter with a gradient and returns ``closure()``'s loss
        (None without one); the first call creates the state. The clip factor and a GradScaler's scale are applied
        inside the update, a step whose gradients overflowed is skipped, and one that raises changes nothing. With
        ``model=`` (and ``overlap``) it returns while the updates run, the forward hooks and the fence waiting for
        them; otherwise once they are done."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self._engine
        engine.resume(self.state)
        engine.intake.remove_clip_prehooks()
        check_group_values(self.param_groups, engine.store.amsgrad_bound if engine.bound else None,
                           self._settings.state_format)
        self._follow_params()
        self._engine.step(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        return loss

    def zero_grad(self, set_to_none: bool = True):
        """As torch's: ``set_to_none=True`` (the default) drops each ``.grad`` at once (updates in flight keep what they
        read); ``set_to_none=False`` zeroes them in place after :meth:`synchronize` (updates in flight read them)."""
        self._engine.resume(self.state)
        if not set_to_none:
            self.synchronize()  # the workers may still read the gradients being zeroed
        # Dropping .grad needs no wait: the updates in flight keep the gradients they read alive.
        super().zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        """As torch's: the new group's parameters get state at the next step (the state of the
        others is carried over; the state is created again, so this costs one re-pinning)."""
        super().add_param_group(param_group)
        if self._engine is not None:
            self._rebuild()

    # -- state ----------------------------------------------------------------------------------------

    def state_dict(self):
        """torch's format. As with torch's optimizers the tensors are the optimizer's own buffers,
        where the state lives: pinned host tensors for blocks the CPU updates, GPU tensors for
        GPU-resident blocks (as torch's AdamW keeps the state of CUDA parameters); save or copy them
        before training goes on (a speculating block's buffers change places with its shadows).
        Between backward and step() it is the state before the step, as torch's would be.
        Parameters without state (never stepped) have no entry, as in torch. Before the first step:
        the settings, and the state loaded by load_state_dict if any, in this optimizer's format.
        FSDP2-sharded parameters' entries are DTensors, as torch's AdamW's are: those of
        :meth:`sharded_state_dict` (each rank's buffers its shards), which torch's ``get_state_dict``
        and ``dcp.save`` write shard by shard."""
        state_dicts.run_hooks(self._optimizer_state_dict_pre_hooks, self)
        engine = self._engine
        engine.reconcile(self.state, wait=True)
        extra = {}
        if not engine.bound and engine.pending:  # as torch: in the format the state takes when loaded
            extra.update(state_dicts.in_format(engine.pending, self.state_format))
        out = state_dicts.with_entries(state_dicts.torch_state_dict(self), extra, self.param_groups)
        if engine.shard_group is not None and engine.bound:  # FSDP2 shards: DTensors, as torch's AdamW's
            out = state_dicts.as_shards(out, engine.plan.params, self.state, self.param_groups, self.state_format)
        return state_dicts.run_hooks(self._optimizer_state_dict_post_hooks, self, out)

    def sharded_state_dict(self, state_format=None) -> dict:
        """The state for ``torch.distributed.checkpoint`` (``dcp.save`` / ``dcp.load``): ``{"state":
        {index: {key: tensor}}, "param_groups": [...]}``, the tensors the optimizer's own buffers (host,
        or GPU for resident blocks); for FSDP2 shards DTensors over the parameters' mesh, each rank's
        buffer its own shard, so a save writes every shard once and a load -- at any world size --
        reads each shard straight into its buffers (8-bit m and v: see ``state_dicts.sharded``).
        ``state_format``: to load a checkpoint of another format, m and v in its layout (converted by
        :meth:`load_sharded_state_dict`). Creates the state if the first step has not."""
        engine = self._engine
        engine.reconcile(self.state)
        if not engine.bound:
            check_group_values(self.param_groups)
            engine.bind()
        engine.synchronize()
        return state_dicts.sharded(engine.plan.params, self.state, self.param_groups, self.state_format, state_format)

    def load_sharded_state_dict(self, state_dict) -> None:
        """Completes a resume from ``dcp.load(sd, ...)`` where ``sd`` came from
        :meth:`sharded_state_dict`: the tensors are normally the optimizer's buffers, filled in place
        (any that are not -- replaced in the dict -- are copied in after the same checks as
        ``load_state_dict``); this applies the param groups' hyperparameters."""
        engine = self._engine
        if isinstance(state_dict, dict) and "state" in state_dict and not engine.bound:
            raise RuntimeError("load_sharded_state_dict needs the dict of this optimizer's sharded_state_dict()")
        groups = state_dicts.load_sharded(state_dict, engine.plan.params, self.state, self.param_groups)
        engine.loaded()
        state_dicts.apply_groups(groups, self.param_groups, self.defaults)

    def load_state_dict(self, state_dict):
        """torch's semantics: the param groups' values are applied at once; the state is replaced --
        each parameter's entry loaded into its buffers (``exp_avg``, ``exp_avg_sq``, ``step``,
        and ``master`` when saved by HybridAdamW), and a parameter without an entry starts afresh,
        as torch's AdamW would. Before the first step the state is kept and loaded when it is
        created. Everything is checked before anything changes. torch's load_state_dict pre- and
        post-hooks run around it (a pre-hook may return the dict to load). Entries that are DTensors
        (FSDP2 shards: this optimizer's ``state_dict()``, or torch's AdamW's, as torch's
        ``set_state_dict`` passes them) are read shard by shard into the buffers, the state made
        first if the first step has not; parameters without an entry keep their state."""
        state_dict = state_dicts.run_hooks(self._optimizer_load_state_dict_pre_hooks, self, state_dict)
        engine = self._engine
        engine.reconcile(self.state)  # the dict the load fills is optimizer.state as it is now
        if state_dicts.has_dtensors(state_dict):  # FSDP2 shards (state_dict()'s, or torch's AdamW's)
            self.sharded_state_dict()  # (the state made, if the first step has not)
            self.load_sharded_state_dict(state_dicts.by_plan_index(state_dict, engine.plan.params, self.param_groups))
            return state_dicts.run_hooks(self._optimizer_load_state_dict_post_hooks, self)
        if isinstance(state_dict, dict) and "state" in state_dict and "param_groups" in state_dict:
            self.synchronize()
        groups, entries = state_dicts.parse(state_dict, self.param_groups,
                                            engine.store.amsgrad_bound if engine.bound else None, self.state_format)
        active = engine.plan.index_of
        mine = {p: e for p, e in entries.items() if id(p) in active}
        engine.load(mine)
        for p in engine.plan.frozen:  # (frozen parameters' entries: in optimizer.state, as torch keeps them)
            self.state.pop(p, None)
        self.state.update({p: e for p, e in entries.items() if id(p) not in active})
        state_dicts.apply_groups(groups, self.param_groups, self.defaults)
        state_dicts.run_hooks(self._optimizer_load_state_dict_post_hooks, self)

