"""What a finished run leaves besides its checkpoints: the model as a Hugging Face directory
(``OUT/model``), the traces and pictures, and ``summary.json``."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import statistics
from pathlib import Path

import torch

from .. import checkpoint as ckpt
from .. import plots
from .hf import ExportError, export_model, export_needs
from .metrics import recorded
from .models import model_path
from .options import ConfigError, first_line


class ExportFailed:
    """What :func:`export_at_end` returns when the export could not be written: the one line that says
    so (:func:`finish` records it in summary.json, then raises it)."""

    def __init__(self, line: str):
        self.line = line


def run_config(out: Path, plan, model, ranks) -> dict:
    """The run's config: its options (``plan``: the RunPlan, as resumed), the model's config and the
    number of processes; written to config.json by the first process (``hytrain export`` reads it),
    and held by each checkpoint."""
    config = {"options": plan.options(), "model": model.config, "world_size": ranks.world}
    if ranks.main:
        write_whole(out / "config.json", json.dumps(config, indent=1, default=str))
    return config


def write_whole(path: Path, text: str) -> None:
    """``text`` into ``path`` whole or not at all: written beside it, then renamed over it, so that a run
    killed (or a disk filling) mid-write leaves the file as it was, never cut short (``hytrain export``
    and a resume read config.json; a scheduler reads summary.json)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def export_at_end(model, out, plan, keep: int, ranks, say) -> Path | ExportFailed | None:
    """The trained model as a Hugging Face model directory, ``OUT/model`` (config, safetensors shards,
    the tokenizer's files; ``plan``: the ModelPlan, whose tokenizer goes with it): written beside an
    earlier one (a resumed run's), then put in its place. A failed export (a full disk, an I/O error,
    an unreadable tokenizer) is not the training's failure: it returns :class:`ExportFailed`, naming
    the last good checkpoint (``keep``: 0 where none was written) and how to export it. Without
    transformers (a plain ``pip install``) nothing is written: one line says so (``say``), and None."""
    why_not = export_needs()
    if why_not:
        done = ckpt.complete_checkpoints(out) if ranks.main else []
        later = (f"; its last checkpoint, {done[-1]}, exports later with `hytrain export {out} --to DIR`"
                 if done else "")
        say(f"hytrain train: {out / 'model'} not written: {why_not}{later}", flush=True)
        return None
    where = model_path(plan)
    tokenizer = plan.tokenizer if plan.tokenizer not in (None, "bytes") else (str(where) if where else None)
    if plan.tokenizer == "bytes":
        tokenizer = None
    target, fresh, old = out / "model", out / ".model-new", out / ".model-old"
    try:
        if ranks.main:
            for d in (fresh, old):
                shutil.rmtree(d, ignore_errors=True)
        export_model(model, fresh, tokenizer_dir=tokenizer)
        if ranks.main:
            if target.exists():
                os.rename(target, old)
            os.rename(fresh, target)
            shutil.rmtree(old, ignore_errors=True)
    except (ConfigError, OSError) as e:
        if ranks.main:
            shutil.rmtree(fresh, ignore_errors=True)
            if old.exists() and not target.exists():  # the earlier export back in its place
                with contextlib.suppress(OSError):
                    os.rename(old, target)
        return ExportFailed(_export_failed(out, target, e, keep))
    return target


def _export_failed(out: Path, target: Path, e: Exception, keep: int) -> str:
    why = e.why if isinstance(e, ExportError) else e.strerror or first_line(e) if isinstance(e, OSError) else str(e)
    why = f"exporting the model into {target} failed: {why}" + (
        f" ({target} still holds an earlier run's model)" if target.exists() else "")
    done = ckpt.complete_checkpoints(out)
    if not done:
        return (f"training ended with no checkpoint saved{' (--keep 0)' if not keep else ''}, and {why}: the "
                "trained model is lost")
    return (f"training finished and its last good checkpoint is {done[-1]}, but {why}; export it later with "
            f"`hytrain export {out} --to DIR`")


