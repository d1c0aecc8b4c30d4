"""The hooks: a post-accumulate-grad hook on every parameter counts its block's gradients and hands a
complete block off; forward pre-hooks wait for each block's update just before the block is used; the
model's ``state_dict()`` waits for every update in flight."""

from __future__ import annotations

import weakref

import torch

from .._native import native
from ..blocks import repeated_layers


def grad_hook(ref, p):
    """The parameters' hook reaches the optimizer through a weak reference: it does nothing once the
    optimizer is gone and does not keep it alive."""
    opt = ref()
    if opt is not None:
        opt._on_grad(p)


def _weak(ref, name, *args):
    """A hook calling ``optimizer.name(*args)`` through a weak reference (nothing once it is gone).
    Under torch.compile it runs as it is, outside the graph (a graph break)."""
    @torch.compiler.disable
    def hook(*_):
        opt = ref()
        if opt is not None:
            getattr(opt, name)(*args)
    return hook


class Hooks:
    """The hooks of a HybridAdamW: gradients in, waits before use."""

    def _install_forward_hooks(self, model):
        """Just-in-time waits: head blocks (and optimizer parameters outside the model) before the
        model's forward, each repeated layer's blocks before that layer, tail blocks after the last
        layer (before anything after it can use them). And the model's ``state_dict()`` (a checkpoint
        save outside any forward) waits for every update in flight. A compiled model (torch.compile)
        waits for every block at its entrance: hooks inside a compiled graph are not reliably run.
        Whatever these hooks do not cover, the fence does (fence.py)."""
        ref = weakref.ref(self)
        inner = getattr(model, "_orig_mod", model)
        self._model_hooks.append(inner.register_state_dict_pre_hook(_weak(ref, "synchronize")))
        layers = None if self._compiled else repeated_layers(inner)
        n = len(self._blocks)
        self._layer_hooks = not self._compiled
        if layers is None:
            everything = list(range(n))
            self._model_hooks.append(model.register_forward_pre_hook(
                _weak(ref, "_before_forward", everything, everything[:1]), prepend=True))
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
        if self._shard_group is not None:
            # FSDP2 all-gathers a unit's shards in its own pre-forward hook: the waits run before it
            # (prepend), and the tail, which belongs to the root's unit, is waited for with the head.
            head, tail = head + tail, []
        self._model_hooks.append(model.register_forward_pre_hook(
            _weak(ref, "_before_forward", head + outside, head), prepend=True))
        for child, ids in zip(layers, layer_ids):
            self._model_hooks.append(child.register_forward_pre_hook(
                _weak(ref, "_before_forward", ids, ids), prepend=True))
        if tail:
            self._model_hooks.append(layers[len(layers) - 1].register_forward_hook(
                _weak(ref, "_before_forward", tail, tail)))

    def _before_forward(self, wait_for, marks):
        meter = self._meter if (self._meter is not None and torch.is_grad_enabled()
                                and not self._rt.any_arrived()) else None
        before = None
        if meter is not None:
            meter.start(True)
            before = meter.before_wait()
        self._wait_blocks(wait_for)
        if meter is not None:
            meter.after_wait(marks, before)
        if self.timeline is not None and torch.is_grad_enabled():
            for b in marks:
                self.timeline.mark("forward", b)
        if self._fence.armed:
            self._fence.disarm()  # off the stack once every block has been waited for

    def _on_grad(self, p):
        b = self._block_of.get(id(p))
        if b is None:
            return  # a parameter that got its gradient hook before a rebuild dropped it
        arrival, kinds = self._rt.arrive(b), native().Arrival
        if arrival == kinds.late:
            if not self.release_grads:
                return  # another backward into kept gradients: step() sees them changed and redoes the block
            raise RuntimeError(
                f"gradients arrived for block {b} after it was already updated in this step: call "
                f"optimizer.step() after every {self.accumulation_steps} backward pass(es) "
                "(accumulation_steps)")
        if self._bound is None:
            return  # the first step is deferred: its state is created, and its updates run, in step()
        if arrival == kinds.complete:
            if self.timeline is not None:
                self.timeline.mark("backward", b)
            if self._meter is not None:
                self._meter.backward_done(b, self._resident_bytes if self._scheduler is not None else None)
            # Nothing is applied before step(): the multiplier, the gradients (which the loop may
            # still clip or rescale) and the hyperparameters (which it may still change) are known
            # only then. What can start is the copy out, and speculative updates beside the state.
            if self._early_handoff():
                self._hand_off(b)
        self._release_landed()
