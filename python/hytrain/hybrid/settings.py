"""HybridAdamW's arguments, checked once: the hyperparameters torch's AdamW takes (and the switches
it has that change nothing here), and the engine's settings in one object, read by every part and
changed by none but ``set_gpu_blocks`` (k) and the planner (k, when auto)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .. import _checks, state_formats
from ..cpu_adam import simd_paths
from ..distributed import default_workers
from ..pool import PinnedPool, physical_memory_bytes


@dataclass
class Settings:
    max_grad_norm: float | None
    release_grads: bool
    accumulation_steps: int
    auto: bool  # k chosen by the planner
    gpu_blocks: int  # k now (the planner and set_gpu_blocks change it)
    schedule_every: int
    gpu_memory_request: int | None
    speculate: object  # "auto", False, or the first block (int)
    host_memory_limit: int
    fence: bool
    overlap: bool
    workers: int
    slice_elements: int
    trace: int  # iterations the timeline keeps (0: no timeline)
    pool: PinnedPool | None
    model: nn.Module | None
    blocks: list | None
    bucket_elements: int
    state_format: str  # a name of hytrain.state_formats (fp32, bf16, 8bit)
    watch_writes: bool = True  # fingerprints of the weights see writes their counters miss (writes.py)

    @property
    def format(self) -> state_formats.StateFormat:
        return state_formats.get(self.state_format)

    @property
    def state_dtype(self) -> torch.dtype:
        return self.format.dtype

    def moment_shape(self, shape) -> tuple:
        return self.format.moment_shape(shape)

    def moment_bytes(self, n) -> int:
        return self.format.moment_bytes(n)


def settings(*, max_grad_norm, release_grads, accumulation_steps, gpu_blocks, schedule_every, gpu_memory_limit,
             speculate, host_memory_limit, fence, overlap, workers, slice_elements, trace, pool, model, blocks,
             bucket_elements, state_format="fp32", watch_writes=True) -> Settings:
    """The engine's settings from HybridAdamW's keyword arguments (each checked, with its default)."""
    if max_grad_norm is not None:
        max_grad_norm = _checks.real("max_grad_norm", max_grad_norm, lo=0.0, lo_open=True)
    if release_grads is None:
        release_grads = max_grad_norm is not None
    if not isinstance(release_grads, bool):
        raise TypeError(f"release_grads must be True, False or None, got {release_grads!r}")
    if max_grad_norm is not None and not release_grads:
        raise ValueError("release_grads=False is for clipping outside the optimizer; with max_grad_norm "
                         "the optimizer clips itself and releases the gradients during backward")
    auto = isinstance(gpu_blocks, str)
    if auto and gpu_blocks != "auto":
        raise ValueError(f"gpu_blocks must be an integer >= 0 or 'auto', got {gpu_blocks!r}")
    k = 0 if (gpu_blocks is None or auto) else _checks.integer("gpu_blocks", gpu_blocks, lo=0)
    if gpu_memory_limit is not None:
        gpu_memory_limit = _checks.integer("gpu_memory_limit", gpu_memory_limit, lo=1)
    if speculate is True or speculate is None:
        speculate = 0
    if speculate not in ("auto", False):
        speculate = _checks.integer("speculate", speculate, lo=0)
    if host_memory_limit is None:
        host_memory_limit = int(physical_memory_bytes() * 0.75)
    if pool is not None and not isinstance(pool, PinnedPool):
        raise TypeError(f"pool must be a hytrain.PinnedPool, got {type(pool).__name__}")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(fence, bool):
        raise TypeError(f"fence must be True or False, got {fence!r}")
    if not isinstance(watch_writes, bool):
        raise TypeError(f"watch_writes must be True or False, got {watch_writes!r}")
    state_formats.get(state_format)  # (a ValueError naming the formats)
    simd_paths()  # a bad HYTRAIN_SIMD is refused here, not at the first step()
    # Default: every usable core but one, which the training thread needs to keep the GPU fed.
    workers = workers if workers is not None else default_workers()
    return Settings(
        max_grad_norm=max_grad_norm, release_grads=release_grads,
        accumulation_steps=_checks.integer("accumulation_steps", accumulation_steps, lo=1), auto=auto,
        gpu_blocks=k, schedule_every=_checks.integer("schedule_every", schedule_every, lo=1),
        gpu_memory_request=gpu_memory_limit, speculate=speculate,
        host_memory_limit=_checks.integer("host_memory_limit", host_memory_limit, lo=1), fence=fence,
        overlap=bool(overlap), workers=_checks.integer("workers", workers, lo=1),
        slice_elements=_checks.integer("slice_elements", slice_elements, lo=1024), trace=_trace(trace), pool=pool,
        model=model if blocks is None else None, blocks=blocks, bucket_elements=bucket_elements,
        state_format=state_format, watch_writes=watch_writes)


def _trace(trace) -> int:
    """Iterations the timeline keeps: True 3, False or None none, else the integer given."""
    if trace is True:
        return 3
    return 0 if trace is None or trace is False else _checks.integer("trace", trace, lo=0)


def _scalar(name, x) -> float:
    """A hyperparameter: a real number, or a one-element tensor (torch accepts both)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(x.shape)}")
        return float(x)
    return x


