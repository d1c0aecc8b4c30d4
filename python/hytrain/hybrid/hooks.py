"""The model's hooks that an engine installs (``model=``): just-in-time waits before each block is
used, and a wait for every update in flight before the model's ``state_dict()``. They reach the
engine through a weak reference (``_Hook``), and pickle and copy as hooks that do nothing."""

from __future__ import annotations

import torch

from ..blocks import repeated_layers
from . import forks


class _Hook:
    """A module hook calling ``engine.name(*args)`` through a weak reference (nothing once the engine
    is gone). Under torch.compile it runs as it is, outside the graph (a graph break). A copy of the
    module (``copy.deepcopy``, ``torch.save``/``torch.load``) gets a hook that does nothing: the copy's
    parameters are not the optimizer's."""

    def __init__(self, ref, name, *args):
        self.ref, self.name, self.args = ref, name, args

    @torch.compiler.disable
    def __call__(self, *_):
        engine = self.ref() if self.ref is not None else None
        if engine is not None:
            forks.check(engine.launcher)  # (a forked child with CUDA state: refused before anything runs)
            getattr(engine, self.name)(*self.args)

    def __reduce__(self):
        return (_Hook, (None, self.name))


def forward_hooks(ref, plan, model, *, sharded) -> tuple[list, bool]:
    """Just-in-time waits: head blocks (and optimizer parameters outside the model) before the
    model's forward, each repeated layer's blocks before that layer, tail blocks after the last
    layer (before anything after it can use them). And the model's ``state_dict()`` (a checkpoint
    save outside any forward) waits for every update in flight. A compiled model (torch.compile)
    waits for every block at its entrance: hooks inside a compiled graph are not reliably run.
    Whatever these hooks do not cover, the fence does (fence.py). Returns the hooks' handles and
    whether each layer waits for its own blocks (and can be measured); on failure none is left."""
    hooks = []
    try:
        return _install(hooks, ref, plan, model, sharded)
    except BaseException:
        for h in hooks:
            h.remove()
        raise


def _install(hooks, ref, plan, model, sharded) -> tuple[list, bool]:
    inner = getattr(model, "_orig_mod", model)
    mine = {id(p) for p in inner.parameters()}
    if plan.params and not any(id(p) in mine for p in plan.params):
        raise ValueError(
            "none of this optimizer's parameters is a parameter of its model (model=) any more: the model's were "
            "replaced after the optimizer was built (fully_shard does that), and the new ones would never be "
            "updated. Build HybridAdamW after fully_shard, over model.parameters()")
    hooks.append(inner.register_state_dict_pre_hook(_Hook(ref, "synchronize")))
    layers = None if plan.compiled else repeated_layers(inner)
    n = len(plan)
    if layers is None:
        everything = list(range(n))
        hooks.append(model.register_forward_pre_hook(
            _Hook(ref, "before_forward", everything, everything[:1]), prepend=True))
        return hooks, not plan.compiled
    layer_ids = [sorted({plan.block_of[id(p)] for p in child.parameters() if id(p) in plan.block_of})
                 for child in layers]
    in_layers = {b for ids in layer_ids for b in ids}
    first_layer = min(in_layers) if in_layers else n
    head = [b for b in range(n) if b not in in_layers and b < first_layer]
    tail = [b for b in range(n) if b not in in_layers and b > first_layer]
    model_params = {id(p) for p in model.parameters()}
    outside = [b for b in tail if not any(id(p) in model_params for p in plan.blocks[b])]
    tail = [b for b in tail if b not in outside]
    if sharded:
        # FSDP2 all-gathers a unit's shards in its own pre-forward hook: the waits run before it
        # (prepend), and the tail, which belongs to the root's unit, is waited for with the head.
        head, tail = head + tail, []
    hooks.append(model.register_forward_pre_hook(
        _Hook(ref, "before_forward", head + outside, head), prepend=True))
    for child, ids in zip(layers, layer_ids):
        hooks.append(child.register_forward_pre_hook(
            _Hook(ref, "before_forward", ids, ids), prepend=True))
    if tail:
        hooks.append(layers[len(layers) - 1].register_forward_hook(
            _Hook(ref, "before_forward", tail, tail)))
    return hooks, True

