"""``hytrain train``: train a causal LM with HybridAdamW, with checkpoints, metrics and pictures.

With no arguments it trains the ``tiny`` Llama-style model on an embedded corpus (the Python standard
library's own source files, read as bytes: present on every machine, nothing to download), holding
out about 5% of the files for validation. The same command runs on a CPU-only machine (the CPU
update path) and on a GPU (the full offload pipeline). Started by torchrun, or with ``--nproc N``
(which starts torchrun), each process trains on its slice of the global batch with the model sharded
by FSDP2 (:mod:`hytrain.job.ranks`); rank 0 writes the metrics, pictures and summary, every rank its
shards of the checkpoints.
"""

# (The module's docstring is ``hytrain train --help``'s description.) The command line resolves once
# into a run plan (plan.py), and the run is a sequence of phases, each in the module that owns it and
# given the plan's sections it reads (see _run).

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .. import checkpoint as ckpt
from .._native import native
from ..pool import CapacityError
from .checkpoints import Saver, check_room, find_resume, finished, restore, resumed_plan, resumed_weights
from .data import inputs_and_targets, open_job_data, step_loss
from .metrics import Metrics, Power, Startup, evaluate
from .models import build_model
from .optimizer import build_optimizer
from .outputs import export_at_end, finish, run_config
from .lock import RunLock
from .options import ConfigError, Parser, add_arguments, counted, resolve_options
from .plan import RunPlan
from .signals import Signals, Stopped, name
from .ranks import (LAUNCHED, PeerFailure, as_peer_failure, launch, place, report_failure, set_up, tell_launcher,
                    under_torchrun)


class _Say:
    """print() for the main process's messages; a closed stdout (``hytrain train | head``, a dead log
    pipe) is reported once on stderr and training goes on."""

    def __init__(self):
        self.broken = False

    def __call__(self, *a, **k):
        if self.broken:
            return
        try:
            print(*a, **k)
        except (BrokenPipeError, OSError) as e:
            self.broken = True
            try:
                sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- for the rest of the run
                print(f"hytrain train: standard output is closed ({type(e).__name__}); training goes on, "
                      "messages are dropped (see metrics.jsonl)", file=sys.stderr, flush=True)
            except OSError:
                pass


class SafeStderr:
    """Standard error for the progress bar: once it is closed (``2>&1 | head``, a dead log pipe) the bar
    writes nowhere, the loss goes to stdout (if it is still open) once, and training goes on."""

    def __init__(self, say):
        self.say, self.broken = say, False

    def write(self, text):
        if self.broken:
            return len(text)
        try:
            return sys.stderr.write(text)
        except (BrokenPipeError, OSError, ValueError) as e:
            self._close(e)
            return len(text)

    def flush(self):
        if not self.broken:
            try:
                sys.stderr.flush()
            except (BrokenPipeError, OSError, ValueError) as e:
                self._close(e)

    def _close(self, e):
        self.broken = True
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 -- for the rest of the run (warnings, exit)
        self.say(f"hytrain train: standard error is closed ({type(e).__name__}); training goes on, the "
                 "progress bar is dropped (see metrics.jsonl)", flush=True)


_at = {"step": 0}  # the last step the loop finished (a hung peer is reported with the next one)


def run(plan: RunPlan) -> int:
    """The run of ``plan`` in this process: its output directory checked and locked (one run per
    --out), its signals handled (signals.py: what each does at each stage), then :func:`_run`. A run
    that fails leaves no --out it made and left empty (nor the parents it made for it)."""
    ranks = set_up(plan.process)  # the set-up-ranks phase (ranks.py)
    out = Path(plan.output.out)
    made = [d for d in (out, *out.parents) if not d.exists()] if ranks.main else []  # innermost first
    try:
        return _run_in(plan, ranks, out)
    except BaseException:
        for d in made:
            try:
                d.rmdir()  # (only an empty one: a run's files, or another run's lock, keep it)
            except OSError:
                break
        raise


