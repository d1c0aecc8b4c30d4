"""Gradient intake: a post-accumulate-grad hook on every parameter counts its block's gradients (the
native ``BlockRuntime``) and reports a complete block; each block's gradients checked before anything
reads them; what the caller keeps of handed-off gradients (to see whether it changed them before
``step()``); the global norm, and the clips asked for on this step's gradients (``clip_grad_norm_``)."""

from __future__ import annotations

import functools
import math
import weakref

import torch

from .._native import native
from . import collectives
from .common import dense, local


def sq_norm(grads):
    """The squared 2-norm of some gradients as a 0-d float64 device tensor (no fp32 copies)."""
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch.stack(norms).double().square().sum()


def _grad_hook(ref, p):
    """The parameters' hook reaches the intake through a weak reference: it does nothing once the
    optimizer is gone and does not keep it alive."""
    intake = ref()
    if intake is not None:
        intake.on_grad(p)


def _end_of_backward(ref):
    """Queued on autograd's engine at a hand-off under loss scaling: runs when the backward ends."""
    intake = ref()
    if intake is not None:
        intake.merge_overflow()


def overflow_stand_in(params, parts) -> torch.nn.Parameter | None:
    """Released gradients' overflow, shown to a GradScaler: ``params`` whose gradients were handed
    off and released, ``parts`` their blocks' squared norms (device scalars: non-finite exactly
    when a gradient element is). The smallest of ``params`` (with elements on this rank) gets a
    zero ``.grad`` if it has none, and its first element is made infinite where a part is not
    finite -- on the device, without a synchronisation. A GradScaler's overflow check reads every
    ``.grad`` of the optimizer: it then finds an overflow exactly when one of the step's gradients
    had one, as with torch's optimizers, and skips the step and backs the scale off as torch does.
    Returns the parameter (None if there is none)."""
    ps = [p for p in params if local(p).numel()]
    if not ps or not parts:
        return None
    p = min(ps, key=lambda q: local(q).numel())
    with torch._C.DisableTorchFunction():  # the optimizer's own write: not an operation of the loop's
        bad = torch.stack(parts).sum().isfinite().logical_not()
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = local(p.grad)
        g[(0,) * g.dim()].masked_fill_(bad.to(g.device), float("inf"))  # a view of element 0, any layout
    return p


def _before_more_gradients(ref, grad):
    """A parameter's pre-accumulation hook while clips are pending (see :meth:`GradientIntake.clip`)."""
    intake = ref()
    if intake is not None:
        intake.apply_pending_clips()


