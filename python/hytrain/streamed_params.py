"""The class a streamed parameter (window.py) has while its layer streams: its device storage is
empty between uses, and an operation that would read or write it then raises a RuntimeError
naming the problem instead of touching freed memory (which would crash the interpreter)."""

from __future__ import annotations

import torch
from torch import nn

# What may be asked of a streamed parameter whose layer is not on the device: its metadata, its
# gradient, hooks, aliases (which stay guarded). Everything else would read or write freed memory.
_METADATA = frozenset({
    "shape", "size", "dim", "ndim", "dtype", "device", "layout", "numel", "nelement", "element_size", "itemsize",
    "nbytes", "stride", "storage_offset", "is_contiguous", "is_cuda", "is_cpu", "is_meta", "is_sparse",
    "is_quantized", "is_nested", "is_floating_point", "is_complex", "get_device", "data_ptr", "untyped_storage",
    "requires_grad", "requires_grad_", "grad", "_grad", "grad_fn", "is_leaf", "retains_grad", "_version",
    "_base", "_is_view", "output_nr", "names", "data", "detach", "register_hook",
    "register_post_accumulate_grad_hook", "empty_like", "zeros_like", "ones_like", "full_like", "new_empty",
    "new_zeros", "new_ones", "new_full", "__reduce_ex__", "__setstate__",
    "__class__", "_cdata", "_backward_hooks", "_post_accumulate_grad_hooks", "__dict__",
})
_ALIASES = frozenset({"data", "detach"})


def _func_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _guard(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    name = _func_name(func)
    with torch._C.DisableTorchFunctionSubclass():
        if name not in _METADATA:
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(t, _GUARDED) and t.numel() and t.untyped_storage().nbytes() == 0:
                    raise RuntimeError(
                        f"{name}() on a streamed parameter of shape {tuple(t.shape)} outside its layer's forward "
                        "and backward: its weights live in host memory then (hytrain.stream_model); read "
                        "model.state_dict() or WeightWindow.home(p) instead")
        out = func(*args, **kwargs)
    if name in _ALIASES and isinstance(out, torch.Tensor) and not isinstance(out, _GUARDED):
        out = out.as_subclass(StreamedTensor)  # an alias of the same storage stays guarded
    return out


class StreamedParameter(nn.Parameter):
    """A streamed parameter (its class while its layer streams): an operation that would read or
    write its weights while its layer is off the device raises RuntimeError instead of touching freed
    memory. Metadata, ``.grad`` and hooks pass."""

    __torch_function__ = classmethod(_guard)


class StreamedTensor(torch.Tensor):
    """An alias of a streamed parameter (``p.data``, ``p.detach()``), guarded as it is."""

    __torch_function__ = classmethod(_guard)


_GUARDED = (StreamedParameter, StreamedTensor)
