"""Atomic, verified training checkpoints.

A checkpoint is a directory ``<out>/checkpoints/step_NNNNNNNN/``:

* ``model.safetensors``: the model's weights under its own parameter names (loadable without hytrain);
* ``optimizer.pt``: ``HybridAdamW.state_dict()`` (fp32 master weights, ``exp_avg``, ``exp_avg_sq``,
  ``step``; CPU tensors);
* ``trainer.pt``: the LR scheduler and the RNG states;
* ``meta.json``, written last: step, data position, configuration, and the size and SHA-256 of every
  other file.

It is written into a hidden temporary directory, every file is flushed to disk, and only then is the
directory renamed into place and the ``latest`` pointer replaced (``os.replace``, atomic on POSIX). A
crash or kill in the middle of a save leaves at most a stale temporary directory; the last good
checkpoint and the pointer to it are never touched. Loading checks every size and checksum first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

FORMAT = 1
FILES = ("model.safetensors", "optimizer.pt", "trainer.pt")


class CheckpointError(RuntimeError):
    """A missing, truncated or corrupted checkpoint."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict:
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def save(out: str | os.PathLike, step: int, model, opt, sched, config: dict, keep: int = 2) -> Path:
    from safetensors.torch import save_file

    root = Path(out) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final, tmp = root / name, root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    own = getattr(model, "saved_module", model)  # a wrapper saves what it wraps, under its names
    opt.synchronize()  # the last step's updates may still be landing (they overlap the next forward)
    weights = {k: v.detach().to("cpu").contiguous().clone() for k, v in own.state_dict().items()}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"step": str(step)})
    torch.save(opt.state_dict(), tmp / "optimizer.pt")
    torch.save({"scheduler": sched.state_dict() if sched is not None else None, "rng": _rng_state()},
               tmp / "trainer.pt")
    files = {}
    for f in FILES:
        _fsync(tmp / f)
        files[f] = {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)}
    meta = {"format": FORMAT, "step": step, "data_position": step, "config": config, "files": files}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    _fsync(tmp / "meta.json")
    return publish(root, tmp, final, keep)


def publish(root: Path, tmp: Path, final: Path, keep: int) -> Path:
    """A complete checkpoint written in ``tmp`` (its manifest last) goes into place: flushed, renamed
    to ``final``, pointed to by ``latest`` (atomic replace), and all but the newest ``keep`` removed."""
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name + "\n")
    _fsync(pointer)
    os.replace(pointer, root / "latest")
    _fsync(root)
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[:-keep] if keep > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def resolve(out: str | os.PathLike, spec: str) -> Path:
    """``spec``: a checkpoint directory, or ``latest`` (the newest complete one under ``out``)."""
    if spec == "latest":
        pointer = Path(out) / "checkpoints" / "latest"
        if not pointer.is_file():
            raise CheckpointError(f"--resume latest: no checkpoint under {Path(out) / 'checkpoints'}")
        path = pointer.parent / pointer.read_text().strip()
    else:
        path = Path(spec)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    return path


def verify(path: Path) -> dict:
    """Checks the manifest, every file's size and SHA-256; returns the manifest."""
    meta_path = Path(path) / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is incomplete: meta.json is missing (an interrupted save?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path} is corrupted: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or set(meta.get("files", {})) != set(FILES):
        raise CheckpointError(f"{meta_path} is not a hytrain checkpoint manifest (format {FORMAT})")
    for f, want in meta["files"].items():
        p = Path(path) / f
        if not p.is_file():
            raise CheckpointError(f"{p} is missing")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{p} is truncated or altered: {size} bytes, expected {want['bytes']}")
        if _sha256(p) != want["sha256"]:
            raise CheckpointError(f"{p} is corrupted: its SHA-256 does not match the manifest")
    return meta


def load(path: Path, model, opt, sched) -> int:
    """Verifies, then restores the model, optimizer, scheduler and RNG states; returns the step."""
    from safetensors.torch import load_file

    meta = verify(path)
    weights = load_file(str(Path(path) / "model.safetensors"))
    try:
        getattr(model, "saved_module", model).load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: the weights do not fit this model: {e}") from None
    opt.load_state_dict(torch.load(Path(path) / "optimizer.pt", map_location="cpu", weights_only=True))
    trainer = torch.load(Path(path) / "trainer.pt", map_location="cpu", weights_only=True)
    if sched is not None and trainer["scheduler"] is not None:
        sched.load_state_dict(trainer["scheduler"])
    torch.set_rng_state(trainer["rng"]["torch"])
    if "cuda" in trainer["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(trainer["rng"]["cuda"])
    return int(meta["step"])
