"""HybridAdamW: a drop-in ``torch.optim.AdamW`` whose fp32 master weights and Adam states live in
(pinned) host memory and are updated by hytrain's native CPU workers, overlapping backward.

How a step runs (CPU parameters; the GPU stages of the pipeline plug in at the same points):

* Parameters are grouped into *blocks*: the modules of the model's largest ``nn.ModuleList`` of repeated
  blocks, with the remaining parameters forming a head block (before them) and a tail block (after);
  or explicit ``blocks``; or, without a model, buckets of about ``bucket_elements`` in parameter order.
* A post-accumulate-grad hook counts each block's gradients. When a block's last gradient of the
  step's last micro-batch (``accumulation_steps``) has arrived, the block is queued to the native
  :class:`UpdateEngine`, whose workers update it while backward continues with earlier blocks.
* ``step()`` queues whatever is left, then waits (without a model), or returns at once with a model:
  a forward pre-hook on each block waits for that block's update just before it is used, so the
  updates also overlap the next forward.

Exact AdamW semantics (see ``docs/architecture.md``): gradient clipping (``max_grad_norm``) and loss
scaling (``torch.amp.GradScaler``) need every gradient before any update. In those modes the updates
are *deferred*: they start in ``step()`` once the global norm / overflow flag is known, and overlap the
next forward instead of backward. The first step is always deferred, because only ``step()`` reveals
whether a GradScaler drives the optimizer; fp16 parameters are assumed to be loss-scaled from the start.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from . import _checks
from ._native import native
from .cpu_adam import simd_paths
from .pool import PinnedPool

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def repeated_layers(model: nn.Module) -> nn.ModuleList | None:
    """The largest ``nn.ModuleList`` (by parameters) of two or more modules of one type, or None."""
    best, best_size = None, -1
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1:
            size = sum(p.numel() for p in m.parameters())
            if size > best_size:
                best, best_size = m, size
    return best


def detect_blocks(model: nn.Module, params) -> list[list[nn.Parameter]]:
    """Head, the children of :func:`repeated_layers`, tail (forward order)."""
    wanted = {id(p) for p in params}
    layers = repeated_layers(model)
    if layers is None:
        return [[p for p in model.parameters() if id(p) in wanted]]
    owner = {}
    for i, child in enumerate(layers):
        for p in child.parameters():
            owner.setdefault(id(p), i)
    head, tail, body = [], [], [[] for _ in layers]
    seen_body = False
    for p in model.parameters():
        if id(p) not in wanted:
            continue
        if id(p) in owner:
            body[owner[id(p)]].append(p)
            seen_body = True
        else:
            (tail if seen_body else head).append(p)
    return [b for b in [head, *body, tail] if b]


class HybridAdamW(torch.optim.Optimizer):
    """AdamW with host-resident fp32 master weights and states, updated by native CPU workers.

    Args:
        params: parameters (fp32, bf16 or fp16, leaves, one device type) or param-group dicts.
        lr, betas, eps, weight_decay, amsgrad: as ``torch.optim.AdamW``.
        max_grad_norm: global-norm clipping of the (unscaled) gradients, as ``clip_grad_norm_``.
        model: the module the parameters belong to; enables block detection and just-in-time waits.
        blocks: explicit blocks, each a module or a list of parameters (forward order).
        accumulation_steps: micro-batches per step; blocks are updated after the last one.
        workers: CPU update threads (default: the usable cores).
        pool: a :class:`hytrain.PinnedPool` for master weights and states (default: a new one).
        overlap: False updates everything inside ``step()`` (what overlap buys, for benchmarks).
    """

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale/found_inf instead of unscaling

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 amsgrad=False, max_grad_norm=None, model=None, blocks=None, gpu_blocks=0,
                 accumulation_steps=1, workers=None, pool=None, overlap=True,
                 bucket_elements=4 << 20, slice_elements=1 << 18):
        _checks.adamw_hparams(step=1, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, grad_scale=1.0)
        if max_grad_norm is not None:
            max_grad_norm = _checks.real("max_grad_norm", max_grad_norm, lo=0.0, lo_open=True)
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = _checks.integer("accumulation_steps", accumulation_steps, lo=1)
        if gpu_blocks not in (0, None):
            raise NotImplementedError("gpu_blocks > 0 needs CUDA parameters and the GPU pipeline, which "
                                      "this version does not have yet; use gpu_blocks=0")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=bool(amsgrad))
        super().__init__(params, defaults)
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._check_params(all_params)
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}

        if blocks is not None:
            self._blocks = []
            for i, b in enumerate(blocks):
                ps = list(b.parameters()) if isinstance(b, nn.Module) else list(b)
                self._blocks.append([p for p in ps if id(p) in self._group_of])
            covered = {id(p) for b in self._blocks for p in b}
            missing = [p for p in all_params if id(p) not in covered]
            if missing:
                raise ValueError(f"{len(missing)} optimizer parameter(s) are in no block of `blocks`")
        elif model is not None:
            if not isinstance(model, nn.Module):
                raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
            self._blocks = detect_blocks(model, all_params)
            covered = {id(p) for b in self._blocks for p in b}
            extra = [p for p in all_params if id(p) not in covered]
            if extra:  # optimizer parameters outside the model: one more block at the end
                self._blocks.append(extra)
        else:
            self._blocks, cur, size = [], [], 0
            for p in all_params:
                cur.append(p)
                size += p.numel()
                if size >= bucket_elements:
                    self._blocks.append(cur)
                    cur, size = [], 0
            if cur:
                self._blocks.append(cur)
        self._block_of = {}
        for i, b in enumerate(self._blocks):
            for p in b:
                if id(p) in self._block_of:
                    raise ValueError("a parameter appears in two blocks")
                self._block_of[id(p)] = i

        self._pool = pool if pool is not None else PinnedPool(
            max(64 << 20, 13 * sum(p.numel() for p in all_params) + (64 << 20)), slab_bytes="256MiB")
        if not isinstance(self._pool, PinnedPool):
            raise TypeError(f"pool must be a hytrain.PinnedPool, got {type(pool).__name__}")
        for p in all_params:
            self._init_state(p)
        n_workers = workers if workers is not None else max(1, len(os.sched_getaffinity(0)))
        n_workers = _checks.integer("workers", n_workers, lo=1)
        self._engine = native().UpdateEngine(n_workers, _checks.integer("slice_elements", slice_elements, lo=1024),
                                             simd_paths()["selected"])
        self.overlap = bool(overlap)
        self._loss_scaling = any(p.dtype == torch.float16 for p in all_params)
        self._steps_taken = 0
        self._arrivals = [0] * len(self._blocks)
        self._expected = [len(b) for b in self._blocks]
        self._submitted = [False] * len(self._blocks)
        self._inflight = {}  # block -> tensors the workers read (kept alive until done)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in all_params]
        self._model_hooks = []
        if model is not None and blocks is None:
            self._install_forward_hooks(model)

    # ---- setup ------------------------------------------------------------------------------------

    @staticmethod
    def _check_params(params):
        if not params:
            raise ValueError("HybridAdamW got an empty parameter list")
        device_types = set()
        seen = set()
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameter {i} is a {type(p).__name__}, not a tensor")
            if id(p) in seen:
                raise ValueError(f"parameter {i} appears more than once")
            seen.add(id(p))
            if not p.is_leaf:
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is not a leaf tensor; "
                                 "optimize the leaf (e.g. the nn.Parameter), not a result of an operation")
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(f"parameter {i} has dtype {p.dtype}; HybridAdamW supports float32, "
                                "bfloat16 and float16")
            if p.layout != torch.strided or not p.is_contiguous():
                raise ValueError(f"parameter {i} must be a dense contiguous tensor")
            device_types.add(p.device.type)
        if len(device_types) > 1:
            raise ValueError(f"parameters are on mixed devices ({sorted(device_types)}); put them on one")
        if device_types != {"cpu"}:
            raise NotImplementedError(
                f"parameters on {device_types.pop()}: this version of HybridAdamW runs the CPU path only "
                "(the GPU pipeline is not in this build); move the model to the CPU or use CudaAdamW")

    def _init_state(self, p):
        st = self.state[p]
        st["step"] = torch.zeros((), dtype=torch.float32)
        st["exp_avg"] = self._pool.zeros(p.shape, torch.float32)
        st["exp_avg_sq"] = self._pool.zeros(p.shape, torch.float32)
        if self._group_of[id(p)]["amsgrad"]:
            st["max_exp_avg_sq"] = self._pool.zeros(p.shape, torch.float32)
        if p.dtype != torch.float32:
            st["master"] = self._pool.empty(p.shape, torch.float32)
            st["master"].copy_(p.detach())

    def _install_forward_hooks(self, model):
        layers = repeated_layers(model)
        in_layers = set() if layers is None else {id(p) for p in layers.parameters()}
        edge = [i for i, b in enumerate(self._blocks) if id(b[0]) not in in_layers]  # head, tail
        self._model_hooks.append(model.register_forward_pre_hook(lambda *_: self._wait_blocks(edge)))
        if layers is not None:
            for child in layers:
                ps = list(child.parameters())
                ids = sorted({self._block_of[id(p)] for p in ps if id(p) in self._block_of})
                self._model_hooks.append(child.register_forward_pre_hook(
                    lambda *_, ids=ids: self._wait_blocks(ids)))

    # ---- the pipeline -----------------------------------------------------------------------------

    def _deferred(self) -> bool:
        return (not self.overlap or self._steps_taken == 0 or self.max_grad_norm is not None
                or self._loss_scaling)

    def _on_grad(self, p):
        b = self._block_of[id(p)]
        if self._submitted[b]:
            raise RuntimeError(
                f"gradients arrived for block {b} after it was already updated in this step: call "
                f"optimizer.step() after every {self.accumulation_steps} backward pass(es) "
                "(accumulation_steps)")
        self._arrivals[b] += 1
        if self._arrivals[b] >= self._expected[b] * self.accumulation_steps and not self._deferred():
            self._submit(b, 1.0)

    def _submit(self, b, grad_scale):
        rows, keep = [], []
        for p in self._blocks[b]:
            if p.grad is None:
                continue
            g = p.grad
            if g.is_sparse or g.layout != torch.strided:
                raise RuntimeError(f"HybridAdamW does not support sparse gradients (shape {tuple(p.shape)})")
            if not g.is_contiguous():
                g = g.contiguous()
            if g.dtype not in _checks.DTYPE_CODES or g.shape != p.shape or g.device != p.device:
                raise RuntimeError(f"gradient of a parameter of shape {tuple(p.shape)} has dtype {g.dtype}, "
                                   f"shape {tuple(g.shape)}, device {g.device}: it must match the parameter")
            group = self._group_of[id(p)]
            st = self.state[p]
            st["step"] += 1
            master = st.get("master", p)
            half = p.dtype != torch.float32
            vmax = st.get("max_exp_avg_sq")
            rows.append((master.data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(),
                         _checks.address(vmax), _checks.address(g), _checks.DTYPE_CODES[g.dtype],
                         p.data_ptr() if half else 0, _checks.DTYPE_CODES[p.dtype] if half else 1,
                         p.numel(), float(group["lr"]), float(group["betas"][0]), float(group["betas"][1]),
                         float(group["eps"]), float(group["weight_decay"]), int(st["step"].item()), True,
                         bool(group["amsgrad"]), float(grad_scale)))
            keep.append(g)
        self._engine.submit(b, rows)
        self._submitted[b] = True
        self._inflight[b] = keep

    def _wait_blocks(self, ids):
        for b in ids:
            if b in self._inflight:
                self._engine.wait(b)
                del self._inflight[b]

    def synchronize(self) -> None:
        """Waits for every queued update (the parameters are then current)."""
        self._wait_blocks(list(self._inflight))

    # ---- torch.optim.Optimizer API ----------------------------------------------------------------

    def _validate_group_values(self):
        for i, g in enumerate(self.param_groups):
            try:
                _checks.adamw_hparams(step=1, lr=g["lr"], betas=g["betas"], eps=g["eps"],
                                      weight_decay=g["weight_decay"], grad_scale=1.0)
            except (TypeError, ValueError) as e:
                raise type(e)(f"param_groups[{i}]: {e}") from None

    def _multiplier(self, grad_scale):
        inv = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        if self.max_grad_norm is None:
            return inv
        grads = [p.grad for b in range(len(self._blocks)) if not self._submitted[b]
                 for p in self._blocks[b] if p.grad is not None]
        if not grads:
            return inv
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads], 2)
        total = float(torch.linalg.vector_norm(torch.stack(norms).double())) * inv
        return inv * min(1.0, self.max_grad_norm / (total + 1e-6))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if grad_scale is not None or found_inf is not None:
            if not self._loss_scaling and any(self._submitted):
                raise RuntimeError("a GradScaler started driving HybridAdamW after updates had begun "
                                   "overlapping backward; create the optimizer with loss scaling in use "
                                   "from the first step")
            self._loss_scaling = True
        self._validate_group_values()
        try:
            if found_inf is not None and float(found_inf) != 0.0:
                return loss  # overflow: skip the step entirely, state untouched (torch's behaviour)
            mult = self._multiplier(grad_scale)
            if not math.isfinite(mult):
                raise RuntimeError(f"the gradient multiplier is {mult} (non-finite gradient norm)")
            for b in range(len(self._blocks)):
                if not self._submitted[b]:
                    self._submit(b, mult)
            self._steps_taken += 1
            if not self._model_hooks:
                self.synchronize()
        finally:
            self._arrivals = [0] * len(self._blocks)
            self._submitted = [False] * len(self._blocks)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if not set_to_none:
            self.synchronize()  # the workers may still read the gradients being zeroed
        super().zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        if hasattr(self, "_engine"):
            raise NotImplementedError("HybridAdamW does not support add_param_group after construction; "
                                      "pass every parameter group to the constructor")
        super().add_param_group(param_group)

    def state_dict(self):
        self.synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict):
        """Loads torch-format state (``exp_avg``, ``exp_avg_sq``, ``step``, and ``master`` when saved by
        HybridAdamW) into the existing host buffers. Everything is checked before anything changes."""
        self.synchronize()
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must have 'state' and 'param_groups' (from optimizer.state_dict())")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} param groups, the optimizer has {len(self.param_groups)}")
        index = {}
        for g_saved, g in zip(groups, self.param_groups):
            if len(g_saved["params"]) != len(g["params"]):
                raise ValueError("a saved param group has a different number of parameters")
            for i, p in zip(g_saved["params"], g["params"]):
                index[i] = p
        plan = []
        for i, st in state_dict["state"].items():
            if i not in index:
                raise ValueError(f"state_dict has state for unknown parameter index {i}")
            p = index[i]
            mine = self.state[p]
            for key, val in st.items():
                if key not in mine:
                    raise ValueError(f"parameter {i}: unexpected state {key!r}")
                if not isinstance(val, torch.Tensor) or val.shape != mine[key].shape:
                    raise ValueError(f"parameter {i}: state {key!r} has shape "
                                     f"{getattr(val, 'shape', None)}, expected {tuple(mine[key].shape)}")
                if not torch.is_floating_point(val):
                    raise TypeError(f"parameter {i}: state {key!r} must be floating point, got {val.dtype}")
                plan.append((mine[key], val))
        for dst, src in plan:
            dst.copy_(src)
        for g_saved, g in zip(groups, self.param_groups):
            for k, v in g_saved.items():
                if k != "params":
                    g[k] = v
