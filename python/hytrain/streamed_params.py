"""The class a streamed parameter (window.py) has while its layer streams: its device storage is
empty between uses, and an operation that would read or write it then raises a RuntimeError
naming the problem instead of touching freed memory (which would crash the interpreter)."""

from __future__ import annotations

from collections import OrderedDict

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
    "_has_compatible_shallow_copy_type", "is_set_to", "_is_zerotensor", "is_inference", "is_pinned",
})
_ALIASES = frozenset({"data", "detach"})


def _func_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _stays(name, args, kwargs) -> bool:
    """Whether ``to``/``cuda``/``cpu`` on args[0] asks for the device and dtype it has (a module's
    ``.to(device)`` of a streamed model, as the Trainer, accelerate and Lightning do: a no-op)."""
    t = args[0] if args else None
    if not isinstance(t, torch.Tensor):
        return False
    if name == "to":
        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
        except (TypeError, RuntimeError):
            return False
        if device is not None and torch.device(device).type == t.device.type and torch.device(device).index is None:
            device = t.device
        return (device is None or torch.device(device) == t.device) and (dtype is None or dtype == t.dtype) \
            and memory_format in (None, torch.preserve_format)
    if name == "cuda":
        want = args[1] if len(args) > 1 else kwargs.get("device")
        if want is None:
            return t.is_cuda and t.device.index == torch.cuda.current_device()
        want = torch.device("cuda", want) if isinstance(want, int) else torch.device(want)
        return t.is_cuda and (want.index is None or want == t.device)
    if name == "cpu":
        return t.device.type == "cpu"
    return False


def _empty(t) -> bool:
    return isinstance(t, _GUARDED) and t.numel() > 0 and t.untyped_storage().nbytes() == 0


def _first_empty(args, kwargs):
    """The first guarded tensor with an empty storage among the arguments (and in lists or tuples of
    them, as torch.cat and the foreach operations take them), else None."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            for t in a:
                if _empty(t):
                    return t
        elif _empty(a):
            return a
    return None


def _guard(cls, func, types, args=(), kwargs=None):
    # Hot: every operation on a streamed parameter, in its layer's forward too. What costs is only
    # looked at where a guarded argument is empty (its layer off the device).
    kwargs = kwargs or {}
    if getattr(func, "__name__", "") == "__set__" and _func_name(func) == "data" and len(args) > 1 \
            and isinstance(args[0], _GUARDED) and args[1] is not args[0]:  # (a module's no-op .to sets itself)
        raise RuntimeError(  # the window would load its home into the new storage: the write would be lost
            f"assigning .data of a streamed parameter of shape {tuple(args[0].shape)}: its weights live in host "
            "memory (hytrain.stream_model); change them before stream_model, or write window.home(p)")
    with torch._C.DisableTorchFunctionSubclass():
        t = _first_empty(args, kwargs)
        if t is not None:
            name = _func_name(func)
            if name == "__repr__" and args and args[0] is t:
                return (f"{type(t).__name__}(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device}: streamed, "
                        "its weights in host memory)")
            if name not in _METADATA and not (name in ("to", "cuda", "cpu") and _stays(name, args, kwargs)):
                raise RuntimeError(
                    f"{name}() on a streamed parameter of shape {tuple(t.shape)} outside its layer's forward "
                    "and backward: its weights live in host memory then (hytrain.stream_model). Read them "
                    "with model.state_dict() or WeightWindow.weights(p); change them before stream_model (a model "
                    "placed from the meta device: write window.home(p))")
        out = func(*args, **kwargs)
    if isinstance(out, torch.Tensor) and not isinstance(out, _GUARDED) and _func_name(func) in _ALIASES:
        out = out.as_subclass(StreamedTensor)  # an alias of the same storage stays guarded
    return out


class StreamedParameter(nn.Parameter):
    """A streamed parameter (its class while its layer streams): an operation that would read or
    write its weights while its layer is off the device raises RuntimeError instead of touching freed
    memory. Metadata, ``.grad`` and hooks pass. Pickled (``torch.save(model)``), it is a plain
    parameter holding its weights as of now, on the host."""

    __torch_function__ = classmethod(_guard)

    def __reduce_ex__(self, proto):
        from .window import window_for

        window = window_for([self])
        data = window.weights(self) if window is not None else torch.empty(0, dtype=self.dtype)
        return (torch._utils._rebuild_parameter, (data.detach().clone(), self.requires_grad, OrderedDict()))


class StreamedTensor(torch.Tensor):
    """An alias of a streamed parameter (``p.data``, ``p.detach()``), guarded as it is."""

    __torch_function__ = classmethod(_guard)


_GUARDED = (StreamedParameter, StreamedTensor)
