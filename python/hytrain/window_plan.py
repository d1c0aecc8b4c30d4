"""Which of a model's repeated layers may stream (window.py), and how many must: the plan a
weight window starts from, and its refusal in one line."""

from __future__ import annotations

import torch

from .blocks import repeated_layers
from .pool import CapacityError, format_bytes

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


def streams_when_auto(model, device, depth: int = 2) -> bool:
    """Whether ``stream_model(model, device)`` (``stream="auto"``) streams any layer, decided from
    the model's shapes and the device's free memory before anything is allocated: a job builds the
    model on the CPU (then streams it) or on the device from the answer. False off CUDA and for a
    model without repeated bf16/fp16 layers."""
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
    return not fits_resident(layer_bytes, fixed, free + on_device, total, depth=depth, streamable=ok)


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
