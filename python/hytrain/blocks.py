"""Block detection: which parameters HybridAdamW updates together, in forward order.

A model's repeated layers are the children of its largest ``nn.ModuleList`` or ``nn.Sequential`` of two
or more modules of one type (``model.layers`` of the project's decoder and of transformers' Llama,
Mistral and Qwen2, ``transformer.h`` of GPT-2, ``gpt_neox.layers`` of GPT-NeoX, ``vit.encoder.layer``
of transformers' ViT, ``blocks`` of timm's VisionTransformer, a plain ``nn.Sequential`` of blocks). Each layer is a block; the parameters
before the layers form a head block, those after them a tail block.
"""

from __future__ import annotations

from torch import nn


def repeated_layers(model: nn.Module) -> nn.Module | None:
    """The largest ``nn.ModuleList`` or ``nn.Sequential`` (by parameters) of two or more modules of one
    type that hold parameters, or None."""
    best, best_size = None, -1
    for m in model.modules():
        if (isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1 and len({type(c) for c in m}) == 1
                and any(True for _ in m.parameters())):
            size = sum(p.numel() for p in m.parameters())
            if size > best_size:
                best, best_size = m, size
    return best


def detect_blocks(model: nn.Module, params) -> list[list[nn.Parameter]]:
    """Head, the children of :func:`repeated_layers`, tail (forward order)."""
    wanted = {id(p) for p in params}
    layers = repeated_layers(model)
    if layers is None:
        return [[p for p in model.parameters() if id(p) in wanted]]
    owner = {}
    for i, child in enumerate(layers):
        for p in child.parameters():
            owner.setdefault(id(p), i)
    head, tail, body = [], [], [[] for _ in layers]
    seen_body = False
    for p in model.parameters():
        if id(p) not in wanted:
            continue
        if id(p) in owner:
            body[owner[id(p)]].append(p)
            seen_body = True
        else:
            (tail if seen_body else head).append(p)
    return [b for b in [head, *body, tail] if b]
