"""Which of a model's repeated layers may stream (window.py), and how many must: the plan a
weight window starts from, and its refusal in one line. The parameters outside the layers -- the
embeddings before them, the final norm and the LM head after them -- are two more units of the
window (:class:`Unit`), streamed where the layers alone do not make room (or when asked)."""

from __future__ import annotations

import torch
from torch import nn

from .blocks import repeated_layers
from .pool import CapacityError, available_memory_bytes, format_bytes, host_margin

_STREAMABLE = (torch.bfloat16, torch.float16)


def plan_window(layer_bytes, fixed_bytes: int, free_bytes: int, *, depth: int, reserve_bytes: int,
                streamable=None) -> int:
    """How many of the last layers stream: the fewest for which the GPU holds what is not a layer
    (``fixed_bytes``), the resident layers, the ``depth`` largest streamed layers at once and
    ``reserve_bytes``, within ``free_bytes``. ``streamable[i]``: layer i may stream (a layer that
    may not stops the streamed run: layers stream from the end). Raises CapacityError when even
    streaming every streamable layer does not fit."""
    n = len(layer_bytes)
    streamable = [True] * n if streamable is None else list(streamable)
    most = 0
    while most < n and streamable[n - 1 - most]:
        most += 1
    need = None
    for count in range(most + 1):
        resident = sum(layer_bytes[:n - count])
        window = sum(sorted(layer_bytes[n - count:], reverse=True)[:depth]) if count else 0
        need = fixed_bytes + resident + window + reserve_bytes
        if need <= free_bytes:
            return count
    raise CapacityError(
        f"the model does not fit on the GPU even with {most} of its {n} layers streamed from host memory: "
        f"it needs {format_bytes(need)} there ({format_bytes(fixed_bytes)} outside the layers, "
        f"{format_bytes(sum(layer_bytes[:n - most]))} of layers that cannot stream, a window of {depth} "
        f"layers, {format_bytes(reserve_bytes)} reserved for activations and the optimizer), and "
        f"{format_bytes(free_bytes)} is free")


def layout(model) -> tuple[list, list[bool], list[int], int]:
    """(layers, streamable, bytes of each layer, bytes outside the layers: the other parameters and
    the buffers) of a model, from its shapes alone (a model on the meta device will do)."""
    layers = repeated_layers(model)
    if layers is None:
        raise ValueError("stream_model needs a model with repeated layers (an nn.ModuleList or nn.Sequential "
                         "of layers of one type): none was found")
    layers = list(layers)
    layer_bytes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
    inside = {id(p) for layer in layers for p in layer.parameters()}
    fixed = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in inside)
    fixed += sum(b.numel() * b.element_size() for b in model.buffers())
    return layers, streamable_layers(model, layers), layer_bytes, fixed


def fits_resident(layer_bytes, fixed_bytes: int, free_bytes: int, total_bytes: int, *, depth: int,
                  streamable=None) -> bool:
    """``stream="auto"``'s first question: do all the weights fit and leave half of the device
    (``total_bytes``) for activations, gradients and the optimizer? Then nothing streams."""
    try:
        return plan_window(layer_bytes, fixed_bytes, free_bytes, depth=depth, reserve_bytes=total_bytes // 2,
                           streamable=streamable) == 0
    except CapacityError:
        return False


