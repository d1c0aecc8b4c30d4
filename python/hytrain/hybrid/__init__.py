"""HybridAdamW: a drop-in ``torch.optim.AdamW`` whose fp32 master weights and Adam states live in
pinned host memory and are updated by hytrain's native CPU workers, overlapping backward and the next
forward; the first ``gpu_blocks`` blocks may instead be updated on the GPU by the fused CUDA AdamW.

How a step runs:

* Parameters are grouped into *blocks*: the modules of the model's largest ``nn.ModuleList`` or
  ``nn.Sequential`` of repeated blocks, with the remaining parameters forming a head block (before
  them) and a tail block (after); or explicit ``blocks``; or, without a model, buckets of about
  ``bucket_elements`` in parameter order. Parameters that do not require gradients get no state (torch
  skips them); one that later has a gradient gets its state then (as with ``add_param_group``).
* A post-accumulate-grad hook counts each block's gradients. When a block's last gradient of the
  step's last micro-batch (``accumulation_steps``) has arrived, CUDA parameters hand the block off
  while backward continues with earlier blocks: its gradients are copied to pinned memory on a D2H
  stream (or, for the first k blocks, into their GPU update buffers). Nothing is applied before
  ``step()``: the multiplier (clipping, loss scaling), the gradients (which the loop may still clip or
  rescale) and the hyperparameters (which it may still change) are known only then.
* ``step()`` checks every gradient, then starts every update -- CPU parameters on the native
  :class:`UpdateEngine`, CUDA parameters through the native ``OffloadPipeline`` (CPU update, new weights
  copied back on an H2D stream) or the fused CUDA AdamW for GPU-resident blocks -- and waits for them
  (without a model), or returns at once with a model: forward hooks wait for each block's update just
  before it is used, so the updates overlap the next forward, and the *fence* (``fence.py``) makes any
  other read or write of a parameter or gradient wait for its block, so that after ``step()`` every
  path sees the updated weights, as torch promises.

A step that raises (a sparse gradient, a parameter moved after the first step, a non-finite norm)
leaves every parameter and state as it was and nothing in flight; dropping the optimizer waits for
updates in flight.

Clipping or loss scaling on CUDA may still update offloaded blocks during backward, *speculatively*
(``speculate``): the CPU writes the new state beside the current one, as if the multiplier were the
last step's unclipped one (1, or the inverse loss scale under a GradScaler), and the weights from it.
If step() finds that multiplier and the hyperparameters unchanged, it adopts the new state, which is
bit for bit what the update in step() would have written; if not (the step clipped, the scale changed),
the speculative result is dropped and the block is updated again from its untouched state; a step
skipped for an overflow takes the speculative results back. After a step that clipped or was skipped,
the next one does not speculate (clipping comes in runs, early in training).

Under loss scaling (a GradScaler driving ``step()``) the hand-offs go on. The scaler looks for
overflow in every ``.grad``: a released block's overflow is written into a stand-in gradient at the
end of backward (a zero gradient, with one non-finite element if a released block overflowed, on the
smallest released parameter), which the scaler's check sees as torch's would see the overflow itself;
kept gradients, which that check rewrites in place (times 1), are compared by content, not version,
at ``step()``. Once the loop calls ``GradScaler.unscale_()`` (which unscales ``.grad`` in place, so
released gradients would miss it and kept ones would be updated again), the blocks wait for ``step()``.

The loop's own clipping (``torch.nn.utils.clip_grad_norm_`` between backward and step, as transformers'
Trainer, accelerate and Lightning do it) is exact: unless the optimizer clips itself (``max_grad_norm``)
or is told that nothing reads the gradients after backward (``release_grads=True``), ``.grad`` is kept
until ``step()``, and blocks whose gradients were changed after their hand-off are updated again from
the changed ones. The fast path is ``max_grad_norm`` or :meth:`HybridAdamW.clip_grad_norm_` (what
:mod:`hytrain.integrations` route the loops' clipping to): the clip factor is applied inside the
update, so the hand-offs are kept. With ``release_grads=True`` the ``.grad`` of CUDA parameters is
released as soon as it has been handed off (gradient memory returns during backward); torch's own
``clip_grad_norm_`` then sees no gradients, so clip with ``max_grad_norm`` or ``clip_grad_norm_`` of
the optimizer.

The optimizer binds lazily, as torch's do: the state is created at the first ``step()`` for the
device and dtype the parameters have then, so the model may be moved or cast after the optimizer is
built. A move after the first step is refused with a RuntimeError (see ``docs/architecture.md``).
"""

from .optimizer import HybridAdamW

__all__ = ["HybridAdamW"]
