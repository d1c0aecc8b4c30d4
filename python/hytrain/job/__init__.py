"""The main job, ``hytrain train``, in parts named for what they do: ``options`` (flags, config files,
checks), ``plan`` (the options resolved once into a frozen plan, a section for each part), ``data``
(the corpus and each step's batch), ``models`` (a preset or a transformers model), ``optimizer``
(HybridAdamW and its schedule), ``checkpoints`` (resume and saves), ``metrics`` (what a run records),
``outputs`` (what a finished run leaves), ``ranks`` (several processes: torchrun, FSDP2, what the
ranks agree on) and ``loop`` (the run itself, phase by phase)."""

from .loop import main

__all__ = ["main"]
