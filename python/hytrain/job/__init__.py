"""The main job, ``hytrain train``, in parts named for what they do: ``options`` (flags, config files,
checks), ``data`` (the corpus and each step's batch), ``models`` (a preset or a transformers model),
``metrics`` (what a run records), ``ranks`` (several processes: torchrun, FSDP2, what the ranks
agree on) and ``loop`` (the run itself)."""

from .loop import main

__all__ = ["main"]
