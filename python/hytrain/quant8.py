"""8-bit optimizer states (``state_format="8bit"``): the buffer layout and the conversions to and
from fp32, in torch, with the maps of the native kernels (``core/include/hytrain/quant8.h``).

A moment of ``n`` elements is one flat ``uint8`` tensor of :func:`state_bytes` ``(n)``: ``n`` codes,
zero padding to a multiple of 64 bytes, then one fp32 scale per block of :data:`BLOCK` elements.
``exp_avg`` (m): element ``i`` is ``value[code_i] * scale`` under the signed map, the scale being
the block's largest ``|m|``. ``exp_avg_sq`` (v) is kept as its square root ``u``, under the unsigned
map with the block's largest ``u`` as scale, and a nonzero ``u`` never coded 0; ``v = u * u``. All-zero
bytes are a fresh (zero) state. :func:`quantize` encodes exactly as the CPU and CUDA kernels do, so
a state converted here continues as if updated there.
"""

from __future__ import annotations

import functools
import math

import torch

BLOCK = 256  # elements per scale
_CODE_ALIGN = 64  # bytes: the scales start on a cache line


def codes_bytes(n: int) -> int:
    return -(-n // _CODE_ALIGN) * _CODE_ALIGN


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def state_bytes(n: int) -> int:
    """Bytes of one 8-bit moment of ``n`` elements: codes, padding, block scales."""
    return codes_bytes(n) + 4 * blocks(n)


@functools.lru_cache(maxsize=2)
def _map(signed: bool):
    """(value[256], midpoints between consecutive magnitudes) of a map, from the native library."""
    from ._native import native

    value, mid = native().q8_map(signed)
    mid = [x for x in mid if x != float("inf")]
    return torch.tensor(value, dtype=torch.float32), torch.tensor(mid, dtype=torch.float32)


def _signed(key: str) -> bool:
    if key not in ("exp_avg", "exp_avg_sq"):
        raise ValueError(f"8-bit states are 'exp_avg' or 'exp_avg_sq', got {key!r}")
    return key == "exp_avg"


def quantize(x: torch.Tensor, key: str, scales: torch.Tensor | None = None) -> torch.Tensor:
    """The 8-bit buffer of moment ``key`` (``"exp_avg"`` or ``"exp_avg_sq"``) from its values ``x``
    (any shape and floating dtype, converted to fp32; CPU). ``scales``: the blocks' scales to code
    against (one per block; of m, or of v's root), instead of each block's largest magnitude -- the
    saved scales of values that came from 8-bit states, so that those states come back exactly
    (a block whose largest m is negative has a scale above it: the signed map has no -1)."""
    signed = _signed(key)
    x = x.detach().to("cpu", torch.float32).reshape(-1)
    if not signed:
        x = x.sqrt()  # v is kept as its root
    n = x.numel()
    out = torch.zeros(state_bytes(n), dtype=torch.uint8)
    if not n:
        return out
    padded = torch.zeros(blocks(n) * BLOCK, dtype=torch.float32)
    padded[:n] = x
    if scales is None:
        scale = padded.view(-1, BLOCK).abs().amax(dim=1)
    elif scales.numel() != blocks(n):
        raise ValueError(f"{key}: {scales.numel()} scales for {blocks(n)} blocks of {n} elements")
    else:
        scale = scales.detach().to("cpu", torch.float32).reshape(-1).clone()
    inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, 1.0), 0.0)
    y = (padded.view(-1, BLOCK) * inv[:, None]).reshape(-1)[:n]
    _, mid = _map(signed)
    j = torch.searchsorted(mid, y.abs().contiguous(), right=False)  # midpoints below |y|
    if signed:
        j = torch.where((y < 0) & (j > 0), 128 + j.clamp(max=127), j)
    else:
        j = torch.where((y > 0) & (j == 0), 1, j)  # a nonzero root is never coded 0
    out[:n] = j.to(torch.uint8)
    out[codes_bytes(n):] = scale.view(torch.uint8)
    return out


def dequantize(buf: torch.Tensor, n: int, key: str) -> torch.Tensor:
    """The fp32 values of moment ``key`` (``n`` of them, flat, on the CPU) an 8-bit buffer holds."""
    signed = _signed(key)
    buf = buf.detach().to("cpu").reshape(-1)
    value, _ = _map(signed)
    scale = buf[codes_bytes(n):state_bytes(n)].clone().view(torch.float32)
    x = value[buf[:n].long()] * scale.repeat_interleave(BLOCK)[:n]
    return x if signed else x * x


def convert(x: torch.Tensor, key: str, dtype: torch.dtype, shape) -> torch.Tensor:
    """Moment ``key``'s tensor ``x`` (an 8-bit buffer, or floating values) in the format of ``dtype``
    (``torch.uint8``: an 8-bit buffer; else values of ``shape``), on ``x``'s device: quantised as the
    kernels quantise, dequantised to the values the buffer holds, or cast (to nearest)."""
    if dtype == torch.uint8:
        return x if x.dtype == torch.uint8 else quantize(x, key).to(x.device)
    if x.dtype == torch.uint8:
        x = dequantize(x, math.prod(shape), key).view(shape).to(x.device)
    return x.to(dtype)