def _run_in(plan: RunPlan, ranks, out: Path) -> int:
    """:func:`run` once its ranks are set up: --out made, checked and locked, the signals handled."""
    say = _Say() if ranks.main else (lambda *a, **k: None)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test.{ranks.rank}"
        try:
            probe.write_text("ok")
        finally:
            probe.unlink(missing_ok=True)  # (a full disk creates it empty)
    except OSError as e:
        raise ConfigError(f"cannot write to the output directory {out}: {e}") from None
    lock = RunLock(out) if ranks.main else None
    if lock is not None:
        lock.acquire()  # before anything is written: one run per --out
    sig = Signals(say, ranks.world)  # (signals.py: what each signal does at each stage of the run)
    try:
        with sig.outside():
            return _run(plan, ranks, say, out, sig)
    except Stopped as e:
        if e.now:
            try:
                last = f"the last checkpoint, {ckpt.resolve(out, 'latest')}, is intact: --resume latest continues from it"
            except Exception:  # noqa: BLE001 -- none saved yet
                last = "no checkpoint was saved before it"
            where = f"during step {e.step}" if e.step else "during the end-of-run outputs"
            say(f"\nhytrain train: stopped at once by a second {name(e.signum)} {where}; {last}; exit status "
                f"{128 + e.signum}", flush=True)
        else:
            say(f"hytrain train: stopped by signal {e.signum} outside the training loop (before the first step, or "
                f"after the last checkpoint was saved); --resume latest continues from the last checkpoint; exit "
                f"status {128 + e.signum}", flush=True)
        return 128 + e.signum
    except Exception as e:  # gloo's and NCCL's own words for a lost peer, raised in FSDP's collectives
        peer = as_peer_failure(e, ranks.rank) if ranks.distributed else None
        if peer is None or peer is e:
            raise
        if peer.hung:  # which step: the one the loop was in
            peer = PeerFailure(f"{peer} in step {_at['step'] + 1}", hung=True)
        raise peer from e
    finally:
        if lock is not None:
            lock.release()


def _run(plan: RunPlan, ranks, say, out: Path, sig) -> int:
    """The run's phases, each in the module that owns it, each given the plan's sections it reads: set
    up ranks (ranks.py) -> the plan a resume goes on under (checkpoints.py) -> open data (data.py) ->
    load model (models.py) -> build optimizer (optimizer.py) -> resume (checkpoints.py) -> train
    (:class:`Training`) -> finish (:func:`_finish`, with outputs.py)."""
    device = place(ranks, plan.process, plan.data.batch_size)
    resume = find_resume(plan.checkpoint, out, ranks, device)
    if resume is not None and finished(resume, plan.schedule.steps, out, say):
        ranks.close()
        return 0
    plan = resumed_plan(plan, resume, out, say)
    dtype = plan.model.dtype(device)  # (a resume's: --precision is fixed under a checkpoint)
    data, val_batches = open_job_data(plan.model, plan.data, resume.cursor if resume is not None else None,
                                      say=lambda line: say(line, flush=True), eval_every=plan.schedule.eval_every)
    startup = Startup()  # (how long each phase took to end, from the process's start: summary.json)
    model = build_model(plan.model, device, dtype, ranks, weights=resumed_weights(resume, ranks),
                        state_format=plan.optimizer.state_format, batch_size=plan.data.batch_size)
    startup.mark("model")
    updates = build_optimizer(plan.optimizer, plan.schedule, model, device, dtype, ranks)
    startup.mark("optimizer")
    check_room(out, plan.checkpoint.keep, model.module, updates.opt, ranks)
    start = (restore(resume, plan.optimizer, plan.schedule, model.module, updates, out, ranks, say)
             if resume is not None else 0)
    if resume is not None:
        startup.mark("resume")
    config = run_config(out, plan, model, ranks)
    # The notes once nothing can refuse the run any more (a refused run says its one error line only).
    for line, warning in plan.notes():  # (a GPU the build cannot use; the fine-tuning --lr)
        say(line, file=sys.stderr if warning else sys.stdout, flush=True)
    where = (f"{counted(ranks.world, 'process', 'processes')} ({device.type}, FSDP2)" if ranks.distributed
             else str(device))
    if model.window is not None and model.window.streamed:
        w = model.window
        ends = f" (the {' and the '.join(w.ends)} among them)" if w.ends else ""
        where += f", {len(w.streamed)} of {len(w.layers)} layers streamed from host memory{ends}"
    say(f"hytrain train: {plan.model.model} ({model.n_params / 1e6:.2f} M parameters, {dtype}) on {where}, "
        f"k={updates.opt.gpu_blocks}, data {data.description}", flush=True)
    saver = Saver(plan.checkpoint, plan.schedule.steps, out, config, ranks, resume, start)
    training = Training(plan.schedule, plan.optimizer, plan.output, model.module, updates, data, val_batches, saver,
                        tokens_per_step=plan.data.batch_size * plan.data.seq_len, device=device, ranks=ranks,
                        out=out, say=say, sig=sig, startup=startup)
    trained = training.run(start, resumed=resume is not None)
    return _finish(plan.model, plan.output, plan.checkpoint.keep, model, updates.opt, trained, device, ranks, out,
                   say, sig)


