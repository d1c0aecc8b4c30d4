"""HybridAdamW: a drop-in ``torch.optim.AdamW`` whose fp32 master weights and Adam states live in
pinned host memory and are updated by hytrain's native CPU workers, overlapping backward and the next
forward; the first ``gpu_blocks`` blocks may instead be updated on the GPU by the fused CUDA AdamW.

How a step runs:

* Parameters are grouped into *blocks*: the modules of the model's largest ``nn.ModuleList`` of repeated
  blocks, with the remaining parameters forming a head block (before them) and a tail block (after);
  or explicit ``blocks``; or, without a model, buckets of about ``bucket_elements`` in parameter order.
* A post-accumulate-grad hook counts each block's gradients. When a block's last gradient of the
  step's last micro-batch (``accumulation_steps``) has arrived, the block is launched while backward
  continues with earlier blocks: CPU parameters go to the native :class:`UpdateEngine`; CUDA
  parameters go through the native ``OffloadPipeline`` (gradients copied to pinned memory on a D2H
  stream, CPU update, new weights copied back on an H2D stream), or, for the first k blocks, are
  updated on the GPU with their states resident there.
* ``step()`` launches whatever is left, then waits (without a model), or returns at once with a model:
  forward hooks wait for each block's update just before it is used, so the updates also overlap the
  next forward.

Exact AdamW semantics (see ``docs/architecture.md``): gradient clipping (``max_grad_norm``) and loss
scaling (``torch.amp.GradScaler``) need every gradient before any update. In those modes the updates
are *deferred*: they start in ``step()`` once the global norm / overflow flag is known, and overlap the
next forward instead of backward. The first step is always deferred, because only ``step()`` reveals
whether a GradScaler drives the optimizer; fp16 parameters are assumed to be loss-scaled from the start.

Clipping on CUDA may still update offloaded blocks during backward, *speculatively* (``speculate``):
the CPU writes the new state beside the current one, as if the multiplier were 1. If the global norm
then needs no clipping, step() adopts the new state, which is bit for bit what the deferred update
would have written; if it does, the speculative result is dropped and the block is updated again from
its untouched state with the clip multiplier. After a step that clipped, the next one does not
speculate (clipping comes in runs, early in training).

The loop's own clipping (``torch.nn.utils.clip_grad_norm_`` between backward and step, as transformers'
Trainer, accelerate and Lightning do it) is exact: unless the optimizer clips itself (``max_grad_norm``)
or is told that nothing reads the gradients after backward (``release_grads=True``), ``.grad`` is kept
until ``step()``, and blocks whose gradients were changed after their hand-off are updated again from
the changed ones. Then, and with ``max_grad_norm``, the updates are deferred as above. The fast path
is ``max_grad_norm`` or :meth:`HybridAdamW.clip_grad_norm_` (what :mod:`hytrain.integrations` route the
loops' clipping to): the clip factor is applied inside the update, so the overlap is kept. With
``release_grads=True`` and no clipping, the ``.grad`` of CUDA parameters is released as soon as it has
been handed off (gradient memory returns during backward) and blocks are updated during backward.

The optimizer binds lazily, as torch's do: the state is created at the first ``step()`` for the
device and dtype the parameters have then, so the model may be moved or cast after the optimizer is
built. A move after the first step is refused with a RuntimeError (see ``docs/architecture.md``).
"""

from .optimizer import HybridAdamW

__all__ = ["HybridAdamW"]
