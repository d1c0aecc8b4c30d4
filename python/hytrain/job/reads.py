"""Reading a safetensors file's tensors straight into storage that already lives where they will: a
streamed layer's pinned home (``stream_model`` of a model on the meta device), or a parameter's
device storage.

Where the file's dtype is the destination's and the destination is host memory, each piece is read
by the kernel into it (``os.preadv``: one copy, from the page cache or the disk, no intermediate
tensor); elsewhere a piece is read into a small buffer and cast or copied from there. Pieces of
``PIECE_BYTES`` run on a pool of threads (the reads release the GIL), so a large checkpoint reads at
the disk's or the memory's rate rather than one thread's. The format is the published one: an
8-byte little-endian header length, a JSON header (name -> dtype, shape, byte offsets in the data
section), the data."""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..distributed import process_cpus
from .options import ConfigError

FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool}
PIECE_BYTES = 64 << 20  # one read, and the most held in a buffer where a piece is cast
_MAX_HEADER = 100 << 20  # (safetensors' own limit)


def header(file: Path) -> tuple[int, dict]:
    """(where the data section starts, ``{name: (dtype, shape, begin, end)}`` with the tensor's bytes at
    [begin, end) of the data section) from the file's header; a ConfigError names a damaged one."""
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than its header")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise ValueError(f"a header of {n} bytes")
            text = f.read(n)
            if len(text) < n:
                raise ValueError("shorter than its header")
            size = os.fstat(f.fileno()).st_size
        entries = {}
        for name, e in json.loads(text).items():
            if name == "__metadata__":
                continue
            if e["dtype"] not in FILE_DTYPES:
                raise ConfigError(f"{file}: tensor {name} has dtype {e['dtype']}, which is not read here")
            dtype, shape, (begin, end) = FILE_DTYPES[e["dtype"]], [int(s) for s in e["shape"]], e["data_offsets"]
            if end - begin != math.prod(shape) * dtype.itemsize or not 0 <= begin <= end or 8 + n + end > size:
                raise ValueError(f"tensor {name}'s offsets do not match its shape or the file's size")
            entries[name] = (dtype, shape, int(begin), int(end))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{file} cannot be read (truncated or damaged?): {type(e).__name__}: {e}") from None
    return 8 + n, entries


def read_into(file: Path, dests: dict, *, threads: int | None = None) -> int:
    """Reads each tensor ``name`` of ``dests`` from ``file``; returns the bytes read. A destination is
    a contiguous tensor of the file's shape, on any device, of any floating dtype where the file's is
    floating, else the file's own; or ``(tensor, first_row)``: rows ``first_row`` on of the file's
    tensor, as many as the tensor has (an FSDP2 rank's shard). Shapes are checked before anything is
    read."""
    start, entries = header(file)
    pieces = []
    for name, dest in dests.items():
        dest, row = dest if isinstance(dest, tuple) else (dest, None)
        if name not in entries:
            raise ConfigError(f"{file} has no tensor {name}")
        dtype, shape, begin, end = entries[name]
        if row is None and list(dest.shape) != shape:
            raise ConfigError(f"{file}: tensor {name} has shape {shape}, the model needs {list(dest.shape)}")
        if row is not None and (not shape or list(dest.shape[1:]) != shape[1:] or not 0 <= row
                                or row + dest.shape[0] > shape[0]):
            raise ConfigError(f"{file}: tensor {name} has shape {shape}, the model needs rows {row} to "
                              f"{row + (dest.shape[0] if dest.dim() else 0)} of {[None, *dest.shape[1:]]}")
        if not dest.is_contiguous():
            raise ValueError(f"the destination of {name} is not contiguous")
        if dest.dtype != dtype and not (dtype.is_floating_point and dest.dtype.is_floating_point):
            raise ConfigError(f"{file}: tensor {name} is {dtype}, the model's is {dest.dtype}")
        skip = 0 if row is None else row * math.prod(shape[1:])  # (elements before the first row)
        step = max(1, PIECE_BYTES // dtype.itemsize)
        numel = dest.numel()
        for a in range(0, numel, step):
            b = min(numel, a + step)
            pieces.append((dest, dtype, start + begin + (skip + a) * dtype.itemsize, a, b))
    if threads is None:
        threads = min(16, process_cpus())
    fd = os.open(file, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(max(1, threads)) as pool:
            done = list(pool.map(lambda piece: _read_piece(fd, file, *piece), pieces))
    finally:
        os.close(fd)
    return sum(done)


def _read_piece(fd, file, dest, dtype, offset, a, b) -> int:
    flat = dest.view(-1)[a:b]
    if dest.device.type == "cpu" and dest.dtype == dtype:
        return _pread(fd, file, memoryview(flat.view(torch.uint8).numpy()), offset)
    # Cast or copied on: through a buffer mapped for this piece and unmapped after it, so that the
    # buffers of many threads leave nothing behind in the allocator's arenas.
    room = mmap.mmap(-1, (b - a) * dtype.itemsize)
    try:
        got = _pread(fd, file, memoryview(room), offset)
        flat.copy_(torch.frombuffer(room, dtype=dtype, count=b - a))
    finally:
        with contextlib.suppress(BufferError):  # (still viewed after an error: unmapped when collected)
            room.close()
    return got


def _pread(fd, file, view, offset) -> int:
    got = 0
    try:
        while got < len(view):  # (a read returns at most about 2 GiB, and less at the end of a file)
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise ConfigError(f"{file} ends inside a tensor (truncated?)")
            got += n
    finally:
        view.release()
    return got


def read_placed(file_of: dict, targets: dict, where) -> int:
    """Reads a model's tensors from the files that hold them (``file_of``: name -> file) into
    ``where(targets[name])``, each tensor once (a tied one has two names); file by file. Returns the
    bytes read."""
    by_file, seen = {}, set()
    for name, file in file_of.items():
        t = targets[name]
        if id(t) not in seen:
            seen.add(id(t))
            by_file.setdefault(file, {})[name] = where(t)
    return sum(read_into(file, dests) for file, dests in by_file.items())