@dataclass
class Trained:
    """What the train phase did: the last step, the signal that stopped it (0: none), whether it
    reached --steps (and no signal stopped it), each step's record, the tokens of a step, its
    wall-clock seconds, the energy of every GPU of the job, and the startup's phases (seconds from
    the process's start to the end of each, the first step's included)."""
    step: int
    stopped: int
    done: bool
    history: list
    tokens_per_step: int
    elapsed: float
    energy: float
    startup: dict


class Training:
    """The train phase: the steps from the start (0, or a resumed run's step) to ``--steps``, or to
    a stopping signal, each ending with one small all-gather of every rank's figures; the validation,
    metrics, progress and saves (``saver``) they call for. ``schedule``, ``optimizer``, ``output``:
    the plan's SchedulePlan, OptimizerPlan (for the message of a diverged run) and OutputPlan."""

    def __init__(self, schedule, optimizer, output, model, updates, data, val_batches, saver, *, tokens_per_step,
                 device, ranks, out, say, sig, startup):
        self.schedule, self.optimizer, self.output = schedule, optimizer, output
        self.keep, self.tokens_per_step = saver.keep, tokens_per_step
        self.model, self.opt, self.sched, self.scaler = model, updates.opt, updates.sched, updates.scaler
        self.updates, self.data, self.val_batches, self.saver = updates, data, val_batches, saver
        self.device, self.ranks, self.out, self.say, self.sig = device, ranks, out, say, sig
        self.history, self.metrics, self.bar, self.power = [], None, None, None
        self.startup = startup

    def run(self, start: int, resumed: bool) -> Trained:
        ranks = self.ranks
        self.metrics = Metrics(self.out, resumed_at=start if resumed else None) if ranks.main else None
        self.power = Power(self.device)
        self.bar = None if self.output.no_progress or not ranks.main else tqdm(
            total=self.schedule.steps, initial=start, unit="step", dynamic_ncols=True, file=SafeStderr(self.say))
        t_start = time.perf_counter()
        step = start
        stopped = 0  # the signal that stopped the run (on any rank), else 0
        restore_signals = self.sig.loop()
        try:
            while step < self.schedule.steps:
                rec, every = self._step(step)
                if not self.history:
                    self.startup.mark("first_step")
                    stats = self.opt.schedule_stats()
                    self.startup.state, self.startup.memory = stats.get("state_made_s"), stats.get("state_made_memory")
                    rec["startup_s"] = self.startup.phases["first_step"]
                step += 1
                stopping = any(r[4] for r in every)
                asked = any(r[5] for r in every) and not stopping  # SIGUSR1 on some rank: save now, go on
                self._record(step, rec)
                self._save(step, stopping, asked)
                if stopping:
                    stopped = int(max(r[4] for r in every))
                    self._stopped(step, stopped)
                    break
        finally:
            self.data.close()
            restore_signals()
            if self.bar is not None:
                self.bar.close()
            if self.metrics is not None:
                self.metrics.close()
        energy = ranks.total(self.power.total_j(), self.device)  # every GPU of the job
        return Trained(step, stopped, step == self.schedule.steps and not stopped, self.history, self.tokens_per_step,
                       time.perf_counter() - t_start, energy, self.startup.summary())

    def _step(self, step: int) -> tuple[dict, list]:
        """Step ``step`` + 1: (its record, every rank's figures)."""
        opt, scaler, sig, ranks = self.opt, self.scaler, self.sig, self.ranks
        t0 = time.perf_counter()
        _at["step"] = step
        sig.step_begins(step + 1, last=step + 1 == self.schedule.steps)
        waited = self.data.wait_seconds
        tokens, mask = self.data.batch(step)
        waited = self.data.wait_seconds - waited
        loss = step_loss(self.model, *inputs_and_targets(tokens, mask, ranks, self.device))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        try:
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        except RuntimeError as e:  # a non-finite gradient norm: the step was refused, nothing applied
            if "non-finite" not in str(e):
                raise
            raise _diverged(step + 1, "its gradients are not finite", self.optimizer, self.schedule, self.out) from None
        opt.zero_grad()
        self.sched.step()
        sched_stats = opt.schedule_stats()
        # The step's one host synchronisation: the loss (every rank's, with its k, GPU wait share,
        # step time and whether it was signalled to stop: the ranks stop at the same step).
        mine = [float(loss.detach()), float(sched_stats.get("k", 0)),
                float(sched_stats.get("gpu_wait_frac", math.nan)), time.perf_counter() - t0,
                sig.stop_flag(), float(sig.save)]
        sig.save = False
        every = ranks.gather(mine, self.device, f"all-gather of step {step + 1}")
        loss_v = sum(r[0] for r in every) / ranks.world
        dt = time.perf_counter() - t0
        rec = {"step": step + 1, "loss": loss_v, "lr": self.sched.get_last_lr()[0], "step_s": dt,
               "tokens_per_s": self.tokens_per_step / dt, "data_wait_frac": waited / dt, **self.power.sample()}
        if opt.last_grad_norm is not None:
            rec["grad_norm"] = opt.last_grad_norm
        if scaler is not None:
            rec["loss_scale"] = scaler.get_scale()  # halved after a step skipped for an overflow
        rec.update({key: sched_stats[key] for key in ("k", "gpu_wait_frac", "predicted_iter_s", "alloc_retries")
                    if key in sched_stats})
        if ranks.distributed:
            rec["k_ranks"] = [int(r[1]) for r in every]
            rec["gpu_wait_frac_ranks"] = [None if math.isnan(r[2]) else r[2] for r in every]
            rec["step_s_ranks"] = [r[3] for r in every]
        return rec, every

    def _record(self, step: int, rec: dict) -> None:
        """The step's record: validated (every ``--eval-every`` steps and at the last), written to the
        metrics, shown on the progress bar (or, without one, a line at each validation)."""
        loss_v = rec["loss"]
        if not math.isfinite(loss_v):
            raise _diverged(step, f"the loss became {loss_v}", self.optimizer, self.schedule, self.out)
        every, last = self.schedule.eval_every, self.schedule.steps
        if step % every == 0 if every else False:
            rec["val_loss"] = evaluate(self.model, self.val_batches, self.device, self.ranks)
        if step == last and "val_loss" not in rec and self.val_batches:  # (none: --eval-every 0, data too small)
            rec["val_loss"] = evaluate(self.model, self.val_batches, self.device, self.ranks)
        if self.metrics is not None:
            self.metrics.write(rec)
        self.history.append(rec)
        if self.bar is not None:
            self.bar.update(1)
            # (this step's own tokens/s: its forward, backward and update; summary.json's is the whole run's)
            post = dict(loss=f"{loss_v:.3f}", step_tok_s=f"{rec['tokens_per_s']:.0f}", k=rec["k"])
            if "gpu_wait_frac" in rec:
                post["gpu_idle"] = f"{rec['gpu_wait_frac']:.0%}"
            self.bar.set_postfix(**post)
        elif "val_loss" in rec:
            self.say(f"step {step}: loss {loss_v:.4f} val {rec['val_loss']:.4f}, "
                     f"{rec['tokens_per_s']:.0f} tokens/s in this step", flush=True)

    def _save(self, step: int, stopping: bool, asked: bool) -> None:
        """A checkpoint where one is due: every ``--save-every`` steps, at the last, on a signal."""
        if asked:
            what = f"saving at step {step}" if self.keep else "nothing saved (--keep 0)"
            self.say(f"\nhytrain train: SIGUSR1 (a scheduler's warning): {what}; training goes on", flush=True)
        if self.saver.due(step, stopping, asked):
            self.saver.save(step, self.model, self.updates, self.data)

    def _stopped(self, step: int, stopped: int) -> None:
        """Says that signal ``stopped`` (on this rank or another) stops the run after ``step``."""
        out = self.out
        by = f"{stopped} ({name(stopped)}{'' if self.sig.signal else ', sent to another rank'})"
        saved = (f"checkpoint saved (resume with --resume latest --out {out})" if self.keep else
                 f"no checkpoint (--keep 0): the model so far goes to {out / 'model'}" if self.output.export else
                 "no checkpoint (--keep 0)")
        self.say(f"\nstopped by signal {by} after step {step}; {saved}; exit status {128 + stopped}", flush=True)