def finish(out, opt, history, n_params, tokens_per_step, elapsed, energy, device, ranks, exported=None,
           window=None, startup=None) -> dict | None:
    """Traces (rank 0's as trace.json, the others' beside it), pictures and summary.json (rank 0).
    ``exported``: OUT/model, or :class:`ExportFailed` -- summary.json then has ``export_error`` (no
    ``model_dir``), and the failure is raised (every rank) once it is written. ``startup``: how long
    the start took (``startup_s``, ``state_made_s``: metrics.Startup)."""
    failed = exported.line if isinstance(exported, ExportFailed) else None
    if not ranks.main:
        opt.export_trace(out / f"trace.rank{ranks.rank}.json")
        if failed:
            raise ConfigError(failed)
        return None
    try:
        trace = opt.export_trace(out / "trace.json")
        # The loss curve of the whole run, steps before a resume included (metrics.jsonl keeps them).
        pictures = plots.write_all(out, recorded(out / "metrics.jsonl") or history, trace)
    except OSError as e:  # the checkpoints are written: only the pictures are lost
        raise ConfigError(f"{failed}; writing the trace and pictures failed too: {e}" if failed else
                          f"training finished and its checkpoint is saved, but writing the trace and "
                          f"pictures into {out} failed: {e}") from None
    vals = [r["val_loss"] for r in history if "val_loss" in r]
    tokens = tokens_per_step * len(history)
    summary = {"steps": history[-1]["step"] if history else 0, "params": n_params, "device": str(device),
               "processes": ranks.world,
               # this process's part of the run (a resumed run starts after its checkpoint's step):
               # first_loss, tokens and tokens_per_s are of the steps from from_step on
               "from_step": history[0]["step"] if history else None,
               "first_loss": history[0]["loss"] if history else None,
               "final_loss": history[-1]["loss"] if history else None,
               "final_val_loss": vals[-1] if vals else None, "tokens": tokens,
               # the run's: its tokens over the loop's wall-clock (train_loop_s: from the first step to the
               # last, the first step's set-up, validation and checkpoint saves included; not the start-up
               # before, nor the export after); step_tokens_per_s: the median step's own (metrics.jsonl's,
               # the progress bar's), without them
               "tokens_per_s": tokens / elapsed if elapsed > 0 else None, "train_loop_s": elapsed,
               "step_tokens_per_s": statistics.median(r["tokens_per_s"] for r in history) if history else None,
               "trace": str(trace), **pictures}
    summary.update(startup or {})
    if failed:
        summary["export_error"] = failed
    elif exported is not None:
        summary["model_dir"] = str(exported)  # AutoModelForCausalLM.from_pretrained loads it
    # Where the optimizer's state lived at the end, and the process's peaks.
    placed = opt.residency()
    summary.update(k=len(placed["gpu"]), state_format=opt.state_format, state_host_gb=placed["host_bytes"] / 1e9,
                   state_gpu_gb=placed["gpu_bytes"] / 1e9, shadows_host_gb=placed["shadow_bytes"] / 1e9,
                   peak_host_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
    if window is not None:  # streamed weights: how many layers, and of them kept on the GPU after measuring
        # (made_resident: layers the optimizer took back onto the GPU, their states there, the host too small)
        summary.update(streamed_layers=len(window.streamed), layers=len(window.layers),
                       kept_layers=len(window.kept_layers), made_resident=window.stats["made_resident"],
                       streamed_ends=window.ends, window_host_gb=window.host_bytes() / 1e9)
    if torch.device(device).type == "cuda":
        summary["peak_gpu_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 1e9
    if energy > 0:
        summary["energy_j"] = energy
        summary["energy_per_token_j"] = energy / tokens
    try:
        write_whole(out / "summary.json", json.dumps(summary, indent=1))
    except OSError as e:
        raise ConfigError(f"{failed}; writing {out / 'summary.json'} failed too: {e}" if failed else
                          f"training finished and its checkpoint is saved, but writing {out / 'summary.json'} "
                          f"failed: {e}") from None
    if failed:
        raise ConfigError(failed)
    return summary
