"""Argument checks run before any tensor's address crosses into native code.

Every failure names the argument and says what was expected, as TypeError (wrong kind or dtype) or
ValueError (wrong device, layout, size or value).
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch

from . import state_formats

# Codes shared with hytrain::DType in core/include/hytrain/dtype.h (the states': hytrain.state_formats).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
STATE_CODES = {f.dtype: f.code for f in state_formats.FORMATS.values()}
HALF_DTYPES = (torch.bfloat16, torch.float16)


def tensor(name: str, t, *, dtypes, numel: int | None = None, device: str = "cpu") -> torch.Tensor:
    """Checks that ``t`` is a dense, contiguous, aligned tensor on ``device`` of one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {str(t.dtype).replace('torch.', '')}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.device.type != device:
        raise ValueError(f"{name} must be on the {device} device, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first); strides {t.stride()}")
    if numel is not None and t.numel() != numel:
        raise ValueError(
            f"{name} has {t.numel()} elements (shape {tuple(t.shape)}) but {numel} were expected"
        )
    if t.numel() > 0 and t.data_ptr() % t.element_size() != 0:
        raise ValueError(f"{name} is not aligned to its element size ({t.element_size()} bytes)")
    return t


def address(t: torch.Tensor | None) -> int:
    """The address handed to native code: 0 for a missing or empty tensor."""
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def distinct(**tensors: torch.Tensor | None) -> None:
    """Checks that the given (non-empty) tensors do not share memory."""
    spans = []
    for name, t in tensors.items():
        if t is None or t.numel() == 0:
            continue
        start = t.data_ptr()
        spans.append((start, start + t.numel() * t.element_size(), name))
    spans.sort()
    for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise ValueError(f"{name_a} and {name_b} overlap in memory; they must be separate tensors")


def real(name: str, x, *, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False, hi_open: bool = False) -> float:
    """Checks a finite real scalar within [lo, hi] (or open ends)."""
    if isinstance(x, bool) or not isinstance(x, Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    if lo is not None and (x < lo or (lo_open and x == lo)):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {x}")
    if hi is not None and (x > hi or (hi_open and x == hi)):
        raise ValueError(f"{name} must be {'<' if hi_open else '<='} {hi}, got {x}")
    return x


def integer(name: str, x, *, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, Integral):
        raise TypeError(f"{name} must be an integer, got {type(x).__name__}")
    x = int(x)
    if lo is not None and x < lo:
        raise ValueError(f"{name} must be >= {lo}, got {x}")
    if hi is not None and x > hi:
        raise ValueError(f"{name} must be <= {hi}, got {x}")
    return x


STATE_DTYPES = tuple(f.dtype for f in state_formats.FORMATS.values())


def state_numel(dtype, n: int) -> int:
    """The elements of a moment of an n-element parameter in the format of buffers of ``dtype``: n, or
    for blockwise ones (8-bit) the bytes of its buffer (codes and block scales, hytrain.quant8)."""
    return state_formats.of_dtype(dtype).moment_numel(n)


def state_tensor(name: str, t, *, dtype, n: int, device: str = "cpu") -> torch.Tensor:
    """A moment buffer: ``tensor``'s checks with the state's size; blockwise (8-bit) buffers 4-byte
    aligned (their scales are fp32)."""
    tensor(name, t, dtypes=(dtype,), numel=state_numel(dtype, n), device=device)
    fmt = state_formats.of_dtype(dtype)
    if fmt.blockwise and t.data_ptr() % 4:
        raise ValueError(f"{name} (an {fmt.label} state buffer) must start at a 4-byte aligned address")
    return t


def state_dtype(exp_avg, exp_avg_sq, *, amsgrad: bool) -> torch.dtype:
    """The dtype of m and v: both float32, both bfloat16 (compact states) or both uint8 (8-bit
    states, hytrain.quant8); the compact formats without amsgrad."""
    dtype = getattr(exp_avg, "dtype", None)
    if dtype not in STATE_DTYPES:
        return torch.float32  # the tensor check names what is wrong
    other = getattr(exp_avg_sq, "dtype", None)
    if other in STATE_DTYPES and other != dtype:
        raise TypeError(f"exp_avg and exp_avg_sq must have one dtype; got {str(dtype).replace('torch.', '')} "
                        f"and {str(other).replace('torch.', '')}")
    if amsgrad and not state_formats.of_dtype(dtype).amsgrad:
        raise ValueError("amsgrad needs float32 exp_avg and exp_avg_sq (compact bfloat16 and 8-bit states have no "
                         "max_exp_avg_sq)")
    return dtype


def adamw_hparams(*, step, lr, betas, eps, weight_decay, grad_scale):
    """Validates AdamW hyperparameters; returns (step, lr, beta1, beta2, eps, weight_decay, grad_scale)."""
    step = integer("step", step, lo=1)
    lr = real("lr", lr, lo=0.0)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    beta1 = real("betas[0]", betas[0], lo=0.0, hi=1.0, hi_open=True)
    beta2 = real("betas[1]", betas[1], lo=0.0, hi=1.0, hi_open=True)
    eps = real("eps", eps, lo=0.0)  # 0 as torch: a zero m over a zero v is then 0/0, NaN, as in torch's
    weight_decay = real("weight_decay", weight_decay, lo=0.0)
    grad_scale = real("grad_scale", grad_scale)
    return step, lr, beta1, beta2, eps, weight_decay, grad_scale