def _finish(plan, output, keep: int, model, opt, trained: Trained, device, ranks, out: Path, say, sig) -> int:
    """The finish phase: the outputs (outputs.py: OUT/model, the traces, pictures and summary.json,
    which a signal now waits for), the process group left, and the exit status. ``plan``: the
    ModelPlan (its tokenizer goes with the model); ``output``: the OutputPlan. A run stopped without
    checkpoints (--keep 0) leaves its model so far: nothing else would remain."""
    stopped = trained.stopped
    with sig.held():  # a signal now waits for summary.json (a second one stops at once)
        exported = (export_at_end(model.module, out, plan, keep, ranks, say)
                    if output.export and (trained.done or (stopped and not keep)) else None)
        summary = finish(out, opt, trained.history, model.n_params, trained.tokens_per_step, trained.elapsed,
                         trained.energy, device, ranks, exported, model.window, trained.startup)
        if summary is not None and None not in (summary["tokens_per_s"], summary["step_tokens_per_s"]):
            say(f"hytrain train: {summary['tokens_per_s']:.0f} tokens/s over the run ({summary['tokens']} tokens in "
                f"{summary['train_loop_s']:.1f} s, first step to last: the first step's set-up, validation and saves "
                f"included); {summary['step_tokens_per_s']:.0f} tokens/s in a step alone (the median step_tok_s)",
                flush=True)
        say(json.dumps(summary), flush=True)
    if sig.late and not stopped:
        stopped = sig.late
        say(f"hytrain train: stopped by signal {stopped} after summary.json; exit status {128 + stopped}", flush=True)
    ranks.close()
    # A stop by signal is not a finished run: 128 + the signal's number, as a shell reports it, so
    # that a scheduler requeues it (--resume latest continues). Under the --nproc launcher each rank
    # tells it the stop was clean (saved), which it then does not report as a failure.
    if stopped and ranks.distributed:
        tell_launcher(f"hytrain train: stopped by signal {stopped} after step {trained.step}; checkpoint saved",
                      "stopped", ranks.rank)
    return 128 + stopped if stopped else 0


