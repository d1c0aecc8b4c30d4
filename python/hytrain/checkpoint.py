"""Atomic, verified training checkpoints.

A checkpoint is a directory ``<out>/checkpoints/step_NNNNNNNN/``:

* ``model.safetensors``: the model's weights under its own parameter names (loadable without hytrain);
* ``optimizer.pt``: ``HybridAdamW.state_dict()`` (fp32 master weights, ``exp_avg``, ``exp_avg_sq``
  in the optimizer's state format, ``step``); ``meta.json`` records the format, and a load into an
  optimizer of another format converts (m and v are copied into its buffers);
* ``trainer.pt``: the LR scheduler and the RNG states;
* ``meta.json``, written last: step, data position, configuration, the size and SHA-256 of every
  other file, and the SHA-256 of the manifest itself (``checksum``: an edited step is refused too).

It is written into a hidden temporary directory, every file is flushed to disk, and only then is the
directory renamed into place and the ``latest`` pointer replaced (``os.replace``, atomic on POSIX). A
crash or kill in the middle of a save leaves at most a stale temporary directory; the last good
checkpoint and the pointer to it are never touched. Loading checks every size and checksum first (the
files hashed in parallel). The sharded checkpoints of :mod:`hytrain.dist_checkpoint` carry the same
manifest over DCP's files; :func:`verify` checks either kind (``hytrain verify DIR``). ``latest`` is
the newest complete checkpoint: the pointer, or a newer one found by a scan (a kill between the
rename and the pointer), and a damaged pointer is passed over with a message. A reader of a live run's
checkpoint (``hytrain export``) holds :func:`reading`'s lease on it, which pruning passes over.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from .files import fsync, save_safetensors

from .distributed import process_cpus
from .state_formats import DEFAULT, get as state_format

try:
    import fcntl
except ImportError:  # no POSIX locks: a checkpoint's reader has no lease (it retries instead)
    fcntl = None

FORMAT = 2
FILES = ("model.safetensors", "optimizer.pt", "trainer.pt")
SHARDED_FORMAT = "dcp-2"  # hytrain.dist_checkpoint's
_OLDER = {1: "single", "dcp-1": "sharded"}  # formats whose manifest is not sealed (no checksum of its own)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used or written, said in one line naming the path: missing, incomplete
    (no ``meta.json``: an interrupted save), truncated, altered or corrupted (sizes or SHA-256s against its
    manifest, a manifest against its own checksum), written for another model, or a save that failed (a
    full disk: the checkpoints before it stay intact). Raised by :func:`verify`, :func:`load` and
    :func:`resolve` before anything is loaded, and by the saves; ``hytrain train --resume`` and ``hytrain
    verify`` report it in one line (exit 2). Also reached as ``hytrain.CheckpointError``."""


class CheckpointGone(CheckpointError):
    """A checkpoint removed (pruned by the run still saving them) before its reader's lease was taken."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def digests(root: Path, names) -> dict:
    """``{name: {"bytes", "sha256"}}`` of the files under ``root``, hashed in parallel (hashlib: no GIL)."""
    names = sorted(names)
    with ThreadPoolExecutor(min(16, process_cpus())) as pool:
        sums = list(pool.map(lambda n: _sha256(Path(root) / n), names))
    return {n: {"bytes": (Path(root) / n).stat().st_size, "sha256": h} for n, h in zip(names, sums)}


def _meta_checksum(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def write_meta(path: Path, meta: dict) -> None:
    """The manifest, sealed with the SHA-256 of its own content, flushed to disk."""
    meta = dict(meta)
    meta["checksum"] = _meta_checksum(json.loads(json.dumps(meta, default=str)))
    (Path(path) / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    fsync(Path(path) / "meta.json")


def _rng_state() -> dict:
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def state_bytes(model, opt) -> int:
    """About what a checkpoint of this model and optimizer takes on disk (weights and optimizer
    state; metadata only, nothing is copied)."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values() if torch.is_tensor(t))
    fmt = state_format(getattr(opt, "state_format", DEFAULT))
    for p in (p for g in opt.param_groups for p in g["params"]):
        master = 4 if p.dtype != torch.float32 or p.device.type == "cuda" else 0
        total += p.numel() * master + 2 * fmt.moment_bytes(p.numel())  # m and v
    return total + (1 << 20)


def bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).is_dir() else 0


def check_room(root: Path, needed: int, what: str, saving: bool = False) -> None:
    """Refuses a save (``saving``: then naming the checkpoint kept) or a run the disk cannot hold,
    before anything is written."""
    probe = Path(root)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise CheckpointError(f"{what} needs about {needed / 1e9:.3f} GB but the disk holding {root} has "
                              f"{free / 1e9:.3f} GB free" + (kept(root) if saving else ""))


def kept(root: Path) -> str:
    """What a failed save leaves: the newest complete checkpoint under ``root``, named."""
    done = [p for p in _step_dirs(Path(root)) if _complete(p)]
    if not done:
        return "; no checkpoint of this run is saved yet, and the run stops"
    return (f"; the last good checkpoint, {done[-1].name}, is kept and the run stops (make room, then "
            "--resume latest continues from it)")


def failed_save(tmp: Path, final: Path, needed: int, e: Exception, remove: bool = True):
    if remove:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial save never stays to fill the disk
    why = getattr(e, "strerror", None) or (str(e).strip().splitlines() or [type(e).__name__])[0]
    return CheckpointError(f"saving {final} failed: {why} (about {needed / 1e9:.3f} GB needed)" + kept(final.parent))


def save(out: str | os.PathLike, step: int, model, opt, sched, config: dict, keep: int = 2,
         since: int | None = None) -> Path:
    """Writes ``<out>/checkpoints/step_<step>`` atomically, then keeps the newest ``keep``. ``since``: the
    step of the run's previous checkpoint (saved or resumed from), when it resumed: see :func:`publish`."""
    root = Path(out) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final, tmp = root / name, root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    needed = state_bytes(model, opt)
    check_room(root, needed, f"checkpoint {final}", saving=True)
    try:
        tmp.mkdir()
        own = getattr(model, "saved_module", model)  # a wrapper saves what it wraps, under its names
        opt.synchronize()  # the last step's updates may still be landing (they overlap the next forward)
        weights = {k: v.detach().to("cpu").contiguous().clone() for k, v in own.state_dict().items()}
        save_safetensors(weights, tmp / "model.safetensors", metadata={"step": str(step)})
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        torch.save({"scheduler": sched.state_dict() if sched is not None else None, "rng": _rng_state()},
                   tmp / "trainer.pt")
        for f in FILES:
            fsync(tmp / f)
        meta = {"format": FORMAT, "step": step, "data_position": step, "config": config,
                "state_format": getattr(opt, "state_format", DEFAULT), "files": digests(tmp, FILES)}
        write_meta(tmp, meta)
    except Exception as e:  # OSError, and the writers' own errors on a full disk (torch.save's
        # "unexpected pos", safetensors' SafetensorError): the same failed save
        raise failed_save(tmp, final, needed, e) from None
    return publish(root, tmp, final, keep, since)


def notice(text: str) -> None:
    """A line on stderr, once per job: every rank resolves and saves the same checkpoints, rank 0 says so."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    if (torch.distributed.get_rank() if initialized else int(os.environ.get("RANK", "0"))) == 0:
        print(text, file=sys.stderr, flush=True)


def publish(root: Path, tmp: Path, final: Path, keep: int, since: int | None = None) -> Path:
    """A complete checkpoint written in ``tmp`` (its manifest last) goes into place: flushed, renamed
    to ``final``, pointed to by ``latest`` (atomic replace), and all but the newest ``keep`` removed.
    ``since``: the step of the run's previous checkpoint, for a run resumed from one: the checkpoints
    after it are another run's future (a resume from an older checkpoint abandons them), and they go
    before this one is put in place, said on stderr. Left, ``--resume latest`` would take the newest
    of them over this run's, and pruning would count them (keeping a damaged one, removing this
    run's good ones)."""
    fsync(tmp)
    stale = [d for d in _step_dirs(root) if since is not None and d != final and _step_of(d) > since]
    if stale:
        notice(f"hytrain: removing {', '.join(d.name for d in stale)}: saved after step {since}, which this run "
               "resumed from, by the run it replaces")
    for old in stale:  # renamed first, as below; the sweep removes them
        try:
            os.rename(old, root / f".{old.name}.trash")
        except OSError:
            continue
    if final.exists():  # the same step saved again: the old one leaves by a rename, never half-deleted
        trash = root / f".{final.name}.trash"
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(tmp, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name + "\n")
    fsync(pointer)
    os.replace(pointer, root / "latest")
    fsync(root)
    done = _step_dirs(root)
    for old in _pruned(done, final, keep):
        if old != final:  # renamed first: a kill while removing leaves no half checkpoint under its name
            _prune(old, root / f".{old.name}.trash")
    sweep(root)
    return final


