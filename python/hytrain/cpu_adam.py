"""The CPU AdamW step on torch tensors: validated here, computed in ``hytrain_native``.

One fused pass per tensor reads the fp32 master weight, m, v and the gradient (fp32, bf16 or fp16),
scales the gradient, updates m, v and the weight in place and can write a bf16/fp16 copy of the new
weight. The math is ``torch.optim.AdamW``'s (``decoupled=False`` gives ``torch.optim.Adam`` with L2
weight decay), with bias correction and optional amsgrad.
"""

from __future__ import annotations

import os

import torch

from . import _checks
from ._native import native

_SIMD_NAMES = ("auto", "scalar", "avx2", "avx512", "avx512vbmi")
_simd_path = None  # set_simd_path's choice; None: HYTRAIN_SIMD's, else auto
_env_checked = {}  # HYTRAIN_SIMD values found good


def _path_in_use() -> str:
    """set_simd_path's choice, else HYTRAIN_SIMD's (a bad value is a ValueError naming the
    variable, at every use), else "auto"."""
    if _simd_path is not None:
        return _simd_path
    name = os.environ.get("HYTRAIN_SIMD", "auto")
    if name not in _env_checked:  # checked once per value: adamw_step reads it at every call
        try:
            _env_checked[name] = _check_simd(name)
        except ValueError as e:
            raise ValueError(f"HYTRAIN_SIMD={name!r}: {e}") from None
    return _env_checked[name]


def simd_paths() -> dict:
    """The SIMD paths compiled in, which of them this CPU runs, and the one in use."""
    nat = native()
    compiled = list(nat.simd_paths_compiled())
    path = _path_in_use()
    return {
        "compiled": compiled,
        "supported": [p for p in compiled if nat.cpu_supports(p)],
        "selected": nat.best_simd_path() if path == "auto" else path,
    }


def set_simd_path(name: str) -> None:
    """Forces a SIMD path ("scalar", "avx2", "avx512", "avx512vbmi") for every later step; "auto" picks the best.

    The environment variable ``HYTRAIN_SIMD`` sets the initial choice.
    """
    global _simd_path
    _simd_path = _check_simd(name)


def _check_simd(name) -> str:
    if not isinstance(name, str) or name not in _SIMD_NAMES:
        raise ValueError(f"simd must be one of {', '.join(_SIMD_NAMES)}; got {name!r}")
    nat = native()
    if name != "auto" and not nat.cpu_supports(name):  # (not simd_paths(): it reads HYTRAIN_SIMD)
        supported = [p for p in nat.simd_paths_compiled() if nat.cpu_supports(p)]
        raise ValueError(f"simd path {name!r} is not available on this CPU/build (it runs {', '.join(supported)})")
    return name


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    decoupled: bool = True,
    amsgrad: bool = False,
    max_exp_avg_sq: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    param_copy: torch.Tensor | None = None,
    num_threads: int | None = None,
    simd: str | None = None,
    seed: int = 0,
) -> bool:
    """One AdamW step on CPU tensors, in place. Returns True if any gradient element was non-finite.

    ``param``, ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with ``amsgrad``) are contiguous
    float32 CPU tensors of the same number of elements; ``grad`` is float32, bfloat16 or float16;
    ``param_copy``, if given, is bfloat16 or float16 and receives the updated weight rounded to
    nearest even. ``step`` is the 1-based step count after this update (bias correction).
    ``grad_scale`` multiplies every gradient element (loss-scale unscaling times clip coefficient).
    The update is applied even when a non-finite gradient is reported.

    Compact states: ``exp_avg`` and ``exp_avg_sq`` may both be bfloat16. The update then runs in
    fp32 on their widened values and stores the new ones stochastically rounded, element ``i`` with
    random bits drawn from ``(seed, step, i)`` (the same on every SIMD path, thread count and on the
    GPU); amsgrad needs float32 states.

    8-bit states: ``exp_avg`` and ``exp_avg_sq`` may both be flat uint8 buffers of
    ``hytrain.quant8.state_bytes(n)`` bytes (codes and per-block scales; zeros are a fresh state).
    Each block of 256 elements is dequantised, updated in fp32 and quantised again against its new
    largest magnitude (``hytrain.quant8``).
    """
    fp32 = (torch.float32,)
    _checks.tensor("param", param, dtypes=fp32)
    n = param.numel()
    _checks.tensor("grad", grad, dtypes=tuple(_checks.DTYPE_CODES), numel=n)
    state_dtype = _checks.state_dtype(exp_avg, exp_avg_sq, amsgrad=amsgrad)
    _checks.state_tensor("exp_avg", exp_avg, dtype=state_dtype, n=n)
    _checks.state_tensor("exp_avg_sq", exp_avg_sq, dtype=state_dtype, n=n)
    seed = _checks.integer("seed", seed, lo=0, hi=2**32 - 1)
    if amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("max_exp_avg_sq is required when amsgrad=True")
        _checks.tensor("max_exp_avg_sq", max_exp_avg_sq, dtypes=fp32, numel=n)
    elif max_exp_avg_sq is not None:
        raise ValueError("max_exp_avg_sq was given but amsgrad=False")
    if param_copy is not None:
        _checks.tensor("param_copy", param_copy, dtypes=_checks.HALF_DTYPES, numel=n)
    _checks.distinct(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                     max_exp_avg_sq=max_exp_avg_sq, param_copy=param_copy)

    step, lr, beta1, beta2, eps, weight_decay, grad_scale = _checks.adamw_hparams(
        step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
    threads = 0 if num_threads is None else _checks.integer("num_threads", num_threads, lo=1)
    path = _path_in_use() if simd is None else _check_simd(simd)

    copy_code = _checks.DTYPE_CODES[param_copy.dtype] if param_copy is not None else 1
    addr = _checks.address
    return native().adamw_step(
        addr(param), addr(exp_avg), addr(exp_avg_sq), addr(max_exp_avg_sq), addr(grad),
        _checks.DTYPE_CODES[grad.dtype], addr(param_copy), copy_code, n,
        lr, beta1, beta2, eps, weight_decay, step, bool(decoupled), bool(amsgrad), grad_scale,
        threads, path, _checks.STATE_CODES[state_dtype], seed, 0,
    )
