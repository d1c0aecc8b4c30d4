"""The job's checkpoints: which one a run resumes from (``--resume``, ``auto``, a restarted group),
the plan it resumes under (the checkpoint's plan compared with this command line's: plan.resumed),
the states it restores once the optimizer is built, the room the checkpoints need on disk, and the
saves during the run (``--save-every``, the last step, a signal; ``--keep``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import checkpoint as ckpt
from .. import dist_checkpoint, state_formats
from .optimizer import lr_lambda
from .options import ConfigError
from .plan import RunPlan, reads_other_data, resumed


@dataclass
class Resume:
    """The checkpoint a run resumes from: its directory, whether several processes wrote it
    (dist_checkpoint's format), the step it was saved at; then (:func:`resumed_plan`) its config,
    the plan it was saved under, what this run changes, the data cursor, its states' format and the
    one ``--state-format`` asks for (None: the checkpoint's)."""
    dir: Path
    sharded: bool
    step: int
    config: dict = field(default_factory=dict)
    saved: RunPlan | None = None
    changes: list = field(default_factory=list)
    cursor: dict | None = None
    state_format: str = state_formats.DEFAULT
    asked_format: str | None = None


def find_resume(plan, out: Path, ranks, device) -> Resume | None:
    """The checkpoint to resume from (``plan``: a CheckpointPlan), or None for a fresh start: ``--resume``,
    ``auto`` (the latest where --out has one), and ``latest`` after torchrun restarted the group. A fresh
    start over an earlier run's checkpoints is refused."""
    resume = plan.resume
    if resume == "auto":  # a requeued job: the last checkpoint where there is one, else a fresh start
        resume = "latest" if ckpt.complete_checkpoints(out) else None
    restart = ranks.restarted(device) if ranks.distributed else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart and (out / "checkpoints" / "latest").is_file():
        resume = "latest"  # torchrun restarted the group after a failure: go on from the last checkpoint
    if not resume:  # a fresh start would mix its steps with an earlier run's and lose them at --resume latest
        held = ckpt.complete_checkpoints(out)
        if held:
            raise ConfigError(f"--out {out} holds an earlier run's checkpoints (the newest {held[-1].name}): "
                              f"continue it with --resume latest, or start afresh with another --out "
                              f"(or after removing {out / 'checkpoints'})")
        return None
    path = ckpt.resolve(out, resume)
    return Resume(path, dist_checkpoint.is_sharded_checkpoint(path), ckpt.manifest_step(path))


def finished(resume: Resume, steps: int, out: Path, say) -> bool:
    """Whether the checkpoint's run already reached ``steps`` (its files then stay as they are)."""
    if resume.step < steps:
        return False
    say(f"hytrain train: the run in {out} already reached step {resume.step} (--steps {steps}): "
        f"nothing to do (raise --steps to train further)", flush=True)
    return True


def resumed_plan(plan: RunPlan, resume: Resume | None, out: Path, say) -> RunPlan:
    """The plan the run goes on under. Resumed: the checkpoint verified first (a corrupted one is
    refused before anything is built), then its plan compared with ``plan`` (plan.resumed: the options
    this command line does not give are the checkpoint's; ``resume`` keeps what changes), and its
    data cursor dropped where the data options differ. The optimizer states' format: ``--state-format``,
    else the checkpoint's, else fp32."""
    if resume is None:
        return plan.replaced(state_format=plan.optimizer.state_format or state_formats.DEFAULT)
    if not resume.sharded:  # (under --nproc, resharded when it is loaded: dist_checkpoint.load_single)
        try:
            ckpt.verify(resume.dir)
        except ckpt.CheckpointError as e:
            raise _naming_older(e, out, resume.dir) from None
    meta = ckpt.read_meta(resume.dir)
    resume.config = meta.get("config") or meta.get("extra") or {}
    resume.saved = RunPlan.from_options(resume.config.get("options") or {}, under=plan.options())
    plan, resume.changes = resumed(plan, resume.saved)
    resume.cursor = resume.config.get("data_cursor")
    if resume.cursor is not None and reads_other_data(plan, resume.saved):
        say(f"hytrain train: the data options differ from the checkpoint's: {plan.data.data} is read from its "
            "beginning", flush=True)
        resume.cursor = None
    resume.state_format, resume.asked_format = meta.get("state_format", state_formats.DEFAULT), plan.optimizer.state_format
    return plan.replaced(state_format=resume.asked_format or resume.state_format or state_formats.DEFAULT)


def resumed_weights(resume: Resume | None, ranks) -> Path | None:
    """The checkpoint whose weights the load-model phase reads into the model before it is placed (a
    resumed single-process run: a streamed parameter takes no load_state_dict afterwards), else None
    (a fresh start; a sharded checkpoint or several processes: :func:`restore` reads them)."""
    if resume is None or resume.sharded or ranks.distributed:
        return None
    return Path(resume.dir)


def restore(resume: Resume, optimizer, schedule, model, updates, out: Path, ranks, say) -> int:
    """The resume phase, once the optimizer is built: the checkpoint's optimizer, schedule and loss
    scale restored, then what the command line changes (from the resume point on: the schedule's peak
    and shape, the decay, the rest as read; ``optimizer``: the OptimizerPlan, ``schedule``: the
    SchedulePlan) said in one line. Returns the step it resumes at."""
    opt, sched, scaler = updates.opt, updates.sched, updates.scaler
    if resume.sharded or ranks.distributed:
        try:
            info = (dist_checkpoint.load if resume.sharded else dist_checkpoint.load_single)(resume.dir, model, opt)
        except ckpt.CheckpointError as e:
            raise (_naming_older(e, out, resume.dir) if getattr(e, "damaged", False) else e) from None
        sched.load_state_dict(info["extra"]["scheduler"])
        start = info["step"]
    else:
        start = ckpt.load(resume.dir, model, opt, sched, weights=False)
    if scaler is not None and resume.config.get("grad_scaler"):
        scaler.load_state_dict(resume.config["grad_scaler"])
    say(f"resumed from {resume.dir} at step {start}", flush=True)
    if resume.changes:
        lr = optimizer.lr
        for g in opt.param_groups:
            g["weight_decay"] = optimizer.weight_decay
        sched.base_lrs = [lr for _ in opt.param_groups]
        factor = lr_lambda(schedule)(sched.last_epoch)
        for g in opt.param_groups:
            g["lr"] = lr * factor
        sched._last_lr = [g["lr"] for g in opt.param_groups]
        say("hytrain train: from step " + str(start + 1) + ": " + ", ".join(
            f"{flag} {before} -> {now}" for flag, before, now in resume.changes), flush=True)
    asked = resume.asked_format
    if asked is not None and resume.state_format != asked:  # say what changes
        say(f"hytrain train: the checkpoint's optimizer states are {resume.state_format}; they continue as "
            f"{asked}, as --state-format {asked} asks (leave it out to keep {resume.state_format})", flush=True)
    return start


def check_room(out: Path, keep: int, model, opt, ranks) -> None:
    """Room on disk for ``keep`` + 1 checkpoints at once (the newest is written before the oldest is
    pruned), counting those on disk already, after sweeping what a killed save or prune left."""
    if not (ranks.main and keep):
        return
    each = ckpt.state_bytes(model, opt)
    root = out / "checkpoints"
    ckpt.sweep(root)
    have = ckpt.bytes_under(root)
    ckpt.check_room(root, (keep + 1) * each - have,
                    f"--keep {keep} ({keep + 1} checkpoints of about {each / 1e9:.3f} GB at once, "
                    f"{have / 1e9:.3f} GB of them on disk already)")


class Saver:
    """The saves of a run (``plan``: a CheckpointPlan; ``steps``: the last step): each holds
    ``config`` (config.json's, with the data cursor and the loss scale added), in dist_checkpoint's
    format under several processes or when resumed from it. A resume from one of --out's own
    checkpoints continues that history: the checkpoints after it belong to the run this one
    replaces, and go at this run's first save (ckpt.publish)."""

    def __init__(self, plan, steps: int, out: Path, config: dict, ranks, resume: Resume | None, start: int):
        self.keep, self.every, self.steps, self.out, self.config = plan.keep, plan.save_every, steps, out, config
        self.sharded = ranks.distributed or (resume is not None and resume.sharded)
        self.since = start if resume is not None and _of_out(out, resume.dir) else None

    def due(self, step: int, stopping: bool, asked: bool) -> bool:
        return bool(self.keep) and ((self.every and step % self.every == 0) or step == self.steps or stopping
                                    or asked)

    def save(self, step: int, model, updates, data) -> None:
        self.config["data_cursor"] = data.cursor()  # where a resume reads on
        if updates.scaler is not None:
            self.config["grad_scaler"] = updates.scaler.state_dict()
        if self.sharded:
            dist_checkpoint.save(self.out, step, model, updates.opt,
                                 {"scheduler": updates.sched.state_dict(), **self.config},
                                 keep=self.keep, since=self.since)
        else:
            ckpt.save(self.out, step, model, updates.opt, updates.sched, self.config, keep=self.keep,
                      since=self.since)
        self.since = step if self.since is not None else None


def _of_out(out, path) -> bool:
    """Whether checkpoint ``path`` is one of ``out``'s own (a resume may name one elsewhere)."""
    return path.resolve().parent == (out / "checkpoints").resolve()


def _naming_older(e, out, resume_dir):
    """A damaged checkpoint's error, naming the newest complete checkpoint before it in --out (not
    verified: that is the resume's own first step)."""
    hint = ckpt.after_damage(resume_dir) if _of_out(out, resume_dir) else ""
    if not hint:
        return e
    return ckpt.CheckpointError(f"{e}{hint} (its first save then replaces {resume_dir.name} and any after it)")