def validate_hparams(*, lr, betas, eps, weight_decay):
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError("betas must be either both floats or both Tensors")
    _checks.adamw_hparams(step=1, lr=_scalar("lr", lr), betas=tuple(_scalar("beta", b) for b in betas),
                          eps=_scalar("eps", eps), weight_decay=_scalar("weight_decay", weight_decay),
                          grad_scale=1.0)


# Every key of torch.optim.AdamW's param groups is in HybridAdamW's (``defaults``, ``param_groups``,
# ``state_dict()["param_groups"]``), with torch's values: lr, betas, eps, weight_decay, amsgrad and
# maximize act as in torch's; foreach and fused (implementation switches that change nothing here) take
# any of torch's values. Accepted with torch's default value only, refused otherwise (at construction,
# and at each step, where a loop may have set them): capturable (False), differentiable (False) and
# decoupled_weight_decay (True: AdamW's decoupled decay, which is what torch's AdamW always has -- it
# sets True over whatever a loaded state dict says, and so does load_state_dict here).
_REFUSED_FLAGS = {
    "capturable": "HybridAdamW does not support capturable=True (its step is not CUDA-graph capturable)",
    "differentiable": "HybridAdamW does not support differentiable=True (its update is not part of autograd)",
}


def check_flags(group, where) -> None:
    for name, why in _REFUSED_FLAGS.items():
        if group.get(name):
            raise ValueError(f"{where}: {why}")
    if not group.get("decoupled_weight_decay", True):
        raise ValueError(f"{where}: HybridAdamW is AdamW: decoupled_weight_decay must be True (torch.optim.Adam's "
                         f"L2 weight decay is not supported), got {group.get('decoupled_weight_decay')!r}")
    if not isinstance(group.get("maximize", False), bool):
        raise TypeError(f"{where}: maximize must be True or False, got {group.get('maximize')!r}")
    if group.get("foreach") not in (None, True, False) or group.get("fused") not in (None, True, False):
        raise TypeError(f"{where}: foreach and fused must be None, True or False")


def check_group_values(param_groups, amsgrad_bound=None, state_format="fp32") -> None:
    """Every group's values (checked at each step: a loop may set them); amsgrad may not switch once
    the state was created with it (``amsgrad_bound``: each group's value then), and needs fp32 states."""
    for i, g in enumerate(param_groups):
        if g.get("amsgrad") and not state_formats.get(state_format).amsgrad:
            keep = [f.name for f in state_formats.FORMATS.values() if f.amsgrad]
            raise ValueError(f"param_groups[{i}]: amsgrad needs state_format={keep[0]!r} (compact {state_format} "
                             "states keep no max_exp_avg_sq)")
        try:
            validate_hparams(lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"])
            check_flags(g, f"param_groups[{i}]")
        except (TypeError, ValueError) as e:
            raise type(e)(f"param_groups[{i}]: {e}") from None
        if amsgrad_bound is not None and bool(g["amsgrad"]) != amsgrad_bound[i]:
            raise ValueError(f"param_groups[{i}]: amsgrad was switched to {bool(g['amsgrad'])} after the "
                             f"first step created the state with amsgrad={amsgrad_bound[i]}; "
                             "HybridAdamW cannot change it mid-run (torch's AdamW fails on it too): "
                             "save the state, and load it into a new optimizer")


def check_state_value(i, key, val, shape) -> None:
    """A loaded state tensor must have the parameter's shape (``shape``) and a floating dtype; m and
    v may instead be 8-bit buffers (uint8, of the parameter's size), converted on the way in."""
    if key == "step" and isinstance(val, torch.Tensor) and val.numel() == 1:
        shape = val.shape  # torch keeps step as a 0-d tensor; older checkpoints as one element
    flat = state_formats.of_dtype(val.dtype) if isinstance(val, torch.Tensor) else None
    if key in ("exp_avg", "exp_avg_sq") and flat is not None and flat.blockwise:
        if val.shape != flat.moment_shape(shape):
            raise ValueError(f"parameter {i}: {flat.label} state {key!r} has shape {tuple(val.shape)}, expected "
                             f"{flat.moment_shape(shape)} (codes and block scales of {math.prod(shape)} elements)")
        return
    if not isinstance(val, torch.Tensor) or val.shape != shape:
        hint = ""
        like = [f for f in state_formats.FORMATS.values()
                if f.blockwise and getattr(val, "shape", None) == f.moment_shape(shape)]
        if key in ("exp_avg", "exp_avg_sq") and like:
            hint = f" (the size of an {like[0].label} state, which loads as {str(like[0].dtype)[6:]}, not {val.dtype})"
        raise ValueError(f"parameter {i}: state {key!r} has shape {getattr(val, 'shape', None)}, "
                         f"expected {tuple(shape)}{hint}")
    if not torch.is_floating_point(val):
        raise TypeError(f"parameter {i}: state {key!r} must be floating point, got {val.dtype}")


def view(path, doc):
    """A read-only attribute of HybridAdamW that is its engine's ``path`` (dotted)."""
    names = path.split(".")

    def get(self):
        obj = self._engine
        for name in names:
            obj = getattr(obj, name)
        return obj
    return property(get, doc=doc)


# The settings HybridAdamW reads as attributes (opt.fence, opt.max_grad_norm...).
SETTINGS_VIEWS = frozenset(("max_grad_norm", "release_grads", "accumulation_steps", "auto", "gpu_blocks",
                            "schedule_every", "speculate", "host_memory_limit", "fence", "overlap",
                            "watch_writes"))
