"""Fused multi-tensor AdamW on the GPU, validated here, computed in ``hytrain_native``.

One launch updates a fixed list of tensors: fp32 master weights and Adam states resident on one GPU,
gradients in fp32, bf16 or fp16 (one dtype per group), and optionally the model's bf16/fp16 weights
written in place. Results are bit-identical to :func:`hytrain.adamw_step` on the CPU (AVX2/AVX-512
paths) for the same inputs. The gradient multiplier and a non-finite flag may be device tensors, so
no host synchronisation is needed; a non-zero ``found_inf`` makes the step a no-op on the device.

The group records the tensors' addresses: gradients must arrive in the same buffers every step (as
they do in the pipeline's flat gradient buffers), and the tensors must outlive the group, which keeps
references to them.
"""

from __future__ import annotations

import torch

from . import _checks
from ._native import native

_FP32 = (torch.float32,)


class CudaAdamW:
    """A fused AdamW over lists of same-length CUDA tensors.

    Args:
        params: fp32 CUDA tensors, contiguous, one device.
        exp_avgs, exp_avg_sqs: all fp32, all bf16 (compact states: updated in fp32, stored
            stochastically rounded exactly as :func:`hytrain.adamw_step` rounds them), or all
            8-bit buffers (uint8, ``hytrain.quant8``: quantised exactly as the CPU kernel does).
        grads: gradients, all fp32, all bf16 or all fp16, matching sizes.
        weights: optional bf16/fp16 model weights receiving the updated values.
        max_exp_avg_sqs: required with ``amsgrad=True`` (fp32 states only).
        seeds: each tensor's stochastic-rounding seed (bf16 states; default 0), the ``seed`` the
            CPU kernel would be given for it.
    """

    def __init__(self, params, exp_avgs, exp_avg_sqs, grads, *, weights=None, amsgrad=False,
                 max_exp_avg_sqs=None, seeds=None):
        lists = {"params": params, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "grads": grads}
        if weights is not None:
            lists["weights"] = weights
        if amsgrad:
            if max_exp_avg_sqs is None:
                raise ValueError("max_exp_avg_sqs is required when amsgrad=True")
            lists["max_exp_avg_sqs"] = max_exp_avg_sqs
        elif max_exp_avg_sqs is not None:
            raise ValueError("max_exp_avg_sqs was given but amsgrad=False")
        for name, seq in lists.items():
            if not isinstance(seq, (list, tuple)):
                raise TypeError(f"{name} must be a list of tensors, got {type(seq).__name__}")
            if len(seq) != len(params):
                raise ValueError(f"{name} has {len(seq)} tensors but params has {len(params)}")
        if not params:
            raise ValueError("params is empty")
        if not isinstance(params[0], torch.Tensor) or params[0].device.type != "cuda":
            dev = getattr(params[0], "device", type(params[0]).__name__)
            raise ValueError(f"params[0] must be a CUDA tensor, got {dev}")
        device = params[0].device
        grad_dtype = getattr(grads[0], "dtype", None)
        weight_dtype = getattr(weights[0], "dtype", None) if weights is not None else None
        # Gradients (and weights) share one dtype per group: the first tensor's, if it is allowed.
        def one_dtype(first, allowed_dtypes):
            return (first,) if first in allowed_dtypes else allowed_dtypes

        state = _checks.state_dtype(exp_avgs[0], exp_avg_sqs[0], amsgrad=amsgrad)
        seeds = [0] * len(params) if seeds is None else list(seeds)
        if len(seeds) != len(params):
            raise ValueError(f"seeds has {len(seeds)} values but params has {len(params)}")
        seeds = [_checks.integer(f"seeds[{i}]", x, lo=0, hi=2**32 - 1) for i, x in enumerate(seeds)]
        allowed = {k: _FP32 for k in lists}
        allowed["exp_avgs"] = allowed["exp_avg_sqs"] = (state,)
        allowed["grads"] = one_dtype(grad_dtype, tuple(_checks.DTYPE_CODES))
        allowed["weights"] = one_dtype(weight_dtype, _checks.HALF_DTYPES)
        rows = []
        for i, p in enumerate(params):
            n = _checks.tensor(f"params[{i}]", p, dtypes=_FP32, device="cuda").numel()
            ts = {k: seq[i] for k, seq in lists.items()}
            for k, t in ts.items():
                if k in ("exp_avgs", "exp_avg_sqs"):
                    _checks.state_tensor(f"{k}[{i}]", t, dtype=state, n=n, device="cuda")
                else:
                    _checks.tensor(f"{k}[{i}]", t, dtypes=allowed[k], numel=n, device="cuda")
                if t.device != device:
                    raise ValueError(f"{k}[{i}] is on {t.device} but params[0] is on {device}")
            _checks.distinct(**{f"{k}[{i}]": t for k, t in ts.items()})
            addr = _checks.address
            rows.append((addr(p), addr(ts["exp_avgs"]), addr(ts["exp_avg_sqs"]),
                         addr(ts.get("max_exp_avg_sqs")), addr(ts["grads"]),
                         addr(ts.get("weights")), n, seeds[i]))
        if not native().cuda_available():
            raise RuntimeError("CudaAdamW needs hytrain built with CUDA and a usable GPU")
        self._refs = lists  # keep the tensors alive as long as the group holds their addresses
        self.amsgrad = bool(amsgrad)
        self.device = device
        self._group = native().CudaAdamWGroup(
            rows, _checks.DTYPE_CODES[grad_dtype], weights is not None,
            _checks.DTYPE_CODES[weight_dtype] if weight_dtype is not None else 1, self.amsgrad,
            device.index if device.index is not None else torch.cuda.current_device(),
            _checks.STATE_CODES[state])
        self.state_dtype = state

    def step(self, *, step: int, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
             weight_decay: float = 1e-2, decoupled: bool = True, grad_scale: float = 1.0,
             grad_scale_tensor: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
             stream: torch.cuda.Stream | None = None) -> None:
        """Enqueues one step on ``stream`` (default: the current stream of the group's device).

        The gradient multiplier is ``grad_scale * grad_scale_tensor`` (a one-element fp32 tensor on
        the device, optional); a non-zero ``found_inf`` (likewise) skips the update on the device.
        """
        step, lr, beta1, beta2, eps, weight_decay, grad_scale = _checks.adamw_hparams(
            step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            grad_scale=grad_scale)
        ptrs = []
        for name, t in (("grad_scale_tensor", grad_scale_tensor), ("found_inf", found_inf)):
            if t is None:
                ptrs.append(0)
                continue
            _checks.tensor(name, t, dtypes=_FP32, numel=1, device="cuda")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but the group is on {self.device}")
            ptrs.append(t.data_ptr())
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        elif stream.device != self.device:
            raise ValueError(f"stream is on {stream.device} but the group is on {self.device}")
        self._group.step(step, lr, beta1, beta2, eps, weight_decay, bool(decoupled), self.amsgrad,
                         grad_scale, ptrs[0], ptrs[1], stream.cuda_stream)
