"""Glue for the training loops people already run: transformers' Trainer, accelerate, Lightning.

HybridAdamW works in all of them as it is: it creates its state at the first step, for the device and
dtype the parameters have then (so the loop may move the model after the optimizer was built), and it
keeps the gradients until ``step()``, so a loop's own ``clip_grad_norm_`` is exact (blocks whose
gradients were rescaled after they were handed off are updated again from the rescaled ones).

What these helpers add is the fast path: the loop's clipping goes to
:meth:`HybridAdamW.clip_grad_norm_`, which returns the true norm (for the logs) and applies the clip
factor inside the update instead of rescaling ``.grad`` (nor unscaling it, under fp16 loss scaling),
so the updates that started during backward are kept. Each uses the library's own extension point:

* accelerate: :func:`route_clipping` (``accelerator.clip_grad_norm_`` of one Accelerator);
* transformers: :class:`HybridTrainer` (a ``Trainer`` whose ``create_optimizer`` builds HybridAdamW
  from the ``TrainingArguments`` and whose accelerator routes the clipping);
* Lightning: :class:`HybridClipping` (a LightningModule mixin implementing
  ``configure_gradient_clipping``). With ``precision="16-mixed"`` or ``"bf16-mixed"`` it is needed for
  ``gradient_clip_val``: Lightning refuses its own clipping for optimizers that take the loss scale
  themselves, as HybridAdamW does for GradScaler (a clear error at the first step).
"""

from __future__ import annotations

from .hybrid import HybridAdamW


def _unwrap(optimizer):
    """The HybridAdamW inside accelerate's or Lightning's optimizer wrappers (or None)."""
    while not isinstance(optimizer, HybridAdamW) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, HybridAdamW) else None


def route_clipping(accelerator, optimizer):
    """Routes ``accelerator.clip_grad_norm_(parameters, max_norm)`` to
    ``HybridAdamW.clip_grad_norm_`` when every parameter with a gradient is one of the optimizer's;
    other calls go to accelerate's own. Under fp16 loss scaling the gradients are not unscaled in
    place first (accelerate's own clipping calls ``scaler.unscale_``): HybridAdamW takes the scale out
    inside its step, where the clip sees the unscaled norm, so the hand-offs during backward stand;
    the norm returned is the unscaled one, as accelerate's. ``optimizer``: the HybridAdamW (or a
    wrapper of it), or a callable returning it when called (for loops that create the optimizer
    after the accelerator). Returns the accelerator."""
    original = accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        params = [parameters] if hasattr(parameters, "grad") else list(parameters)
        opt = _unwrap(optimizer() if callable(optimizer) else optimizer)  # optimizers are not callable
        if opt is not None and float(norm_type) == 2.0:
            mine = {id(p) for g in opt.param_groups for p in g["params"]}
            if all(id(p) in mine or p.grad is None for p in params):
                scaler = getattr(accelerator, "scaler", None)
                scaled = scaler is not None and scaler.is_enabled()  # the gradients are still scaled
                return opt.clip_grad_norm_(max_norm, loss_scale=scaler.get_scale() if scaled else None)
        return original(params, max_norm, norm_type=norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_
    return accelerator


def _trainer_class():
    from transformers import Trainer, TrainerCallback

    class _Synchronize(TrainerCallback):
        """At the end of training, waits for the last step's updates (they overlap what comes next)."""

        def __init__(self, optimizer):
            self.optimizer = optimizer

        def on_train_end(self, *_, **__):
            opt = _unwrap(self.optimizer())
            if opt is not None:
                opt.synchronize()

    class HybridTrainer(Trainer):
        """transformers' ``Trainer`` with HybridAdamW as its optimizer.

        Without ``optimizers=``, ``create_optimizer`` builds HybridAdamW from the arguments as the
        Trainer builds AdamW (``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay``
        except on biases and norms), with ``model=`` the model (block detection, just-in-time waits),
        ``accumulation_steps`` its ``gradient_accumulation_steps``, and ``hybrid_kwargs`` passed on
        (``gpu_blocks``, ``workers``, ...). With ``optimizers=(HybridAdamW(...),
        scheduler)`` that optimizer is used. Either way ``max_grad_norm`` clipping and the logged
        ``grad_norm`` go through :meth:`HybridAdamW.clip_grad_norm_`. Checkpoints and
        ``resume_from_checkpoint`` work as with any optimizer (``optimizer.pt`` is its state_dict).

        Use: ``HybridTrainer(model=model, args=training_args, train_dataset=ds, hybrid_kwargs={...})``,
        then ``train()`` as with any Trainer. The class is made when first asked for (``from
        hytrain.integrations import HybridTrainer``), which imports transformers; importing this module
        does not."""

        def __init__(self, *args, hybrid_kwargs=None, **kwargs):
            self.hybrid_kwargs = dict(hybrid_kwargs or {})
            super().__init__(*args, **kwargs)
            self.add_callback(_Synchronize(lambda: self.optimizer))

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            route_clipping(self.accelerator, lambda: self.optimizer)

        def create_optimizer(self, model=None):
            if self.optimizer is None:
                model = self.model if model is None else model
                decay = set(self.get_decay_parameter_names(model))
                named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
                groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                          {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
                self.optimizer = HybridAdamW(
                    [g for g in groups if g["params"]], lr=self.args.learning_rate,
                    betas=(self.args.adam_beta1, self.args.adam_beta2), eps=self.args.adam_epsilon,
                    model=model, **{"accumulation_steps": self.args.gradient_accumulation_steps,
                                    **self.hybrid_kwargs})
            return self.optimizer

    HybridTrainer.__qualname__ = "HybridTrainer"  # its name in the module (the API reference's, pickle's)
    return HybridTrainer


class HybridClipping:
    """LightningModule mixin: ``Trainer(gradient_clip_val=...)`` with the norm algorithm goes to
    :meth:`HybridAdamW.clip_grad_norm_` (the pre-clip norm is logged as ``grad_norm``); other
    optimizers and algorithms keep Lightning's own clipping. Put it first:
    ``class MyModule(HybridClipping, L.LightningModule)``."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        opt = _unwrap(optimizer)
        if opt is not None and gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            # Under fp16 loss scaling the gradients are still scaled here (HybridAdamW unscales inside
            # its step): the clip and the norm logged are of the unscaled gradients.
            scaler = getattr(getattr(self.trainer, "precision_plugin", None), "scaler", None)
            scaled = scaler is not None and scaler.is_enabled()
            norm = opt.clip_grad_norm_(float(gradient_clip_val), loss_scale=scaler.get_scale() if scaled else None)
            # (to the Trainer's loggers where it has any: logger=True without one is a warning each step)
            self.log("grad_norm", norm, on_step=True, prog_bar=False, logger=bool(self.trainer.loggers))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val=gradient_clip_val,
                                            gradient_clip_algorithm=gradient_clip_algorithm)

    def on_train_end(self):
        # The last step's updates overlap what would come next; fit's teardown then moves the module.
        for opt in self.trainer.optimizers:
            opt = _unwrap(opt)
            if opt is not None:
                opt.synchronize()
        super().on_train_end()


def __getattr__(name):
    # transformers is imported only when HybridTrainer is asked for.
    if name == "HybridTrainer":
        cls = _trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module 'hytrain.integrations' has no attribute {name!r}")


__all__ = ["HybridClipping", "HybridTrainer", "route_clipping"]
