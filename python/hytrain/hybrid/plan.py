"""The block plan: which parameters have state (those that require gradients; torch skips the
others), their indices and param groups, and the blocks -- the parameters updated together, in
forward order. Built from the param groups and the model (or explicit blocks, or buckets); fixed
after construction (a changed set of parameters builds a new plan)."""

from __future__ import annotations

import torch
from torch import nn

from ..blocks import detect_blocks
from .common import is_sharded, local


def check_param_list(params) -> None:
    """What no later move or cast can change: tensors, leaves, each once, floating point."""
    if not params:
        raise ValueError("HybridAdamW got an empty parameter list")
    seen = set()
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {i} is a {type(p).__name__}, not a tensor")
        if id(p) in seen:
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) appears more than once in the param groups "
                             "(torch's optimizers warn and update it twice per step); pass each parameter once")
        seen.add(id(p))
        if not p.is_leaf:
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is not a leaf tensor; "
                             "optimize the leaf (e.g. the nn.Parameter), not a result of an operation")
        # A frozen integer parameter is never stepped (as in torch); a complex one is not supported.
        if (not p.is_floating_point() and (p.requires_grad or p.is_complex())) or (
                p.requires_grad and p.dtype == torch.float64):
            raise TypeError(f"parameter {i} (shape {tuple(p.shape)}) has dtype {p.dtype}; HybridAdamW supports "
                            "float32, bfloat16 and float16 (its masters and states are fp32: a float64 model "
                            "would be trained at fp32 precision); cast the model first, e.g. model.float()")


def is_compiled(model) -> bool:
    """Whether the model runs through torch.compile: an OptimizedModule, or compiled in place."""
    return type(model).__name__ == "OptimizedModule" or getattr(model, "_compiled_call_impl", None) is not None


def uncompiled(model):
    """The module a compiled model wraps (its parameters and submodules), else the model."""
    return getattr(model, "_orig_mod", model) if model is not None and is_compiled(model) else model


class BlockPlan:
    """``params``: the parameters with state, in group order (a parameter's handle in the native
    table is its index here); ``frozen``: those without; ``blocks``: lists of parameters in forward
    order."""

    def __init__(self, param_groups, *, model=None, blocks=None, bucket_elements=4 << 20, moment_bytes=None):
        self.moment_bytes = moment_bytes or (lambda n: 4 * n)  # bytes of m (or v) of an n-element parameter
        everything = [p for g in param_groups for p in g["params"]]
        check_param_list(everything)
        self._ids = self.ids(param_groups)
        # As torch's optimizers: a parameter is stepped when it has a gradient, whatever requires_grad
        # says now (frozen after a backward, its gradient is still applied at the next step).
        self.params = [p for p in everything if p.requires_grad or p.grad is not None]
        self.frozen = [p for p in everything if not (p.requires_grad or p.grad is not None)]
        if not self.params:
            kinds = sorted({str(p.dtype).replace("torch.", "") for p in self.frozen})
            got = f": all {len(self.frozen)} have requires_grad=False ({', '.join(kinds)})" if self.frozen else ""
            raise ValueError(f"HybridAdamW got no parameter that requires gradients{got}; it needs at least "
                             "one trainable floating-point parameter when it is built")
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self.group_of = {id(p): g for g in param_groups for p in g["params"]}
        self.group_index = {id(p): i for i, g in enumerate(param_groups) for p in g["params"]}
        self.compiled = model is not None and is_compiled(model)
        self.blocks = self._make_blocks(uncompiled(model), blocks, bucket_elements)
        self.block_of = {}
        for i, b in enumerate(self.blocks):
            for p in b:
                if id(p) in self.block_of:
                    raise ValueError("a parameter appears in two blocks")
                self.block_of[id(p)] = i

    @staticmethod
    def ids(param_groups) -> tuple:
        return tuple(tuple(map(id, g["params"])) for g in param_groups)

    def stale(self, param_groups) -> bool:
        """Whether the param groups hold other parameters than when the plan was made (one swapped
        in ``param_groups[i]["params"]``, a list replaced): the face builds a new plan."""
        return self.ids(param_groups) != self._ids

    def fenced_ids(self) -> dict:
        """``block_of`` with the local shards of FSDP2 parameters added: the tensor a DTensor holds
        (``to_local()`` hands out views of it), read now -- FSDP2 keeps it from step to step, but may
        replace it when the model is reloaded."""
        shards = {id(p._local_tensor): b for b, blk in enumerate(self.blocks) for p in blk if is_sharded(p)}
        return {**self.block_of, **shards} if shards else self.block_of

    def __len__(self) -> int:
        return len(self.blocks)

    def index(self, p) -> int:
        return self.index_of[id(p)]

    def group(self, p) -> dict:
        return self.group_of[id(p)]

    def amsgrad(self, p) -> bool:
        return bool(self.group_of[id(p)]["amsgrad"])

    def handles(self, params) -> list[int]:
        return [self.index_of[id(p)] for p in params]

    def of_handles(self, handles) -> list:
        return [self.params[h] for h in handles]

    def sizes(self):
        """Per block: elements (at least 1), weight bytes, and the bytes its states take on the GPU
        (m and v of ``moment_bytes``, fp32 max v, master for low-precision weights, and the
        gradient buffer)."""
        numel, weight, state = [], [], []
        for blk in self.blocks:
            n = w = s = 0
            for p in blk:
                e = local(p).numel()
                n += e
                w += e * p.element_size()
                per = (4 if self.amsgrad(p) else 0) + p.element_size()
                if p.dtype != torch.float32:
                    per += 4  # master
                s += e * per + 2 * self.moment_bytes(e)
            numel.append(max(1, n))
            weight.append(w)
            state.append(s)
        return numel, weight, state

    def _make_blocks(self, model, blocks, bucket_elements):
        if blocks is not None:
            out = []
            for b in blocks:
                ps = list(b.parameters()) if isinstance(b, nn.Module) else list(b)
                out.append([p for p in ps if id(p) in self.group_of])
            covered = {id(p) for b in out for p in b}
            missing = [p for p in self.params if id(p) not in covered]
            if missing:
                raise ValueError(f"{len(missing)} optimizer parameter(s) are in no block of `blocks`")
            return [b for b in out if b]
        if model is not None:
            if not isinstance(model, nn.Module):
                raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
            out = detect_blocks(model, self.params)
            covered = {id(p) for b in out for p in b}
            extra = [p for p in self.params if id(p) not in covered]
            if extra:  # optimizer parameters outside the model: one more block at the end
                out.append(extra)
            return out
        out, cur, size = [], [], 0
        for p in self.params:
            cur.append(p)
            size += p.numel()
            if size >= bucket_elements:
                out.append(cur)
                cur, size = [], 0
        if cur:
            out.append(cur)
        return out
