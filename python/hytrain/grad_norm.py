"""Gradient norm and non-finite detection on the GPU, deterministic, without host synchronisation.

:class:`CudaGradNorm` sums the squares of a fixed list of CUDA tensors (fp32, bf16 or fp16, mixed) into
a device fp32 scalar and raises a device ``found_inf`` flag on any NaN or infinity. The order of every
addition depends only on the tensor list, so repeated runs give bitwise-identical sums. Call it once per
pipeline block, all into the same buffers, then :func:`clip_multiplier` turns the total into the AdamW
gradient multiplier that :class:`hytrain.CudaAdamW` reads from device memory.
"""

from __future__ import annotations

import torch

from . import _checks
from ._native import native

_FP32 = (torch.float32,)


def _stream_for(device: torch.device, stream):
    if stream is None:
        return torch.cuda.current_stream(device)
    if stream.device != device:
        raise ValueError(f"stream is on {stream.device} but the tensors are on {device}")
    return stream


def _scalar(name: str, t, device: torch.device, *, optional: bool = False):
    if t is None and optional:
        return 0
    _checks.tensor(name, t, dtypes=_FP32, numel=1, device="cuda")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the tensors are on {device}")
    return t.data_ptr()


class CudaGradNorm:
    """Sum of squares and non-finite detection over a fixed list of same-device CUDA tensors.

    The group records addresses: the tensors must keep their storage (as flat gradient buffers do) and
    outlive the group, which holds references to them.
    """

    def __init__(self, tensors):
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise ValueError("tensors must be a non-empty list of CUDA tensors")
        first = tensors[0]
        if not isinstance(first, torch.Tensor) or first.device.type != "cuda":
            raise ValueError(f"tensors[0] must be a CUDA tensor, got {getattr(first, 'device', first)!r}")
        self.device = first.device
        rows = []
        for i, t in enumerate(tensors):
            _checks.tensor(f"tensors[{i}]", t, dtypes=tuple(_checks.DTYPE_CODES), device="cuda")
            if t.device != self.device:
                raise ValueError(f"tensors[{i}] is on {t.device} but tensors[0] is on {self.device}")
            rows.append((_checks.address(t), t.numel(), _checks.DTYPE_CODES[t.dtype]))
        if not native().cuda_available():
            raise RuntimeError("CudaGradNorm needs hytrain built with CUDA and a usable GPU")
        self._tensors = list(tensors)
        self._group = native().CudaGradNormGroup(rows, self.device.index)

    @property
    def numel(self) -> int:
        return int(self._group.numel)

    def accumulate(self, sumsq: torch.Tensor, found_inf: torch.Tensor | None = None, *,
                   stream: torch.cuda.Stream | None = None) -> None:
        """Enqueues ``sumsq += sum(x**2)`` and ``found_inf = 1`` on any non-finite element.

        ``sumsq`` and ``found_inf`` are one-element fp32 CUDA tensors on the group's device.
        Calls of one group must stay ordered (one stream, or streams ordered by events).
        """
        a = _scalar("sumsq", sumsq, self.device)
        b = _scalar("found_inf", found_inf, self.device, optional=True)
        if b != 0 and a == b:
            raise ValueError("sumsq and found_inf must be separate tensors")
        self._group.accumulate(a, b, _stream_for(self.device, stream).cuda_stream)


def clip_multiplier(sumsq: torch.Tensor, out: torch.Tensor, *, max_norm: float | None,
                    inv_scale: torch.Tensor | None = None, host_inv_scale: float = 1.0,
                    stream: torch.cuda.Stream | None = None) -> None:
    """Enqueues ``out = s * min(1, max_norm / (sqrt(sumsq) * s + 1e-6))`` with ``s`` the unscale factor.

    ``s`` is ``inv_scale`` (a device scalar, e.g. GradScaler's) times ``host_inv_scale``; ``sumsq`` holds
    the sum of squares of the *scaled* gradients, so the norm compared with ``max_norm`` is that of the
    unscaled ones, as in ``clip_grad_norm_`` after ``GradScaler.unscale_``. ``max_norm=None`` only
    unscales.
    """
    if not isinstance(sumsq, torch.Tensor):
        raise TypeError(f"sumsq must be a torch.Tensor, got {type(sumsq).__name__}")
    device = sumsq.device
    a = _scalar("sumsq", sumsq, device)
    o = _scalar("out", out, device)
    s = _scalar("inv_scale", inv_scale, device, optional=True)
    mn = 0.0 if max_norm is None else _checks.real("max_norm", max_norm, lo=0.0, lo_open=True)
    his = _checks.real("host_inv_scale", host_inv_scale, lo=0.0, lo_open=True)
    native().cuda_clip_multiplier(a, s, his, mn, o, device.index,
                                  _stream_for(device, stream).cuda_stream)