def _flock(fd: int, exclusive: bool) -> bool:
    """A shared lock on ``fd`` (waiting), or an exclusive one (not waiting): False where another process
    holds a conflicting one; True where taken, or where the file system has no such locks."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EOPNOTSUPP: no flock here (a reader's retry is all there is)
        pass
    return True


def _prune(old: Path, trash: Path) -> None:
    """Renames checkpoint ``old`` to ``trash`` (the sweep removes it) unless a reader holds its lease
    (:func:`reading`): then it stays, said on stderr, for a later save's pruning. The exclusive lock
    is held across the rename: a reader whose lease waited on it finds the checkpoint gone."""
    try:
        fd = os.open(old, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        fd = None  # (unreadable: no reader holds it either)
    try:
        if fd is None or _flock(fd, exclusive=True):
            os.rename(old, trash)
        else:
            notice(f"hytrain: {old.name} is being read (hytrain export); kept until a later save prunes it")
    except OSError:
        pass
    finally:
        if fd is not None:
            os.close(fd)  # (and the lock with it)


@contextmanager
def reading(path: Path):
    """A read lease on checkpoint ``path`` for a ``with``: a shared lock on its directory, which pruning
    (:func:`publish`) respects. Raises :class:`CheckpointGone` where it was pruned before the lease was
    taken (the reader resolves ``latest`` again)."""
    path = Path(path)
    gone = CheckpointGone(f"{path} was removed before it could be read (pruned by the run saving checkpoints)")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        raise gone from None
    try:
        _flock(fd, exclusive=False)  # waits only while a pruner renames it
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if not same:  # renamed away between the open and the lease
            raise gone
        yield path
    finally:
        os.close(fd)


_VERIFIED = {}  # checkpoint path -> the (name, size, mtime) of its files when it last verified


def _verifies(path: Path) -> bool:
    """Whether checkpoint ``path`` verifies (:func:`verify`), hashed once per process while its files
    keep their sizes and times."""
    try:
        seal = tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(path).iterdir()))
    except OSError:
        return False
    if _VERIFIED.get(str(path)) == seal:
        return True
    try:
        verify(path)
    except (CheckpointError, OSError, ValueError) as e:
        notice(f"hytrain: {path.name} does not verify ({e}); not counted in --keep, and left in place "
               "(hytrain verify names what is wrong; remove it when done)")
        return False
    _VERIFIED[str(path)] = seal
    return True


def _pruned(done: list, final: Path, keep: int) -> list:
    """What pruning removes: the good checkpoints older than the newest ``keep`` that verify (the one
    just written is good by construction). A damaged one is not counted, and not removed either: what
    is left of it is the user's to inspect."""
    if keep <= 0:
        return []
    kept, damaged = [], []
    for d in reversed(done):
        if len(kept) < keep:
            (kept if d == final or _verifies(d) else damaged).append(d)
    return [d for d in done if d not in kept and d not in damaged]


def sweep(root: Path) -> None:
    """Removes what killed saves and prunes left behind (``.step_*.tmp``, ``.step_*.trash``, ``.latest.tmp``);
    called by a run's start and by every publish, when no save is in progress (one writer per run)."""
    root = Path(root)
    for left in [*root.glob(".step_*.trash"), *root.glob(".step_*.tmp")]:
        shutil.rmtree(left, ignore_errors=True)
    (root / ".latest.tmp").unlink(missing_ok=True)


def _pointer(root: Path) -> Path | None:
    """The checkpoint ``latest`` names, or None (missing; damaged: said once on stderr)."""
    pointer = root / "latest"
    if not pointer.exists():
        return None
    try:
        raw = pointer.read_bytes()[:4096]
        name = raw.decode("utf-8").strip()
        if not name.startswith("step_") or "/" in name or len(name) > 64:
            raise ValueError(f"names {name[:40]!r}")
    except (OSError, ValueError) as e:
        notice(f"hytrain: {pointer} is damaged ({e}); looking for the newest complete checkpoint instead")
        return None
    return root / name


