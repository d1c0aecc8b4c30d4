"""What the parts of HybridAdamW share."""

import torch

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
MOMENTS = STATE_KEYS[:2]  # m and v: kept in the state format (fp32, bf16 or 8-bit); the rest in fp32


def is_sharded(p) -> bool:
    """Whether p is a DTensor (a parameter sharded by FSDP2's fully_shard)."""
    return type(p).__name__ == "DTensor" and hasattr(p, "to_local")


def local(t):
    """The tensor a DTensor holds on this rank (its shard), else t itself; never part of a graph."""
    if is_sharded(t):
        with torch.no_grad():
            return t.to_local()
    return t


# Layouts. The native kernels see a tensor as its span of memory: a parameter may have any dense,
# non-overlapping layout (contiguous, channels_last...), and every buffer of its state has the same
# strides, so that element i of the span is the same element of the parameter in each of them.

def dense(t) -> bool:
    """Whether t's elements fill one span of memory without gaps or overlaps, in some order of its
    dimensions (contiguous, channels_last, a transpose of either)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def like(buf, w):
    """``buf`` (contiguous, of w's shape) with w's strides: the same memory, the element order of w."""
    if w.is_contiguous() or tuple(buf.shape) != tuple(w.shape):
        return buf
    return buf.as_strided(w.shape, w.stride())


def span(t):
    """A dense tensor's elements in memory order, as a 1-D view (the native kernels' view of it)."""
    return t.reshape(-1) if t.is_contiguous() else t.as_strided((t.numel(),), (1,))


def in_order_of(x, w):
    """Values ``x`` (w's elements, in w's logical order or flat in that order) flat in w's memory
    order: what an 8-bit buffer of w's moment codes."""
    if w.is_contiguous():
        return x.reshape(-1)
    out = torch.empty_strided(w.shape, w.stride(), dtype=x.dtype, device=x.device)
    out.copy_(x.reshape(w.shape))
    return span(out)


def from_order_of(x, w):
    """The inverse of :func:`in_order_of`: values flat in w's memory order, as a tensor of w's shape
    (with its strides)."""
    return x.reshape(w.shape) if w.is_contiguous() else x.reshape(-1).as_strided(w.shape, w.stride())


def convert_moment(x, key, dtype, w):
    """``quant8.convert`` of moment ``key`` of parameter ``w``: 8-bit codes are in w's memory order."""
    from .. import quant8

    if dtype == torch.uint8 and x.dtype != torch.uint8:
        return quant8.convert(in_order_of(x, w), key, dtype, (w.numel(),))
    if x.dtype == torch.uint8 and dtype != torch.uint8:
        return from_order_of(quant8.convert(x, key, dtype, (w.numel(),)), w)
    return quant8.convert(x, key, dtype, w.shape)
