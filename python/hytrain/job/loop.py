"""``hytrain train``: train a causal LM with HybridAdamW, with checkpoints, metrics and pictures.

With no arguments it trains the ``tiny`` Llama-style model on an embedded corpus (the Python standard
library's own source files, read as bytes: present on every machine, nothing to download), holding
out about 5% of the files for validation. The same command runs on a CPU-only machine (the CPU
update path) and on a GPU (the full offload pipeline). Started by torchrun, or with ``--nproc N``
(which starts torchrun), each process trains on its slice of the global batch with the model sharded
by FSDP2 (:mod:`hytrain.job.ranks`); rank 0 writes the metrics, pictures and summary, every rank its
shards of the checkpoints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .. import checkpoint as ckpt
from .. import dist_checkpoint
from .. import cuda_available
from .._native import native
from ..blocks import detect_blocks
from ..hybrid import HybridAdamW
from ..pool import CapacityError, PinnedPool, parse_bytes
from .data import inputs_and_targets, open_data, step_loss
from .metrics import Metrics, Power, evaluate
from .models import build_model, check_fit, job_tokenizer, stream_plan
from .outputs import export_at_end, finish
from .lock import RunLock
from .options import DATA_OPTIONS, DTYPES, ConfigError, add_arguments, job_notes, resolve_options, resumed_options
from .signals import Signals, Stopped, name
from .ranks import LAUNCHED, PeerFailure, Ranks, as_peer_failure, launch, report_failure, tell_launcher, under_torchrun


def pick_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() and cuda_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not (torch.cuda.is_available() and cuda_available()):
            raise ConfigError("--device cuda: no usable GPU (or hytrain was built without CUDA)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ConfigError(f"--device must be auto, cpu or cuda[:N], got {spec!r}")
    return dev


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


def lr_lambda(args):
    def f(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return f


def run(args) -> int:
    ranks = Ranks.join(args.device, args.timeout) if under_torchrun() else Ranks()
    say = _Say() if ranks.main else (lambda *a, **k: None)
    out = Path(args.out)
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
    sig = Signals(say)  # (signals.py: what each signal does at each stage of the run)
    try:
        with sig.outside():
            return _run(args, ranks, say, out, sig)
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


def _diverged(step, what, args, out) -> ConfigError:
    """A run whose loss or gradients stopped being finite: one line (exit 2), what to lower, and the
    checkpoint a resume would start from (nothing non-finite was saved: the check comes before the save)."""
    try:
        last = f"; the last good checkpoint is {ckpt.resolve(out, 'latest')}"
    except Exception:  # noqa: BLE001 -- none saved yet
        last = "; no checkpoint was saved before it"
    return ConfigError(f"training diverged at step {step}: {what}; lower --lr (now {args.lr:g}) or "
                       f"--weight-decay (now {args.weight_decay:g}), or raise --warmup (now {args.warmup}){last}")


def _run(args, ranks, say, out, sig) -> int:
    device = ranks.device(args.device) or pick_device(args.device)
    if args.batch_size % ranks.world:
        raise ConfigError(f"--batch-size {args.batch_size} (the global batch) must be a multiple of the "
                          f"number of processes ({ranks.world})")
    dtype = DTYPES[args.precision or ("bf16" if device.type == "cuda" else "fp32")]
    resume = args.resume
    if resume == "auto":  # a requeued job: the last checkpoint where there is one, else a fresh start
        resume = "latest" if ckpt.complete_checkpoints(out) else None
    restart = ranks.restarted(device) if ranks.distributed else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart and (out / "checkpoints" / "latest").is_file():
        resume = "latest"  # torchrun restarted the group after a failure: go on from the last checkpoint
    resume_dir, sharded_ckpt = None, False
    if not resume:  # a fresh start would mix its steps with an earlier run's and lose them at --resume latest
        held = ckpt.complete_checkpoints(out)
        if held:
            raise ConfigError(f"--out {out} holds an earlier run's checkpoints (the newest {held[-1].name}): "
                              f"continue it with --resume latest, or start afresh with another --out "
                              f"(or after removing {out / 'checkpoints'})")
    if resume:
        resume_dir = ckpt.resolve(out, resume)
        sharded_ckpt = dist_checkpoint.is_sharded_checkpoint(resume_dir)
        done = ckpt.manifest_step(resume_dir)
        if done >= args.steps:  # a finished run: its files stay as they are
            say(f"hytrain train: the run in {out} already reached step {done} (--steps {args.steps}): "
                f"nothing to do (raise --steps to train further)", flush=True)
            ranks.close()
            return 0
        if not sharded_ckpt:  # (under --nproc, resharded when it is loaded: dist_checkpoint.load_single)
            try:
                ckpt.verify(resume_dir)  # a corrupted checkpoint is refused before anything is built
            except ckpt.CheckpointError as e:
                raise _naming_older(e, out, resume_dir) from None
    changes, cursor = [], None
    if resume_dir is not None:  # the checkpoint's options, where this command line does not change them
        meta = ckpt.read_meta(resume_dir)
        saved_config = meta.get("config") or meta.get("extra") or {}
        saved = saved_config.get("options") or {}
        changes = resumed_options(args, saved)
        cursor = saved_config.get("data_cursor")
        if cursor is not None and any(saved.get(key) != getattr(args, key) for key in DATA_OPTIONS):
            say(f"hytrain train: the data options differ from the checkpoint's: {args.data} is read from its "
                "beginning", flush=True)
            cursor = None
    for line, warning in job_notes(args):  # (a GPU the build cannot use; the fine-tuning --lr)
        say(line, file=sys.stderr if warning else sys.stdout, flush=True)
    saved_format = ckpt.read_meta(resume_dir).get("state_format", "fp32") if resume_dir is not None else None
    asked_format = args.state_format
    args.state_format = asked_format or saved_format or "fp32"  # a resumed run keeps its format unless told
    tokenizer = job_tokenizer(args)
    check_fit(args, tokenizer)
    data = open_data(args, tokenizer, cursor, say=lambda line: say(line, flush=True))
    val_batches = data.validation(args.eval_batches)
    stream = stream_plan(args, device, dtype, ranks.distributed)
    resumed = resume_dir is not None and not (sharded_ckpt or ranks.distributed)  # (weights in before streaming)
    model, n_params, model_cfg, sharded, window = build_model(
        args, device, dtype, shard=lambda m: ranks.shard(m, device), stream=stream,
        weights=(lambda m: ckpt.load_weights(resume_dir, m)) if resumed else None)
    state_bytes = n_params * (16 if device.type == "cuda" else 12) // ranks.world + (256 << 20)
    pool = None
    if args.pin_limit is not None:
        limit = parse_bytes("pin_limit", args.pin_limit)
        if state_bytes > limit:
            raise ConfigError(f"the optimizer state of {n_params / 1e6:.1f} M parameters needs about "
                              f"{state_bytes / 2**30:.2f} GiB of pinned memory per process, over --pin-limit "
                              f"{args.pin_limit}")
        pool = PinnedPool(limit)
    k = args.gpu_blocks if device.type == "cuda" else 0
    if k != "auto":
        k = min(k, len(detect_blocks(model, list(model.parameters()))))
    if not sharded:
        ranks.shard(model, device)
    limit = parse_bytes("gpu_memory_limit", args.gpu_memory_limit) if args.gpu_memory_limit else None
    opt = HybridAdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                      max_grad_norm=args.max_grad_norm or None, model=model, pool=pool,
                      gpu_blocks=k, gpu_memory_limit=limit if device.type == "cuda" else None,
                      workers=args.workers or None, trace=True,
                      speculate=False if args.speculate == "off" else args.speculate,
                      # This loop never reads the gradients after backward, and touches the weights
                      # only through the model's forward and the checkpoints, which wait for the
                      # updates: the fence for every other path (1-4 % on L3B) is not needed.
                      release_grads=True, fence=False, state_format=args.state_format)
    if ranks.main and args.keep:  # the newest checkpoint is written before the oldest is pruned: keep + 1 at once
        each = ckpt.state_bytes(model, opt)
        root = out / "checkpoints"
        ckpt.sweep(root)  # what a killed save or prune left
        have = ckpt.bytes_under(root)
        ckpt.check_room(root, (args.keep + 1) * each - have,
                        f"--keep {args.keep} ({args.keep + 1} checkpoints of about {each / 1e9:.3f} GB at once, "
                        f"{have / 1e9:.3f} GB of them on disk already)")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    # fp16 weights: dynamic loss scaling (torch's GradScaler, which hands HybridAdamW the scale and the
    # overflow flag: a step whose gradients overflowed is skipped, and the scale backs off).
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    start = 0
    if resume_dir is not None:
        if sharded_ckpt or ranks.distributed:
            try:
                info = (dist_checkpoint.load if sharded_ckpt else dist_checkpoint.load_single)(resume_dir, model, opt)
            except ckpt.CheckpointError as e:
                raise (_naming_older(e, out, resume_dir) if getattr(e, "damaged", False) else e) from None
            sched.load_state_dict(info["extra"]["scheduler"])
            start = info["step"]
        else:
            start = ckpt.load(resume_dir, model, opt, sched, weights=False)
        if scaler is not None and saved_config.get("grad_scaler"):
            scaler.load_state_dict(saved_config["grad_scaler"])
        say(f"resumed from {resume_dir} at step {start}", flush=True)
        if changes:  # from the resume point on: the schedule's peak and shape, the decay, the rest as read
            for g in opt.param_groups:
                g["weight_decay"] = args.weight_decay
            sched.base_lrs = [args.lr for _ in opt.param_groups]
            factor = lr_lambda(args)(sched.last_epoch)
            for g in opt.param_groups:
                g["lr"] = args.lr * factor
            sched._last_lr = [g["lr"] for g in opt.param_groups]
            say("hytrain train: from step " + str(start + 1) + ": " + ", ".join(
                f"{flag} {before} -> {now}" for flag, before, now in changes), flush=True)
        if asked_format is not None and saved_format != asked_format:  # say what changes
            say(f"hytrain train: the checkpoint's optimizer states are {saved_format}; they continue as "
                f"{asked_format}, as --state-format {asked_format} asks (leave it out to keep {saved_format})",
                flush=True)
    # A resume from one of --out's own checkpoints continues that history: the checkpoints after it
    # belong to the run this one replaces, and go at this run's first save (ckpt.publish).
    since = start if resume_dir is not None and _of_out(out, resume_dir) else None
    config = {"options": vars(args), "model": model_cfg, "world_size": ranks.world}
    if ranks.main:
        (out / "config.json").write_text(json.dumps(config, indent=1, default=str))
    where = f"{ranks.world} processes ({device.type}, FSDP2)" if ranks.distributed else str(device)
    if window is not None and window.streamed:
        where += f", {len(window.streamed)} of {len(window.layers)} layers streamed from host memory"
    say(f"hytrain train: {args.model} ({n_params / 1e6:.2f} M parameters, {dtype}) on {where}, "
        f"k={opt.gpu_blocks}, data {data.description}", flush=True)

    metrics = Metrics(out, resumed_at=start if resume_dir is not None else None) if ranks.main else None
    power = Power(device)
    bar = None if args.no_progress or not ranks.main else tqdm(total=args.steps, initial=start, unit="step",
                                                               dynamic_ncols=True, file=SafeStderr(say))
    tokens_per_step = args.batch_size * args.seq_len
    history, t_start = [], time.perf_counter()
    step = start
    stopped = 0  # the signal that stopped the run (on any rank), else 0
    restore_signals = sig.loop()
    try:
        while step < args.steps:
            t0 = time.perf_counter()
            _at["step"] = step
            sig.step_begins(step + 1)
            waited = data.wait_seconds
            tokens, mask = data.batch(step)
            waited = data.wait_seconds - waited
            loss = step_loss(model, *inputs_and_targets(tokens, mask, ranks, device))
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
                raise _diverged(step + 1, "its gradients are not finite", args, out) from None
            opt.zero_grad()
            sched.step()
            sched_stats = opt.schedule_stats()
            # The step's one host synchronisation: the loss (every rank's, with its k, GPU wait share,
            # step time and whether it was signalled to stop: the ranks stop at the same step).
            mine = [float(loss.detach()), float(sched_stats.get("k", 0)),
                    float(sched_stats.get("gpu_wait_frac", math.nan)), time.perf_counter() - t0,
                    float(sig.signal or 0), float(sig.save)]
            sig.save = False
            every = ranks.gather(mine, device, f"all-gather of step {step + 1}")
            loss_v = sum(r[0] for r in every) / ranks.world
            stopping = any(r[4] for r in every)
            asked = any(r[5] for r in every) and not stopping  # SIGUSR1 on some rank: save now, go on
            step += 1
            dt = time.perf_counter() - t0
            rec = {"step": step, "loss": loss_v, "lr": sched.get_last_lr()[0], "step_s": dt,
                   "tokens_per_s": tokens_per_step / dt, "data_wait_frac": waited / dt, **power.sample()}
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
            if not math.isfinite(loss_v):
                raise _diverged(step, f"the loss became {loss_v}", args, out)
            if step % args.eval_every == 0 if args.eval_every else False:
                rec["val_loss"] = evaluate(model, val_batches, device, ranks)
            if step == args.steps and "val_loss" not in rec:
                rec["val_loss"] = evaluate(model, val_batches, device, ranks)
            if metrics is not None:
                metrics.write(rec)
            history.append(rec)
            if bar is not None:
                bar.update(1)
                post = dict(loss=f"{loss_v:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}", k=rec["k"])
                if "gpu_wait_frac" in rec:
                    post["gpu_idle"] = f"{rec['gpu_wait_frac']:.0%}"
                bar.set_postfix(**post)
            elif "val_loss" in rec:
                say(f"step {step}: loss {loss_v:.4f} val {rec['val_loss']:.4f} "
                    f"{rec['tokens_per_s']:.0f} tokens/s", flush=True)
            if asked:
                what = f"saving at step {step}" if args.keep else "nothing saved (--keep 0)"
                say(f"\nhytrain train: SIGUSR1 (a scheduler's warning): {what}; training goes on",
                    flush=True)
            if args.keep and ((args.save_every and step % args.save_every == 0) or step == args.steps or stopping
                              or asked):
                config["data_cursor"] = data.cursor()  # where a resume reads on
                if scaler is not None:
                    config["grad_scaler"] = scaler.state_dict()
                if ranks.distributed or sharded_ckpt:
                    dist_checkpoint.save(out, step, model, opt, {"scheduler": sched.state_dict(), **config},
                                         keep=args.keep, since=since)
                else:
                    ckpt.save(out, step, model, opt, sched, config, keep=args.keep, since=since)
                since = step if since is not None else None
            if stopping:
                stopped = int(max(r[4] for r in every))
                by = f"{stopped} ({name(stopped)}{'' if sig.signal else ', sent to another rank'})"
                saved = (f"checkpoint saved (resume with --resume latest --out {out})" if args.keep else
                         f"no checkpoint (--keep 0): the model so far goes to {out / 'model'}" if args.export else
                         "no checkpoint (--keep 0)")
                say(f"\nstopped by signal {by} after step {step}; {saved}; exit status {128 + stopped}", flush=True)
                break
    finally:
        data.close()
        restore_signals()
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
    energy = ranks.total(power.total_j(), device)  # every GPU of the job
    elapsed = time.perf_counter() - t_start
    # A run stopped without checkpoints (--keep 0) leaves its model so far: nothing else would remain.
    done = step == args.steps and not stopped
    with sig.held():  # a signal now waits for summary.json (a second one stops at once)
        exported = export_at_end(model, out, args, ranks) if args.export and (done or (stopped and not args.keep)) else None
        summary = finish(out, opt, history, n_params, tokens_per_step, elapsed, energy, device, ranks, exported, window)
        say(json.dumps(summary), flush=True)
    if sig.late and not stopped:
        stopped = sig.late
        say(f"hytrain train: stopped by signal {stopped} after summary.json; exit status {128 + stopped}", flush=True)
    ranks.close()
    # A stop by signal is not a finished run: 128 + the signal's number, as a shell reports it, so
    # that a scheduler requeues it (--resume latest continues). Under the --nproc launcher each rank
    # tells it the stop was clean (saved), which it then does not report as a failure.
    if stopped and ranks.distributed:
        tell_launcher(f"hytrain train: stopped by signal {stopped} after step {step}; checkpoint saved",
                      "stopped", ranks.rank)
    return 128 + stopped if stopped else 0


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hytrain train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = resolve_options(p, argv)
        if args.nproc is not None and not under_torchrun():
            return launch(args, argv)
        return run(args)
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
