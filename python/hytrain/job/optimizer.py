"""The job's optimizer: HybridAdamW over the loaded model (its pinned pool within ``--pin-limit``, the
blocks updated on the GPU, the GPU memory it plans with), the learning-rate schedule (linear warm-up,
cosine decay to 10%), and the loss scaler of fp16 weights."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..blocks import detect_blocks
from ..hybrid import HybridAdamW
from ..pool import PinnedPool, parse_bytes
from .options import ConfigError


@dataclass
class Updates:
    """What updates the weights each step: the optimizer, its schedule, and fp16's loss scaler (None
    for other dtypes)."""
    opt: HybridAdamW
    sched: torch.optim.lr_scheduler.LambdaLR
    scaler: object = None


def lr_lambda(schedule):
    """The schedule's factor of the peak lr at each step (``schedule``: a SchedulePlan)."""
    def f(step):
        if step < schedule.warmup:
            return (step + 1) / schedule.warmup
        frac = (step - schedule.warmup) / max(1, schedule.steps - schedule.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return f


def build_optimizer(plan, schedule, model, device, dtype, ranks) -> Updates:
    """The build-optimizer phase (``plan``: an OptimizerPlan; ``schedule``: a SchedulePlan; ``model``:
    the loaded JobModel, sharded here over the ranks where loading did not). fp16 weights train with
    dynamic loss scaling (torch's GradScaler, which hands HybridAdamW the scale and the overflow flag:
    a step whose gradients overflowed is skipped, and the scale backs off)."""
    module = model.module
    pool = _pinned_pool(plan, model.n_params, device, ranks)
    k = plan.gpu_blocks if device.type == "cuda" else 0
    if k != "auto":
        k = min(k, len(detect_blocks(module, list(module.parameters()))))
    if not model.sharded:
        ranks.shard(module, device)
    limit = parse_bytes("gpu_memory_limit", plan.gpu_memory_limit) if plan.gpu_memory_limit else None
    opt = HybridAdamW(module.parameters(), lr=plan.lr, weight_decay=plan.weight_decay,
                      max_grad_norm=plan.max_grad_norm or None, model=module, pool=pool,
                      gpu_blocks=k, gpu_memory_limit=limit if device.type == "cuda" else None,
                      workers=plan.workers or None, trace=True,
                      speculate=False if plan.speculate == "off" else plan.speculate,
                      # The loop never reads the gradients after backward, and touches the weights
                      # only through the model's forward and the checkpoints, which wait for the
                      # updates: the fence for every other path (1-4 % on L3B) is not needed.
                      release_grads=True, fence=False, state_format=plan.state_format)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(schedule))
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    return Updates(opt, sched, scaler)


def _pinned_pool(plan, n_params: int, device, ranks) -> PinnedPool | None:
    """A pool of pinned memory within ``--pin-limit`` (None without one: the optimizer sizes its own),
    refused where this process's optimizer state would not fit in it."""
    if plan.pin_limit is None:
        return None
    state_bytes = n_params * (16 if device.type == "cuda" else 12) // ranks.world + (256 << 20)
    limit = parse_bytes("pin_limit", plan.pin_limit)
    if state_bytes > limit:
        raise ConfigError(f"the optimizer state of {n_params / 1e6:.1f} M parameters needs about "
                          f"{state_bytes / 2**30:.2f} GiB of pinned memory per process, over --pin-limit "
                          f"{plan.pin_limit}")
    return PinnedPool(limit)