def _diverged(step, what, optimizer, schedule, out) -> ConfigError:
    """A run whose loss or gradients stopped being finite: one line (exit 2), what to lower
    (``optimizer``: the OptimizerPlan, ``schedule``: the SchedulePlan), and the checkpoint a resume
    would start from (nothing non-finite was saved: the check comes before the save)."""
    try:
        last = f"; the last good checkpoint is {ckpt.resolve(out, 'latest')}"
    except Exception:  # noqa: BLE001 -- none saved yet
        last = "; no checkpoint was saved before it"
    return ConfigError(f"training diverged at step {step}: {what}; lower --lr (now {optimizer.lr:g}) or "
                       f"--weight-decay (now {optimizer.weight_decay:g}), or raise --warmup (now "
                       f"{schedule.warmup}){last}")


def main(argv=None) -> int:
    p = Parser(prog="hytrain train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        plan = RunPlan.from_options(vars(resolve_options(p, argv)))  # the command line, resolved once
        if plan.process.nproc is not None and not under_torchrun():
            return launch(plan.process, plan.data.batch_size, argv)
        return run(plan)
    except (ConfigError, ckpt.CheckpointError) as e:
        return _failed(2, f"hytrain train: error: {e}", "user")
    except PeerFailure as e:  # a hung peer has its own status (124, as timeout(1) gives)
        return _failed(124 if e.hung else 1, f"hytrain train: error: {e}", "hung" if e.hung else "peer")
    except native().PoolExhaustedError as e:
        return _failed(2, f"hytrain train: error: {e} (lower the model size or raise --pin-limit)", "user")
    except CapacityError as e:
        return _failed(2, f"hytrain train: error: {e}", "user")
    except Exception as e:
        if not (under_torchrun() and os.environ.get(LAUNCHED)):
            raise  # a plain job shows its traceback as Python does
        return _failed(1, f"hytrain train: error: {type(e).__name__}: {e}", "bug", e)


def _failed(code: int, line: str, kind: str, exc: BaseException | None = None) -> int:
    """Reports a failure; a rank of a process group then leaves at once, without the interpreter's
    teardown: the group's threads may still be blocked in a collective with a peer, and destroying
    them at exit can abort the process (``terminate called without an active exception``), which
    would replace the exit status that says what happened."""
    report_failure(line, kind, exc)
    import torch.distributed as dist

    if under_torchrun() and dist.is_available() and dist.is_initialized():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    return code
