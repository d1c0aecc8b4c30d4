"""The optimizer's side of streamed weights (``hytrain.stream_model``, window.py).

A streamed block's training copy lives in its *home* in pinned host memory, which also stages its
gradients: they land there once the layer's backward has read the weights, and the CPU update
writes the new weights over them, where they stay (its passes copy nothing to the device: the
``ParamTable`` pass gets no live weight address). So such a block's home holds gradients from its
hand-off until its update has finished, and it does not speculate (a speculative update would have
to keep the gradients beside the weights it writes). The GPU-updated blocks (k) stay below the first
streamed block, whose states live on the host with its weights.

The window asks two things of the optimizer: whether a layer's home holds its final weights now
(``ready``: it reads a layer ahead only then), and the weights of a parameter whose home does not
(``current``, for the model's ``state_dict()`` between backward and ``step()``: the master's
rounding, which is what the weights are at a step's end)."""

from __future__ import annotations

from .._native import native
from ..pool import CapacityError, format_bytes
from ..window import window_for


def bind(ref, plan, store, planner, *, sharded) -> None:
    """Finds the window of the plan's parameters, if any, checks it against the plan, and connects
    both sides (``ref``: a weak reference to the engine)."""
    window = window_for(plan.params)
    if window is None:
        return
    if window.device != store.device:
        raise ValueError(f"the model's weight window is on {window.device}, its parameters on {store.device}")
    if sharded:
        raise ValueError("streamed weights (stream_model) are not supported with FSDP2-sharded parameters")
    # The GPU's room for weights made resident and states, as it was before any move (None: nothing
    # may move: the window was not planned, it is not on a GPU, or the state is made already).
    moved, room = 0, planner.gpu_room() if store.cuda and window.adjustable and store.bound is None else None
    while True:
        layers = _layers(window, plan)  # streamed layer -> its blocks
        blocks = {b for bs in layers.values() for b in bs}
        store.set_window(window, blocks)
        planner.max_k = min(blocks) if blocks else None
        more = _made_room(window, layers, plan, store, planner, moved, room)
        if not more:
            break
        moved += more

    def ready(layer) -> bool:
        engine = ref()
        return engine is None or not engine.bound or all(engine.launcher.updated(b) for b in layers.get(layer, ()))

    def current(p):
        """The parameter's weights where its home does not hold them now (else None)."""
        engine = ref()
        if engine is None or not engine.bound:
            return None
        b = plan.block_of[id(p)]
        if engine.launcher.updated(b):
            return None
        if engine.rt.phase(b) == native().BlockPhase.held:  # the gradients are there until step()
            return engine.store.state[p]["master"].to(p.dtype)
        engine.wait_blocks([b])  # an update under way: its weights, once written
        return None

    window.attach(ready, current, in_use=lambda: (engine := ref()) is not None and engine.bound)


def _layers(window, plan) -> dict:
    """Each streamed layer's blocks (a block is all streamed or none)."""
    layers = {}
    for b, ps in enumerate(plan.blocks):
        streaming = [window.streams(p) for p in ps]
        if any(streaming) and not all(streaming):
            raise ValueError(f"block {b} has parameters in streamed layers and others: with stream_model, "
                             "each streamed layer must be whole blocks (the default blocks are)")
        for p in ps:
            if window.streams(p):
                layers.setdefault(window.layer_of(p), set()).add(b)
    return layers


def _made_room(window, layers, plan, store, planner, moved, room) -> int:
    """Where the host cannot hold the states of every streamed block (its floor is past the first
    streamed block, ``planner.max_k``) and the window was planned (``stream="auto"``): the first
    streamed layer becomes resident, its home given back, so that its blocks' states may live on the
    GPU (k); the bytes of its weights where one was (0 where none), for the caller to look again. A
    layer moves only where the GPU's ``room`` (``planner.gpu_room``: beside this iteration's peak so
    far; None where nothing may move) holds its weights, those ``moved`` before it and the states of
    every block below the host's floor; else CapacityError, naming the bytes on each side."""
    if room is None or planner.max_k is None:
        return 0
    floor = store.host_floor()
    if floor <= planner.max_k:
        return 0
    first = min(layers, key=lambda i: min(layers[i]))
    states = sum(plan.sizes()[2][:floor])
    weights = window.layer_bytes(first)
    need = moved + weights + states
    if need > room:
        count = window.stats["made_resident"]
        n = len(plan.blocks)
        holds = f"of blocks {floor} to {n - 1} only" if floor < n else "of no block"
        raise CapacityError(
            f"the host can hold the optimizer states {holds}, and "
            f"blocks {planner.max_k} and up stream their weights from it: keeping the next streamed layer on the "
            f"GPU with the states of blocks 0 to {floor - 1} there needs {format_bytes(need)} of GPU memory, and "
            f"{format_bytes(max(0, room))} is free beside this iteration's peak ({count} layers were made resident "
            "already): use a host with "
            "more memory or a larger GPU, 8-bit states, or a smaller model")
    window.make_resident(first)
    return weights


def detach(store) -> None:
    if store.window is not None:
        store.window.attach(None)
