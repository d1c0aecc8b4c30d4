"""The fence: torch's contract after ``step()`` returns, while updates still run.

Updates that outlive ``step()`` are what makes the fast path fast: they overlap the next forward. torch
promises more than the forward, though: after ``step()`` any read or write of a parameter or of a
gradient sees the updated value -- an EMA of the weights, ``model.load_state_dict`` (a rollback),
``p.grad.zero_()``, a layer's weights used outside its forward, a parameter used before the layer that
owns it, a compiled model whose hooks do not run. The forward hooks wait for each block just before
its layer; the fence covers every other path.

It is a ``TorchFunctionMode`` on the training thread's stack, there only while some block's update is
in flight. Every torch operation -- functions, methods, and the ``.data`` accessor -- whose arguments
hold a parameter of a block in flight, or a gradient its update still reads, waits for that block
first (on CUDA: the current stream waits for the block's weight copies; the host does not block unless
the update has not finished on the CPU yet). Operations that read only metadata pass (shape, dtype,
device..., and ``.grad``, which hands out the gradient tensor: reading or writing its elements is an
operation on that tensor, seen as such), so ``zero_grad()`` right after ``step()`` does not wait. Once
nothing is in flight the mode leaves the stack at the next forward hook, ``step()``, ``zero_grad()`` or
``synchronize()``, so a forward whose hooks waited for every block runs its last layers and the loss
without it.

An FSDP2 parameter (a DTensor) is seen through its local shard too (``p.to_local()``, and the
collectives of ``p.full_tensor()``, which touch the shard and not the parameter), and a view of a
parameter or of its shard through the view's base. What it does not see: work on another thread
(the mode stack is per thread), code under ``torch._C.DisableTorchFunction``, a view of a view made
before ``step()``, and raw memory access (``data_ptr()`` handed to other libraries).
``HybridAdamW(fence=False)`` drops it where the loop is known to touch parameters only through the
model's forward (see ``docs/performance.md``, "The fence", for what it costs).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.overrides import TorchFunctionMode


def _metadata_functions():
    """Tensor accessors that read no element: they never wait."""
    T = torch.Tensor
    names_get = ("shape", "dtype", "device", "layout", "requires_grad", "is_leaf", "ndim", "is_cuda",
                 "is_sparse", "is_quantized", "is_meta", "grad_fn", "names", "_version", "itemsize",
                 "nbytes", "is_nested")
    names_call = ("size", "dim", "numel", "stride", "data_ptr", "element_size", "is_contiguous",
                  "is_floating_point", "is_complex", "nelement", "storage_offset", "get_device",
                  "__hash__", "__len__", "requires_grad_", "retain_grad", "register_hook",
                  "register_post_accumulate_grad_hook")
    out = {T.grad.__get__, T.grad.__set__}  # the gradient tensor itself, not its elements
    for n in names_get:
        attr = getattr(T, n, None)
        if attr is not None and hasattr(attr, "__get__"):
            out.add(attr.__get__)
    for n in names_call:
        attr = getattr(T, n, None)
        if attr is not None:
            out.add(attr)
    return frozenset(out)


_METADATA = _metadata_functions()


class Fence(TorchFunctionMode):
    """The optimizer's fence (see the module notes). ``arm()`` after a step that left updates in
    flight, ``watch(b, tensors)`` for the gradients a block's update still reads, ``forget(b)`` once
    the block was waited for, ``disarm()`` at safe points (outside any torch function handler)."""

    def __init__(self, engine_ref):
        """``engine_ref``: a weak reference to the engine (its ``plan.block_of``, ``in_flight()`` and
        ``fence_wait(blocks)``); the mode on the stack does not keep it alive."""
        super().__init__()
        self._ref = engine_ref
        self._on_stack = False
        self._thread = None
        # id(gradient) -> (block, weak reference): gradients that an in-flight update reads. Weak: the
        # fence never keeps a gradient's memory alive (the pipeline releases it once its copy landed).
        self._grads = {}
        self._by_block = {}  # block -> ids watched for it
        self._ids = {}  # id(parameter or its local shard) -> block, set when armed

    @property
    def armed(self) -> bool:
        return self._on_stack

    def watch(self, b, tensors) -> None:
        ids = self._by_block.setdefault(b, [])
        for t in tensors:
            self._grads[id(t)] = (b, weakref.ref(t))
            ids.append(id(t))

    def forget(self, b) -> None:
        for i in self._by_block.pop(b, ()):
            e = self._grads.get(i)
            if e is not None and e[0] == b:
                del self._grads[i]

    def arm(self) -> None:
        """Puts the fence on this thread's stack (once)."""
        if self._on_stack:
            return
        engine = self._ref()
        self._ids = {} if engine is None else engine.plan.fenced_ids()
        torch._C._push_on_torch_function_stack(self)
        self._on_stack = True
        self._thread = threading.get_ident()

    def disarm(self, *, force=False) -> None:
        """Takes the fence off the stack when nothing is in flight (or ``force``), wherever it is in
        the stack (a mode pushed above it since stays, in its order)."""
        if not self._on_stack or self._thread != threading.get_ident():
            return
        engine = self._ref()
        if not force and engine is not None and engine.in_flight():
            return
        above = []
        found = False
        try:
            while torch._C._len_torch_function_stack() > 0:
                m = torch._C._pop_torch_function_stack()
                if m is self:
                    found = True
                    break
                above.append(m)
        finally:
            for m in reversed(above):
                torch._C._push_on_torch_function_stack(m)
        if found:
            self._on_stack = False

    # Not traced by torch.compile: a frame entered with the fence on the stack (a model compiled after
    # the optimizer was built, a compiled function called right after step()) runs each operation
    # through it outside the graph, as it is, until the fence leaves the stack; traced, the lookups
    # made the frame's guards depend on which blocks were in flight, and it recompiled every step.
    @torch.compiler.disable
    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Hot: every torch operation while armed. Parameters are found by identity, gradients by
        # identity checked against a weak reference (an id may be reused once a gradient is freed).
        if func not in _METADATA:
            engine = self._ref()
            if engine is not None:
                block_of = self._ids
                hit = _blocks_in(args, block_of, self._grads, None)
                if kwargs:
                    hit = _blocks_in(kwargs.values(), block_of, self._grads, hit)
                if hit is not None:
                    engine.fence_wait(hit)
        return func(*args, **(kwargs or {}))


def _blocks_in(values, block_of, grads, hit):
    for a in values:
        if isinstance(a, torch.Tensor):
            b = block_of.get(id(a))
            if b is None and a._base is not None:  # a view of a parameter, or of a shard
                b = block_of.get(id(a._base))
            if b is None:
                e = grads.get(id(a))
                b = e[0] if e is not None and e[1]() is a else None
            if b is not None:
                hit = {b} if hit is None else hit | {b}
        elif type(a) in (list, tuple):
            hit = _blocks_in(a, block_of, grads, hit)
    return hit
