"""The run plan: the job's options resolved once (options.py: the flags over a config file, the
defaults that follow from other options, the checks) into frozen sections, one for each part of the
job. A part receives the section(s) it reads, never the whole command line:

    ModelPlan       the model, its tokenizer and weights dtype (models.py)
    DataPlan        the corpus and its batches (data.py)
    OptimizerPlan   HybridAdamW's settings (optimizer.py)
    SchedulePlan    the steps, the lr schedule's warm-up, the validation cadence (optimizer.py, loop.py)
    CheckpointPlan  where a run resumes from, how often it saves, how many it keeps (checkpoints.py)
    ProcessPlan     the device, the processes and torchrun (ranks.py)
    OutputPlan      the output directory, the export, the progress bar (loop.py, outputs.py)

A section's fields are named as the options are (``--seq-len`` is ``seq_len``); the few that two
parts read (``seq_len`` and ``seed``: the model's positions and weights, the data's rows) are in
both sections, from the one option. The plan keeps the options it was built from as well: they are
what each checkpoint's config records (``config.json``'s ``options``), and a plan is built back from
them on resume, where :func:`resumed` compares the checkpoint's plan with this run's."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .options import DTYPES, ConfigError, notes


@dataclass(frozen=True)
class ModelPlan:
    model: str                      # a preset, or a transformers model's directory or name
    init: str                       # pretrained (its checkpoint's weights) or random
    tokenizer: str | None           # a directory, 'bytes', or None: the model's own
    precision: str | None           # the weights dtype (None: bf16 on a GPU, fp32 on the CPU)
    stream: Any                     # 'auto', 'off' or the last N layers streamed from host memory
    activation_checkpointing: bool
    seq_len: int
    seed: int                       # of a preset's (or --init random) weights

    def precision_on(self, device: torch.device) -> str:
        """``--precision``, else the default: bf16 on a GPU, fp32 on the CPU."""
        return self.precision or ("bf16" if device.type == "cuda" else "fp32")

    def dtype(self, device: torch.device) -> torch.dtype:
        return DTYPES[self.precision_on(device)]


@dataclass(frozen=True)
class DataPlan:
    data: str
    data_kind: str
    text_field: str
    eos_token: str | None
    val_data: str | None
    max_data_bytes: int
    batch_size: int                 # the global batch, split between the ranks
    seq_len: int
    seed: int                       # of the batches
    eval_batches: int               # validation batches


@dataclass(frozen=True)
class OptimizerPlan:
    lr: float                       # the peak of the schedule
    weight_decay: float
    max_grad_norm: float
    gpu_blocks: Any                 # 'auto' or k
    speculate: Any                  # 'auto', 'off' or N
    gpu_memory_limit: str | None
    pin_limit: str | None
    state_format: str | None        # None until the resume phase (the checkpoint's, else fp32)
    workers: int


@dataclass(frozen=True)
class SchedulePlan:
    steps: int
    warmup: int
    eval_every: int


@dataclass(frozen=True)
class CheckpointPlan:
    resume: str | None
    save_every: int
    keep: int


@dataclass(frozen=True)
class ProcessPlan:
    device: str
    nproc: str | None
    nnodes: str
    rdzv_endpoint: str | None
    rdzv_id: str
    max_restarts: int
    timeout: float
    verbose: bool


@dataclass(frozen=True)
class OutputPlan:
    out: str
    export: bool
    no_progress: bool


SECTIONS = {"model": ModelPlan, "data": DataPlan, "optimizer": OptimizerPlan, "schedule": SchedulePlan,
            "checkpoint": CheckpointPlan, "process": ProcessPlan, "output": OutputPlan}


@dataclass(frozen=True)
class RunPlan:
    model: ModelPlan
    data: DataPlan
    optimizer: OptimizerPlan
    schedule: SchedulePlan
    checkpoint: CheckpointPlan
    process: ProcessPlan
    output: OutputPlan
    given: frozenset            # the options the command line or its config file set
    record: tuple               # (name, value) of the options it was built from, in their order

    @classmethod
    def from_options(cls, options: Mapping, under: Mapping | None = None) -> "RunPlan":
        """The plan of options by name: ``resolve_options``' (``vars`` of its Namespace), or those a
        checkpoint saved. ``under``: the values of the options ``options`` lacks (an older checkpoint
        records fewer); :meth:`options` are ``options`` alone."""
        every = {**(under or {}), **options}
        sections = {name: kind(**{f.name: every[f.name] for f in dataclasses.fields(kind)})
                    for name, kind in SECTIONS.items()}
        return cls(**sections, given=frozenset(every.get("given") or ()), record=tuple(options.items()))

    def options(self) -> dict:
        """The options by name, as the checkpoints' config records them."""
        return dict(self.record)

    def replaced(self, **options) -> "RunPlan":
        """The same plan with these options' values."""
        return RunPlan.from_options({**self.options(), **options})

    def notes(self) -> list[tuple[str, bool]]:
        """What the job says before it trains (options.notes)."""
        return notes(self.model, self.optimizer.lr, self.process.device, self.given)


# A resume: what may change under a checkpoint (from the resume point on), and what may not; the
# options in none of these are this run's.
CHANGEABLE = ("lr", "warmup", "weight_decay", "max_grad_norm", "steps", "eval_every", "save_every", "keep",
              "workers")
FIXED = ("model", "seq_len", "precision", "batch_size", "tokenizer")
KEPT = ("data", "data_kind", "text_field", "eos_token", "val_data", "max_data_bytes", "seed", "gpu_blocks",
        "speculate", "gpu_memory_limit", "pin_limit", "init", "export")

# What decides the rows a data cursor points into: another value reads the data from its beginning.
DATA_OPTIONS = ("data", "data_kind", "text_field", "eos_token", "val_data", "seq_len", "tokenizer", "seed")


def resumed(plan: RunPlan, saved: RunPlan) -> tuple[RunPlan, list]:
    """The plan of a run resumed under a checkpoint saved with ``saved``: the options the command
    line (or its config) does not give are the checkpoint's; a given one of ``FIXED`` that differs is
    refused (one line). Returns the plan and the (flag, before, now) of the ``CHANGEABLE`` options
    that change."""
    now, before = plan.options(), saved.options()
    merged, changes = dict(now), []
    for key in (*CHANGEABLE, *FIXED, *KEPT):
        if key not in before:
            continue
        if key not in plan.given:
            merged[key] = before[key]
        elif now.get(key) != before[key]:
            flag = "--" + key.replace("_", "-")
            if key in FIXED:
                raise ConfigError(f"{flag} {now.get(key)} differs from the checkpoint's {before[key]}: it cannot "
                                  f"change under a checkpoint (leave {flag} out to resume, or start a new run with "
                                  f"another --out)")
            if key in CHANGEABLE:
                changes.append((flag, before[key], now.get(key)))
    return RunPlan.from_options(merged), changes


def reads_other_data(plan: RunPlan, saved: RunPlan) -> bool:
    """Whether ``plan`` reads other rows than the checkpoint's plan did (an option of ``DATA_OPTIONS``
    differs, or the checkpoint does not record it): its data cursor does not apply."""
    now, before = plan.options(), saved.options()
    return any(before.get(key) != now.get(key) for key in DATA_OPTIONS)
