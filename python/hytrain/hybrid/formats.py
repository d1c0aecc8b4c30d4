"""State formats: the parameters a state can be made for (dense fp32/bf16/fp16 tensors on one
device), and the tensors each parameter's state has -- m and v in the state format's dtype and shape
(fp32, bf16, or 8-bit flat buffers), amsgrad's max v and the master in fp32, shaped like the
weights (the local shard of an FSDP2-sharded parameter)."""

from __future__ import annotations

import torch

from .._native import native
from .common import MOMENTS, PARAM_DTYPES, dense, local


def check_params(params) -> torch.device:
    """The one device of dense, contiguous fp32/bf16/fp16 parameters (the shards of sharded ones)."""
    if not params:
        raise ValueError("HybridAdamW got an empty parameter list")
    devices = set()
    for i, p in enumerate(params):
        p = local(p)
        if p.dtype not in PARAM_DTYPES:
            raise TypeError(f"parameter {i} (shape {tuple(p.shape)}) has dtype {p.dtype}; HybridAdamW supports "
                            "float32, bfloat16 and float16")
        if p.layout != torch.strided or not dense(p):
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}, strides {p.stride()}) must be dense: "
                             "contiguous, channels_last or another layout without gaps or overlaps")
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"parameter {i} is on {p.device}; HybridAdamW supports CPU and CUDA")
        devices.add(p.device)
    if len(devices) > 1:
        raise ValueError(f"parameters are on mixed devices ({sorted(map(str, devices))}); put them on one")
    device = devices.pop()
    if device.type == "cuda" and not native().cuda_available():
        raise RuntimeError("CUDA parameters need hytrain built with CUDA (this build has no GPU support)")
    return device


def state_keys(plan, p, cuda) -> list:
    """The state's tensors (with the fp32 master for every CUDA or low-precision parameter)."""
    keys = list(MOMENTS) + (["max_exp_avg_sq"] if plan.amsgrad(p) else [])
    if p.dtype != torch.float32 or cuda:
        keys.append("master")
    return keys


def key_dtype(settings, key) -> torch.dtype:
    """m and v in the state format's dtype; the master (and amsgrad's max v) in fp32."""
    return settings.state_dtype if key in MOMENTS else torch.float32


def key_shape(settings, w, key) -> tuple:
    """m and v shaped for the state format (8-bit: flat buffers); the rest like the weights."""
    return settings.moment_shape(w.shape) if key in MOMENTS else w.shape