def streams_when_auto(model, device, depth: int = 2, state_format=None) -> bool:
    """Whether ``stream_model(model, device, state_format=state_format)`` (``stream="auto"``) streams
    any layer, decided from the model's shapes, the device's free memory and the host's before
    anything is allocated: a job builds the model on the CPU (then streams it) or on the device from
    the answer. False off CUDA and for a model without repeated bf16/fp16 layers."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    try:
        layers, ok, layer_bytes, fixed = layout(model)
    except ValueError:
        return False
    if not any(ok):
        return False
    free, total = torch.cuda.mem_get_info(device)
    on_device = sum(p.numel() * p.element_size() for p in model.parameters() if p.device == device)
    return (not fits_resident(layer_bytes, fixed, free + on_device, total, depth=depth, streamable=ok)
            or host_short(model, state_format))


def streamable_layers(model, layers) -> list[bool]:
    """Layer i may stream when it has trainable parameters, all of them bf16/fp16, none shared with
    anything outside it (tied weights)."""
    inside = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            inside[id(p)] = i
    shared = set()
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            i = inside.get(id(p))
            if i is not None and not any(module is m for m in layers[i].modules()):
                shared.add(i)
    out = []
    for i, layer in enumerate(layers):
        ps = list(layer.parameters())
        out.append(i not in shared and any(p.requires_grad for p in ps)
                   and all(p.dtype in _STREAMABLE for p in ps))
    return out


class Unit:
    """The modules outside the repeated layers whose own parameters are one of the optimizer's blocks:
    ``"embeddings"`` (the parameters before the layers) or ``"head"`` (those after them: the final
    norm and the LM head). It answers what the window asks of a layer -- parameters, buffers,
    modules -- and its members take the window's hooks (each its forward's; the last of them, in
    the model's order, the frees)."""

    def __init__(self, name, members, split=False):
        # split: members on both sides of the layers (an LM head tied to the embeddings): it would
        # stay loaded from the first forward to the last backward, so it does not stream.
        self.name, self.members, self.split = name, list(members), split

    def parameters(self):
        seen = set()
        for m in self.members:
            for p in m.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def buffers(self, recurse=True):
        for m in self.members:
            yield from m.buffers(recurse=False)

    def modules(self):
        yield from self.members

    def __repr__(self) -> str:
        return f"Unit({self.name}: {', '.join(type(m).__name__ for m in self.members)})"


def end_units(model, layers) -> tuple:
    """(embeddings, head): the :class:`Unit` of the parameters before the repeated layers and of those
    after them, in the model's parameter order (as the optimizer's blocks are: blocks.py), each None
    where there are none."""
    inside = {id(p) for layer in layers for p in layer.parameters()}
    before, after, seen_body = set(), set(), False
    for p in model.parameters():
        if id(p) in inside:
            seen_body = True
        else:
            (after if seen_body else before).add(id(p))
    modules = list(model.modules())
    where = {id(m): k for k, m in enumerate(modules)}
    layer_modules = [where[id(m)] for layer in layers for m in layer.modules()]
    units = []
    for name, ids in (("embeddings", before), ("head", after)):
        members = [m for m in modules if any(id(p) in ids for p in m.parameters(recurse=False))]
        split = (any(where[id(m)] < min(layer_modules) for m in members)
                 and any(where[id(m)] > max(layer_modules) for m in members))
        units.append(Unit(name, members, split) if members else None)
    return tuple(units)


def _why_not(unit) -> str:
    """Why ``unit`` cannot stream, in a user's words."""
    ps = list(unit.parameters())
    if unit.split:
        return "the LM head shares the embeddings' weight (tied embeddings), so it would stay loaded throughout"
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in ps if p.dtype not in _STREAMABLE})
    if dtypes:
        return f"its parameters must be bfloat16 or float16, and some are {', '.join(dtypes)}"
    if not any(p.requires_grad for p in ps):
        return "none of its parameters is trainable"
    return "a parameter of it is used by a module outside it (a tied weight)"


def plan_ends(model, layers, ok, layer_bytes, fixed_bytes, free_bytes, *, depth, reserve_bytes, ends):
    """Which ends stream and how many layers must, where the layers alone may not make room:
    ``(count, [units that stream])``. ``ends``: ``"auto"`` (the head, then the embeddings, only
    where streaming every layer that can leaves too little), True (both), False (neither). The
    embeddings stream last of all: the GPU-updated blocks must come before the first streamed one,
    so with them streamed every block is updated on the host. Raises CapacityError (one line) where
    even that does not fit, or ValueError where True asks for an end that cannot stream."""
    embeddings, head = end_units(model, layers)
    units = [u for u in (embeddings, head) if u is not None]
    can = {u.name: ok_ and not u.split for u, ok_ in zip(units, streamable_layers(model, units))}
    if ends is True:
        bad = [u for u in units if not can[u.name]]
        if bad:
            raise ValueError(f"the {bad[0].name} cannot stream (ends=True): {_why_not(bad[0])}; "
                             "use ends='auto' or False")
        tries = [units]
    elif ends == "auto":
        tries = [[]] + [[u for u in (head, embeddings)[:n] if u is not None] for n in (1, 2)]
        tries = [t for t in tries if all(can[u.name] for u in t)]
    else:
        tries = [[]]
    error = None
    for streamed in tries:
        sizes = {u.name: sum(p.numel() * p.element_size() for p in u.parameters()) for u in streamed}
        order = ([sizes["embeddings"]] if "embeddings" in sizes else []) + list(layer_bytes) + \
            ([sizes["head"]] if "head" in sizes else [])
        flags = ([True] if "embeddings" in sizes else []) + list(ok) + ([True] if "head" in sizes else [])
        try:
            count = plan_window(order, fixed_bytes - sum(sizes.values()), free_bytes, depth=depth,
                                reserve_bytes=reserve_bytes, streamable=flags)
        except CapacityError as e:
            error = error or e
            continue
        # The head, last in the order, streams first; the embeddings, first in it, last: the layers are the rest.
        layers = count - ("head" in sizes and count >= 1) - ("embeddings" in sizes and count == len(order))
        return layers, streamed
    raise error