class GradientIntake:
    """``arrived(b, complete)`` is called for each gradient of a block (``complete``: the block's
    last gradient of the step's last micro-batch); the first step's updates run in step(), once the
    state exists."""

    def __init__(self, plan, settings, rt, store, shard_group, arrived):
        self.plan, self.settings, self.rt, self.store = plan, settings, rt, store
        self.shard_group, self.arrived = shard_group, arrived
        self.last_grad_norm = None  # the last step's global gradient norm (before clipping), when clipping
        self._sq_parts = {}  # block -> squared gradient norm of a block handed off early (device scalar)
        self._handed = {}  # id(p) -> (gradient, its version) handed off while the caller keeps .grad
        self._released = []  # blocks released under loss scaling since the last overflow merge
        self._merge_queued = False
        self.released_scaled = False  # gradients released under loss scaling in this step
        self._prints = {}  # block -> fingerprints of its kept gradients at the hand-off (loss scaling)
        self._norm = None  # this step's global gradient norm, once computed
        self._chain = []  # max_norm of each clip_grad_norm_ call on this step's gradients
        self._clip_scale = 1.0  # the loss scale those calls said the gradients carry
        self._prehooks = []  # while clips are pending: hooks that apply them before more gradients
        ref = weakref.ref(self)
        # (A parameter frozen with its gradient still there has no hook: its block's gradients are
        # taken at step(), as they are when a block never completes during backward.)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, ref))
                       for p in plan.params if p.requires_grad]

    def close(self):
        self.remove_clip_prehooks()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def on_grad(self, p):
        b = self.plan.block_of.get(id(p))
        if b is None:
            return  # a parameter that got its gradient hook before a rebuild dropped it
        arrival, kinds = self.rt.arrive(b), native().Arrival
        if arrival == kinds.late:
            if not self.settings.release_grads:
                return  # another backward into kept gradients: step() sees them changed and redoes the block
            raise RuntimeError(
                f"gradients arrived for block {b} after it was already updated in this step: call "
                f"optimizer.step() after every {self.settings.accumulation_steps} backward pass(es) "
                "(accumulation_steps)")
        self.arrived(b, arrival == kinds.complete)  # (before the state exists: only measured)

    def grads(self, b):
        """The block's (parameter, gradient) pairs, gradients validated and laid out as their
        parameters (element i of the gradient's memory is element i of the weights'): for
        the local shards of sharded (FSDP2) parameters; a parameter whose shard on this rank is empty
        has nothing to update here."""
        out = []
        for p in self.plan.blocks[b]:
            if p.grad is None:
                continue
            g, w = local(p.grad), local(p)
            if g.is_sparse or g.layout != torch.strided:
                raise RuntimeError(f"HybridAdamW does not support sparse gradients (shape {tuple(p.shape)})")
            self.store.check_bound(p)
            if g.dtype != w.dtype or g.shape != w.shape or g.device != w.device:
                raise RuntimeError(f"gradient of a parameter of shape {tuple(w.shape)} has dtype {g.dtype}, "
                                   f"shape {tuple(g.shape)}, device {g.device}: it must match the parameter "
                                   f"({w.dtype}, {w.device})")
            if w.numel():
                same = g.stride() == w.stride() or (g.is_contiguous() and w.is_contiguous())
                out.append((p, g if same and dense(g) else torch.empty_like(w).copy_(g)))
        return out

    def handed_off(self, b, pairs, *, scaled=False) -> None:
        """Block b's gradients leave during backward: with ``release_grads`` its share of the squared
        norm is taken now (``.grad`` is released); otherwise the caller keeps ``.grad`` and its
        identity and version are noted, so that step() can tell whether the caller changed it.
        ``scaled`` (a GradScaler drives the steps): released blocks' overflow is merged into a
        stand-in gradient when the backward ends (:func:`overflow_stand_in`); kept gradients are
        fingerprinted, since the scaler's overflow check rewrites them in place (times 1: the same
        values, a new version) and only their content tells whether the loop changed them."""
        if self.settings.release_grads:
            if pairs:
                self._sq_parts[b] = sq_norm([g for _, g in pairs])
                if scaled:
                    self.released_scaled = True
                    self._released.append(b)
                    if not self._merge_queued:
                        # (Under reentrant checkpointing this is the inner backward's end: a later
                        # hand-off queues another.)
                        torch.autograd.Variable._execution_engine.queue_callback(
                            functools.partial(_end_of_backward, weakref.ref(self)))
                        self._merge_queued = True
            return
        for p in self.plan.blocks[b]:
            if p.grad is not None:
                g = local(p.grad)
                self._handed[id(p)] = (g, g._version)
        if scaled and self.store.cuda:
            grads = self._kept(b)
            if grads is not None:
                self._prints[b] = self._fingerprint(grads)

    def _kept(self, b):
        """Block b's kept gradients (local shards), or None if one of them does not fill one span of
        memory (a dense one is fingerprinted over that span, element order as laid out)."""
        grads = [local(p.grad) for p in self.plan.blocks[b] if p.grad is not None]
        return grads if all(dense(g) for g in grads) else None

    def _fingerprint(self, grads):
        """The gradients' fingerprints (a device int64 tensor), enqueued on the current stream."""
        device = self.store.device
        out = torch.empty(len(grads), dtype=torch.int64, device=device)
        native().cuda_fingerprint_spans([(g.data_ptr(), g.numel() * g.element_size()) for g in grads],
                                        out.data_ptr(), device.index, torch.cuda.current_stream(device).cuda_stream)
        return out

    def _rewritten(self, blocks) -> set:
        """Of these blocks, whose kept gradients have the same identity but new versions since their
        hand-off, those whose content changed (one synchronisation for all)."""
        checked, flags = [], []
        for b in blocks:
            grads = self._kept(b)
            if grads is None or len(grads) != self._prints[b].numel():
                continue
            checked.append(b)
            flags.append((self._fingerprint(grads) != self._prints[b]).any())
        same = {b for b, f in zip(checked, torch.stack(flags).tolist()) if not f} if flags else set()
        return set(blocks) - same

    def merge_overflow(self) -> None:
        """The end of a backward under loss scaling: the overflow of the blocks released since the
        last merge, written into a stand-in gradient (see :func:`overflow_stand_in`)."""
        self._merge_queued = False
        blocks, self._released = self._released, []
        overflow_stand_in([p for b in blocks for p in self.plan.blocks[b]],
                          [self._sq_parts[b] for b in blocks if b in self._sq_parts])

    def changed_blocks(self, staged) -> set:
        """Blocks handed off during backward that cannot be released as they are: the caller changed
        their gradients since (``clip_grad_norm_``, unscaling, replacing or dropping ``.grad``; seen by
        the gradients' identity and version counters), or replaced their parameters' storage (which the
        staged weight copies would write; ``staged(b)``: the weights a block's pass writes). Parameters
        moved to another device or dtype are refused."""
        out, versions = set(), []
        rt, phases = self.rt, native().BlockPhase
        release = self.settings.release_grads
        for b in (*rt.in_phase(phases.held), *rt.in_phase(phases.speculated)):
            ps = self.plan.of_handles(rt.handed(b))
            for p in self.plan.blocks[b]:
                self.store.check_bound(p)
            weights = staged(b) if not rt.on_gpu(b) else None
            if weights and any(w.data_ptr() != local(p).data_ptr() for w, p in zip(weights, ps)):
                if release:
                    raise RuntimeError(f"the parameters of block {b} were given new storage between backward "
                                       "and step(): their update was staged for the old storage, and their "
                                       "gradients are released (release_grads=True)")
                out.add(b)
                continue
            if release:
                continue
            moved = False  # a version moved, nothing else
            for p in self.plan.blocks[b]:
                seen, g = self._handed.get(id(p)), (local(p.grad) if p.grad is not None else None)
                if (seen is None) != (g is None) or (g is not None and g is not seen[0]):
                    out.add(b)
                    break
                moved = moved or (g is not None and g._version != seen[1])
            else:
                if moved and b in self._prints:
                    versions.append(b)
                elif moved:
                    out.add(b)
        return out | (self._rewritten(versions) if versions else set())

    # -- the global norm and clipping -------------------------------------------------------------------

    def global_norm(self) -> float | None:
        """This step's global gradient 2-norm before any multiplier (None without gradients), computed
        once: one squared norm per block -- taken at the hand-off for blocks whose gradients were
        released, now for the others -- summed in block order, so that the result does not depend on
        which blocks were handed off early (a resumed run's first step hands none off). With sharded
        parameters the ranks' sums are added up."""
        if self._norm is None:
            parts = []
            for b, blk in enumerate(self.plan.blocks):
                part = self._sq_parts.get(b)
                if part is None and not (self.settings.release_grads and self.rt.submitted(b)):
                    grads = [g for g in (local(p.grad) for p in blk if p.grad is not None) if g.numel()]
                    part = sq_norm(grads) if grads else None
                if part is not None:
                    parts.append(part)
            if self.shard_group is not None:  # every rank's squared norm of its shards, summed
                total = (torch.stack(parts).sum() if parts else
                         torch.zeros((), dtype=torch.float64, device=local(self.plan.params[0]).device))
                self._norm = math.sqrt(float(collectives.all_reduce(total, self.shard_group)))
            elif parts:
                self._norm = math.sqrt(float(torch.stack(parts).sum()))
        return self._norm

    def _chain_coef(self, norm) -> float:
        """The factor of the clips asked for on this step's gradients (clip_grad_norm_ calls), applied
        one after the other as torch's clip_grad_norm_ would have rescaled them."""
        c = 1.0
        for max_norm in self._chain:
            c *= min(1.0, max_norm / (norm * c + 1e-6))
        return c

    @staticmethod
    def inv_scale(grad_scale) -> float:
        """The loss-scale unscaling of a step (1 without a GradScaler)."""
        return 1.0 if grad_scale is None else 1.0 / float(grad_scale)

    def multiplier(self, inv=1.0) -> float:
        """The step's gradient multiplier: the loss-scale unscaling ``inv`` (see :meth:`inv_scale`)
        times the clip factor (the loop's clips, or ``max_grad_norm``)."""
        if not self._chain and self.settings.max_grad_norm is None:
            return inv
        norm = self.global_norm()
        if norm is None:
            return inv
        total = norm * inv
        self.last_grad_norm = total
        if not math.isfinite(total):
            return total  # refused by step(): clipping by a non-finite norm would poison every weight
        if self._chain:  # the loop clipped: its clips, not max_grad_norm, as torch would have
            return inv * self._chain_coef(total)
        return inv * min(1.0, self.settings.max_grad_norm / (total + 1e-6))

    def clip(self, max_norm, error_if_nonfinite, scale=1.0) -> float:
        """A clip asked for (see HybridAdamW.clip_grad_norm_): returns the norm before it, of the
        gradients divided by ``scale`` (a GradScaler's: the clip is of the unscaled gradients)."""
        self._norm = None  # gradients may have been added or changed since the last call
        self._clip_scale = scale
        total = self.global_norm()
        total = 0.0 if total is None else total / scale
        total *= self._chain_coef(total)  # clips asked for earlier on these same gradients
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"the total norm of the gradients is {total}: non-finite, so it cannot be clipped")
        self._chain.append(float(max_norm))
        if not self._prehooks:
            ref = weakref.ref(self)
            self._prehooks = [p.register_hook(functools.partial(_before_more_gradients, ref))
                              for p in self.plan.params if p.requires_grad]
        return total

    def apply_pending_clips(self):
        """More gradients are about to be accumulated into clipped ones: the clips asked for are
        applied to ``.grad`` now, as torch's in-place clip_grad_norm_ would have done."""
        if not self._chain:
            return
        self._norm = None
        norm = self.global_norm()
        norm = None if norm is None else norm / self._clip_scale  # the clips are of unscaled norms
        coef = self._chain_coef(norm) if norm is not None and math.isfinite(norm) else 1.0
        self._chain = []
        self._norm = None
        if coef != 1.0:
            grads = [local(p.grad) for p in self.plan.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coef)

    def remove_clip_prehooks(self):
        hooks, self._prehooks = self._prehooks, []
        for h in hooks:
            h.remove()

    def end_step(self):
        """What a step (taken or not) leaves behind: nothing of this step's gradients."""
        self._sq_parts = {}
        self._handed = {}
        self._released = []
        self._prints = {}
        self.released_scaled = False
        self._merge_queued = False  # (a backward that failed before its end never ran the merge)
        self._chain = []
        self._clip_scale = 1.0
        self._norm = None
