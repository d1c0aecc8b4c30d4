"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank writes its own shards of
the model and of HybridAdamW's state (fp32 masters, ``exp_avg``, ``exp_avg_sq``, ``step``), and a
resume reads them back at the same world size or another (DCP reshards on load).

A checkpoint is ``<out>/checkpoints/step_NNNNNNNN/`` (DCP's files and ``meta.json``), written as
:mod:`hytrain.checkpoint` writes its own: into a hidden temporary directory, flushed, sealed by a
manifest with the size and SHA-256 of every file (shards and ``.metadata``) and of itself, renamed
into place by rank 0 after every rank has finished, and only then pointed to by ``latest``. A rank
that dies during a save leaves a stale temporary directory; the last good checkpoint and the pointer
are never touched. A load verifies every file first, each rank a share of them, and refuses the
checkpoint on every rank in one line naming the first bad file. ``export_safetensors`` writes the
full weights for inference (one file, rank 0).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from .checkpoint import SHARDED_FORMAT as FORMAT
from .checkpoint import (CheckpointError, failed_save, read_meta, check_files, check_room, digests, publish,
                         state_bytes, write_meta)
from .files import fsync, save_safetensors
from . import state_formats


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


@contextlib.contextmanager
def _one_process_quiet():
    """Without a process group DCP warns that it assumes one process: what is meant here, so unsaid."""
    with warnings.catch_warnings():
        if _dist() is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier():
    d = _dist()
    if d is not None:
        d.barrier()


def _rank() -> int:
    d = _dist()
    return d.get_rank() if d is not None else 0


def _world() -> int:
    d = _dist()
    return d.get_world_size() if d is not None else 1


def _state(model, opt, state_format=None):
    """What DCP saves or loads into; ``state_format``: the checkpoint's, when loading one whose m and v
    may differ from the optimizer's (converted by ``load_sharded_state_dict``)."""
    optim = opt.sharded_state_dict(state_format) if state_format else opt.sharded_state_dict()
    return {"model": model.state_dict(), "optim": optim}


def save(out, step: int, model, opt, extra: dict | None = None, keep: int = 2, since: int | None = None) -> Path:
    """Every rank calls it. ``extra``: small JSON values saved with the step (data position...);
    ``keep``, ``since``: as :func:`hytrain.checkpoint.save`."""
    import torch.distributed.checkpoint as dcp

    root = Path(out) / "checkpoints"
    name = f"step_{step:08d}"
    final, tmp = root / name, root / f".{name}.tmp"
    needed = state_bytes(model, opt)  # the whole checkpoint (global sizes)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        check_room(root, needed, f"checkpoint {final}", saving=True)  # (a refusal here fails the others at the barrier)
        tmp.mkdir()
    _barrier()
    opt.synchronize()  # the last step's updates may still be landing (they overlap the next forward)
    try:
        with _one_process_quiet():
            dcp.save(_state(model, opt), checkpoint_id=str(tmp))
    except (Exception, _CheckpointException) as e:  # DCP gathers every rank's failure (a full disk) and raises on all
        cause = _cause(e)
        err = cause if isinstance(cause, OSError) else OSError(f"{type(cause).__name__}: {_first_line(cause)}")
        raise failed_save(tmp, final, needed, err, remove=_rank() == 0) from None  # rank 0 cleans up
    _barrier()  # every rank's shards are written
    if _rank() == 0:
        try:
            for f in tmp.iterdir():
                fsync(f)
            names = [f.name for f in tmp.iterdir() if f.is_file()]
            meta = {"format": FORMAT, "step": step, "world_size": _world(), "extra": extra or {},
                    "state_format": getattr(opt, "state_format", state_formats.DEFAULT), "files": digests(tmp, names)}
            write_meta(tmp, meta)
        except OSError as e:
            raise failed_save(tmp, final, needed, e) from None
        publish(root, tmp, final, keep, since)
    _barrier()
    return final


def resolve(out, spec: str = "latest") -> Path:
    """As :func:`hytrain.checkpoint.resolve` (``latest``: the newest complete checkpoint)."""
    from .checkpoint import resolve as _resolve

    return _resolve(out, spec)


def is_sharded_checkpoint(path) -> bool:
    """Whether ``path`` holds a checkpoint written by :func:`save` (not one of ``hytrain.checkpoint``)."""
    try:
        return json.loads((Path(path) / "meta.json").read_text()).get("format") in (FORMAT, "dcp-1")
    except (OSError, ValueError, AttributeError):
        return False


def load(path, model, opt) -> dict:
    """Every rank calls it, with the model sharded as it will train (any world size). Restores the
    model and the optimizer; returns ``{"step", "world_size", "extra"}`` as saved."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    _verify_shared(path)
    meta = read_meta(path)
    state = _state(model, opt, meta.get("state_format", state_formats.DEFAULT) if hasattr(opt, "state_format") else None)
    if int(meta.get("world_size", 1)) != _world():  # 8-bit scales saved per rank fit that world size only
        for entry in state["optim"]["state"].values():
            for key in [k for k in entry if k.endswith("_rank_scales")]:
                del entry[key]
    try:
        with _one_process_quiet():
            dcp.load(state, checkpoint_id=str(path))
    except (Exception, _CheckpointException) as e:  # several kinds, for shards and for a model that differs
        cause = _cause(e)
        if isinstance(cause, (ValueError, KeyError, RuntimeError)) and any(
                w in str(cause) for w in ("mismatch", "Missing key", "missing", "Unexpected key")):
            raise CheckpointError(f"{path} was written for a different model: {_first_line(cause)} (resume with "
                                  "the model and options the run was started with)") from None
        raise CheckpointError(f"{path}: could not be read ({type(cause).__name__}: {_first_line(cause)})") from None
    model.load_state_dict(state["model"])
    opt.load_sharded_state_dict(state["optim"])
    return {"step": int(meta["step"]), "world_size": int(meta["world_size"]), "extra": meta.get("extra", {})}


def load_single(path, model, opt) -> dict:
    """Every rank calls it: a single-process checkpoint (:mod:`hytrain.checkpoint`'s, verified) resumed
    at this world size. Rank 0 writes it as a sharded checkpoint beside it (a hidden directory, read
    lazily: memory-mapped, one tensor at a time), which every rank then loads as :func:`load` does,
    taking its own shards; the directory is removed after. 8-bit m and v are written as fp32 (the
    single-process layout quantises the whole tensor; the new shards quantise their own blocks).
    Returns :func:`load`'s dict, ``extra`` holding the checkpoint's config and its scheduler."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.resharded.tmp"
    # The parameters' global shapes, by the index the optimizer's sharded state uses: m is shaped like
    # its parameter in every format (8-bit codes too, state_dicts._sharded_moment).
    shapes = {i: tuple(e["exp_avg"].shape) for i, e in opt.sharded_state_dict()["state"].items()}
    own = getattr(model, "saved_module", model)  # the single checkpoint's names -> the model's own
    by_id = {id(t): k for k, t in model.state_dict(keep_vars=True).items()}
    names = {k: by_id.get(id(t), k) for k, t in own.state_dict(keep_vars=True).items()}
    error = None
    if _rank() == 0:
        try:
            _resharded(path, tmp, names, shapes)
        except (CheckpointError, OSError, RuntimeError, ValueError, KeyError) as e:
            error = f"{path} could not be read for a resume on {_world()} processes: {_first_line(e)}"
    d = _dist()
    if d is not None:
        box = [error]
        d.broadcast_object_list(box, src=0)
        error = box[0]
    try:
        if error is not None:
            raise CheckpointError(error)
        return load(tmp, model, opt)
    finally:
        _barrier()
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def _resharded(src: Path, dst: Path, names: dict, shapes: dict) -> None:
    """``src``, a single-process checkpoint, written at ``dst`` as one process's sharded checkpoint."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    from . import quant8

    meta = read_meta(src)
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        weights = {names.get(k, k): f.get_tensor(k) for k in f.keys()}
    saved = torch.load(src / "optimizer.pt", map_location="cpu", weights_only=True, mmap=True)
    trainer = torch.load(src / "trainer.pt", map_location="cpu", weights_only=True)
    state = {}
    for i, entry in saved["state"].items():
        if i not in shapes:
            raise CheckpointError(f"parameter {i} of the checkpoint is not one this optimizer steps")
        out = {}
        for key, val in entry.items():
            if isinstance(val, torch.Tensor) and val.dtype == torch.uint8:  # an 8-bit moment (quant8), decoded
                n = 1
                for s in shapes[i]:
                    n *= s
                val = quant8.dequantize(val, n, key).view(shapes[i])
            out[key] = val
        state[i] = out
    groups = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    fmt = meta.get("state_format", state_formats.DEFAULT)
    with _one_process_quiet():
        dcp.save({"model": weights, "optim": {"state": state, "param_groups": groups}}, checkpoint_id=str(dst),
                 no_dist=True)
    names_ = [f.name for f in dst.iterdir() if f.is_file()]
    write_meta(dst, {"format": FORMAT, "step": int(meta["step"]), "world_size": 1,
                     "extra": {"scheduler": trainer["scheduler"], **(meta.get("config") or {})},
                     "state_format": state_formats.DEFAULT if state_formats.get(fmt).blockwise else fmt,
                     "files": digests(dst, names_)})


try:  # DCP's summary of every rank's failure derives from BaseException, not Exception
    from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException
except ImportError:  # pragma: no cover - torch without torch.distributed
    class _CheckpointException(Exception):
        pass


def _cause(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's summary (``failures``: rank -> (exception, stack))."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _verify_shared(path: Path) -> None:
    """Every rank checks a share of the files (all of them without a process group); a failure on
    any rank is raised on every rank, with the first message."""
    error = None
    try:
        meta = read_meta(path)
        if meta["format"] not in (FORMAT, "dcp-1"):
            raise CheckpointError(f"{path} is not a hytrain sharded checkpoint (format {FORMAT})")
        names = sorted(meta["files"])
        check_files(path, meta["files"], names[_rank()::_world()])
    except CheckpointError as e:
        error = str(e)
    d = _dist()
    if d is not None:
        errors = [None] * _world()
        d.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        err = CheckpointError(error)
        err.damaged = True  # its files, not the model it was written for
        raise err


def export_safetensors(path, model) -> None:
    """The full weights under the model's parameter names, one safetensors file written by rank 0
    (every rank calls it: sharded weights are gathered)."""
    full = {}
    for k, v in model.state_dict().items():
        t = v.full_tensor() if hasattr(v, "full_tensor") else v
        full[k] = t.detach().to("cpu").contiguous().clone()
    if _rank() == 0:
        tmp = Path(str(path) + ".tmp")
        save_safetensors(full, tmp)
        fsync(tmp)
        os.replace(tmp, path)
    _barrier()