def _damage(path: Path) -> str | None:
    """A cheap completeness check (manifest sealed, every file there at its size): what is wrong, or
    None; the checksums are verified when the checkpoint is loaded."""
    try:
        meta = read_meta(path)
        for f, want in meta["files"].items():
            size = (path / f).stat().st_size
            if size != want["bytes"]:
                return f"{f} is {size} bytes, its manifest says {want['bytes']}"
        return None
    except CheckpointError as e:
        return str(e).removeprefix(f"{path} is incomplete: ").removeprefix(f"{path}/").removeprefix(f"{path} ")
    except FileNotFoundError as e:
        return f"{Path(e.filename).name} is missing"
    except (OSError, KeyError, TypeError) as e:
        return f"its manifest cannot be read ({type(e).__name__}: {e})"


def _complete(path: Path) -> bool:
    return _damage(path) is None


def _step_dirs(root: Path) -> list[Path]:
    """The checkpoint directories under ``root`` (complete or not), oldest first."""
    return sorted(p for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []


def _step_of(path: Path) -> int:
    """The step a ``step_N`` directory's name gives (-1 for a name that gives none)."""
    try:
        return int(path.name[len("step_"):])
    except ValueError:
        return -1


def checkpoint_dirs(out: str | os.PathLike) -> list[Path]:
    """Every checkpoint directory under ``out`` (complete or not), oldest first."""
    return _step_dirs(Path(out) / "checkpoints")


def complete_checkpoints(out: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under ``out``, oldest first."""
    return [p for p in _step_dirs(Path(out) / "checkpoints") if _complete(p)]


def after_damage(path: Path) -> str:
    """For the error about damaged checkpoint ``path``: where to resume instead -- the newest complete
    checkpoint before it in the same directory -- or "" where there is none."""
    path = Path(path)
    older = [p for p in _step_dirs(path.parent) if p.name < path.name and _complete(p)]
    if not older:
        return ""
    return f"; the newest checkpoint before it is {older[-1]}: resume from that one with --resume {older[-1]}"


def resolve(out: str | os.PathLike, spec: str) -> Path:
    """``spec``: a checkpoint directory, or ``latest``: the newest complete checkpoint under ``out`` --
    the one the pointer names, or a newer complete one (the pointer is written after the rename, so a
    kill between the two leaves it behind), or, where the one it names is missing or incomplete
    (damaged on disk), the newest complete one before it, said on stderr."""
    if spec == "latest":
        root = Path(out) / "checkpoints"
        named = _pointer(root)
        found = _step_dirs(root)[::-1]
        for cand in found:
            if _complete(cand):
                if named is not None and cand.name < named.name:
                    what = f"is damaged ({_damage(named)})" if named.is_dir() else "is missing"
                    notice(f"hytrain: {named.name}, which {root / 'latest'} names, {what}; resuming from "
                           f"{cand.name}, the newest complete checkpoint")
                return cand
        cut = sorted(p.name for p in root.glob(".step_*.tmp"))  # a save killed before its rename
        raise CheckpointError(f"--resume latest: no checkpoint under {root}" + (
            f" ({cut[-1]} is a save that was interrupted: no step of this run was saved)" if cut else "")
            if not found else f"--resume latest: no complete checkpoint under {root} "
            f"({len(found)} incomplete: check them with hytrain verify)")
    path = Path(spec)
    if path.is_dir():
        return path
    # A checkpoint whose step is not zero-padded (step_20 for step_00000020): a name in the run, or a
    # path into another run's checkpoints.
    root = path.parent if spec != path.name else Path(out) / "checkpoints"
    if path.name.startswith("step_") and _step_of(path) >= 0:
        named = [p for p in _step_dirs(root) if _step_of(p) == _step_of(path)]
        if named:
            return named[-1]
    there = ", ".join(p.name for p in _step_dirs(root)) or "none"
    raise CheckpointError(f"checkpoint {path} does not exist (the checkpoints under {root}: {there})")


def read_meta(path: Path) -> dict:
    meta_path = Path(path) / "meta.json"
    try:
        raw = meta_path.read_bytes()
        meta = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is incomplete: meta.json is missing (an interrupted save?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path} is corrupted: {e}") from None
    except OSError as e:
        raise CheckpointError(f"{meta_path} cannot be read: {e}") from None
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt not in (FORMAT, SHARDED_FORMAT) and fmt not in _OLDER:
        raise CheckpointError(f"{meta_path} is not a hytrain checkpoint manifest")
    if not isinstance(meta.get("files"), dict) and fmt != "dcp-1":
        raise CheckpointError(f"{meta_path} has no file list")
    if fmt in (FORMAT, SHARDED_FORMAT) and meta.get("checksum") != _meta_checksum(meta):
        raise CheckpointError(f"{meta_path} was altered: its content does not match its checksum")
    if not isinstance(meta.get("step"), int) or isinstance(meta.get("step"), bool) or meta["step"] < 0:
        raise CheckpointError(f"{meta_path} has no valid step")
    meta.setdefault("files", {})
    return meta


def manifest_step(path: Path) -> int:
    """The step a checkpoint holds, from its sealed manifest (files not checked)."""
    return int(read_meta(path)["step"])


def check_files(path: Path, files: dict, names=None) -> None:
    """Sizes first, then SHA-256 in parallel; the first bad file (in name order) is named."""
    names = sorted(files if names is None else names)
    for f in names:
        p = Path(path) / f
        if not p.is_file():
            raise CheckpointError(f"{p} is missing")
        size = p.stat().st_size
        if size != files[f]["bytes"]:
            raise CheckpointError(f"{p} is truncated or altered: {size} bytes, expected {files[f]['bytes']}")
    with ThreadPoolExecutor(min(16, process_cpus())) as pool:
        sums = list(pool.map(lambda n: _sha256(Path(path) / n), names))
    for f, h in zip(names, sums):
        if h != files[f]["sha256"]:
            raise CheckpointError(f"{Path(path) / f} is corrupted: its SHA-256 does not match the manifest")


def verify(path: Path) -> dict:
    """Checks a checkpoint of either kind (single-process or sharded): the sealed manifest, then every
    file's size and SHA-256. Returns the manifest; raises CheckpointError naming what is wrong."""
    meta = read_meta(path)
    if meta["format"] in (FORMAT, 1) and set(meta["files"]) != set(FILES):
        raise CheckpointError(f"{Path(path) / 'meta.json'} does not list this checkpoint's files")
    if meta["format"] == SHARDED_FORMAT:
        present = {f.name for f in Path(path).iterdir() if f.name != "meta.json"}
        extra = sorted(present - set(meta["files"]))
        if extra:
            raise CheckpointError(f"{Path(path) / extra[0]} is not in the manifest (another run's file?)")
    check_files(path, meta["files"])
    return meta


def load_weights(path: Path, model) -> None:
    """The model's weights from a verified checkpoint (before its weights stream: a streamed
    parameter takes no load_state_dict)."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(path) / "model.safetensors"))
    try:
        getattr(model, "saved_module", model).load_state_dict(weights, strict=True)
    except RuntimeError as e:  # torch lists every mismatch (tens of lines): the count and the first
        lines = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
        first = lines[0] if lines else str(e).strip()
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise CheckpointError(f"{path} was written for a different model: {first}{more} (resume with the "
                              "model and options the run was started with)") from None


def load(path: Path, model, opt, sched, weights: bool = True) -> int:
    """Verifies, then restores the model (unless ``weights`` is False: :func:`load_weights` did),
    optimizer, scheduler and RNG states; returns the step."""
    meta = verify(path)
    if weights:
        load_weights(path, model)
    opt.load_state_dict(torch.load(Path(path) / "optimizer.pt", map_location="cpu", weights_only=True))
    trainer = torch.load(Path(path) / "trainer.pt", map_location="cpu", weights_only=True)
    if sched is not None and trainer["scheduler"] is not None:
        sched.load_state_dict(trainer["scheduler"])
    torch.set_rng_state(trainer["rng"]["torch"])
    if "cuda" in trainer["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(trainer["rng"]["cuda"])
    return int(meta["step"])