def host_short(model, state_format) -> bool:
    """Whether the host cannot hold HybridAdamW's state in ``state_format`` (a name, or None: not
    asked) for every parameter of ``model``: the fp32 master, m and v, and the bf16/fp16 staging (or
    home), beside the host's margin. Then the optimizer keeps the first blocks' states on the GPU,
    and streaming the other layers is what makes room for them there."""
    if state_format is None:
        return False
    from .state_formats import get

    room = available_memory_bytes()
    if room is None:
        return False
    n = sum(p.numel() for p in model.parameters())
    return n * (4 + get(state_format).bytes_per_parameter() + 2) > room - host_margin(room)


def choose_streamed(model, layers, ok, layer_bytes, fixed, device, *, stream, depth, reserve_bytes, ends,
                    state_format=None):
    """``stream_model``'s plan before anything moves: ``(count, [end units that stream], measure)``,
    ``count`` the last layers that stream and ``measure`` whether the window keeps the first ones on
    the device once the second forward has been measured (``stream="auto"`` without ``reserve_bytes``,
    where the weights would not leave half of the device free, or where the host is short of
    ``state_format``'s state: :func:`host_short`)."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
    if not (isinstance(ends, bool) or (isinstance(ends, str) and ends == "auto")):
        raise ValueError(f"ends must be 'auto', True or False, got {ends!r}")
    n = len(layers)
    measure, with_ends = False, []

    def plan(free, reserve):
        return plan_ends(model, layers, ok, layer_bytes, fixed, free, depth=depth, reserve_bytes=reserve, ends=ends)

    if stream == "auto":
        count = 0
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            # What is on the device already stays there, or moves into its home.
            free += sum(p.numel() * p.element_size() for p in model.parameters() if p.device == device)
            if reserve_bytes is not None:
                count, with_ends = plan(free, int(reserve_bytes))
            elif (not fits_resident(layer_bytes, fixed, free, total, depth=depth, streamable=ok)
                  or host_short(model, state_format)):
                # Every layer that can stream does, until the second forward has shown what the rest
                # takes; then the first ones that fit beside it stay (_count_forward). Refused here
                # only where even the window alone leaves no margin.
                count, with_ends = plan(free, (1 << 30) + total // 20)
                while count < n and ok[n - 1 - count]:
                    count += 1
                measure = True
        if ends is True and not with_ends:  # (the plan above kept the layers resident)
            with_ends = plan(float("inf"), 0)[1]
        return count, with_ends, measure
    if isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream <= n:
        raise ValueError(f"stream must be 'auto' or a number of layers in [0, {n}], got {stream!r}")
    bad = [i for i in range(n - stream, n) if not ok[i]]
    if bad:
        raise ValueError(f"layer {bad[0]} cannot stream: its parameters must all be bfloat16 or float16, "
                         "some trainable, and none shared with modules outside it (tied weights)")
    if ends is True:
        with_ends = plan(float("inf"), 0)[1]
    return stream, with_ends, measure


def materialize_meta(model, streamed_layers, device) -> set:
    """The model's parameters and buffers on the meta device replaced by real ones, uninitialised (tied
    ones stay tied): a streamed layer's on the CPU, its pages untouched (each gets a home instead),
    the rest on ``device``. Returns the ids of the new parameters (nothing in them to copy)."""
    inside = {id(p) for layer in streamed_layers for p in layer.parameters()}
    new = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                if id(p) not in new:
                    where = "cpu" if id(p) in inside else device
                    new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=where),
                                              requires_grad=p.requires_grad)
                setattr(module, name, new[id(p)])
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_meta:
                setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=device))
    return {id(p) for p in new.values()}


def tensors_in(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors_in(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from tensors_in(y)
    elif hasattr(x, "to_tuple"):  # transformers' ModelOutput
        yield from tensors_in(x.to_tuple())
