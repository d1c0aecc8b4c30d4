"""What a finished run leaves besides its checkpoints: the model as a Hugging Face directory
(``OUT/model``), the traces and pictures, and ``summary.json``."""

from __future__ import annotations

import json
import os
import resource
import shutil
from pathlib import Path

import torch

from .. import plots
from .hf import export_model
from .metrics import recorded
from .models import model_path
from .options import ConfigError


def export_at_end(model, out, args, ranks) -> Path:
    """The trained model as a Hugging Face model directory, ``OUT/model`` (config, safetensors shards,
    the tokenizer's files): written beside an earlier one (a resumed run's), then put in its place."""
    where = model_path(args)
    tokenizer = args.tokenizer if args.tokenizer not in (None, "bytes") else (str(where) if where else None)
    if args.tokenizer == "bytes":
        tokenizer = None
    target, fresh, old = out / "model", out / ".model-new", out / ".model-old"
    if ranks.main:
        for d in (fresh, old):
            shutil.rmtree(d, ignore_errors=True)
    export_model(model, fresh, tokenizer_dir=tokenizer)
    if ranks.main:
        if target.exists():
            os.rename(target, old)
        os.rename(fresh, target)
        shutil.rmtree(old, ignore_errors=True)
    return target


def finish(out, opt, history, n_params, tokens_per_step, elapsed, energy, device, ranks, exported=None,
           window=None) -> dict | None:
    """Traces (rank 0's as trace.json, the others' beside it), pictures and summary.json (rank 0)."""
    if not ranks.main:
        opt.export_trace(out / f"trace.rank{ranks.rank}.json")
        return None
    try:
        trace = opt.export_trace(out / "trace.json")
        # The loss curve of the whole run, steps before a resume included (metrics.jsonl keeps them).
        pictures = plots.write_all(out, recorded(out / "metrics.jsonl") or history, trace)
    except OSError as e:  # the checkpoints are written: only the pictures are lost
        raise ConfigError(f"training finished and its checkpoint is saved, but writing the trace and "
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
               "tokens_per_s": tokens / elapsed if elapsed > 0 else None, "trace": str(trace), **pictures}
    if exported is not None:
        summary["model_dir"] = str(exported)  # AutoModelForCausalLM.from_pretrained loads it
    # Where the optimizer's state lived at the end, and the process's peaks.
    placed = opt.residency()
    summary.update(k=len(placed["gpu"]), state_format=opt.state_format, state_host_gb=placed["host_bytes"] / 1e9,
                   state_gpu_gb=placed["gpu_bytes"] / 1e9, shadows_host_gb=placed["shadow_bytes"] / 1e9,
                   peak_host_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
    if window is not None:  # streamed weights: how many layers, and of them kept on the GPU after measuring
        summary.update(streamed_layers=len(window.streamed), layers=len(window.layers),
                       kept_layers=len(window.kept_layers), window_host_gb=window.host_bytes() / 1e9)
    if torch.device(device).type == "cuda":
        summary["peak_gpu_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 1e9
    if energy > 0:
        summary["energy_j"] = energy
        summary["energy_per_token_j"] = energy / tokens
    try:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    except OSError as e:
        raise ConfigError(f"training finished and its checkpoint is saved, but writing {out / 'summary.json'} "
                          f"failed: {e}") from None
    return summary
