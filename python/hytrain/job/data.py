"""The job's data: a corpus read as bytes (the Python standard library's own sources by default, or a
text file or directory), split into train and validation by a hash of each file's name, and the batch
of each step as a function of (seed, step) alone, so that a resumed run sees the same batches."""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import torch

from .options import ConfigError


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


def load_corpus(spec: str, max_bytes: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train bytes, validation bytes, description). Files are split by a hash of their name, so
    the split does not depend on the order or the number of files."""
    if spec == "stdlib":
        files, root = stdlib_files(), Path(sysconfig.get_paths()["stdlib"])
    else:
        root = Path(spec)
        if root.is_file():
            data = root.read_bytes()[:max_bytes]
            if len(data) < 4096:
                raise ConfigError(f"{root} has {len(data)} bytes; at least 4096 are needed")
            cut = len(data) * 19 // 20
            return (torch.frombuffer(bytearray(data[:cut]), dtype=torch.uint8),
                    torch.frombuffer(bytearray(data[cut:]), dtype=torch.uint8), str(root))
        if not root.is_dir():
            raise ConfigError(f"--data {spec!r} is neither 'stdlib', a file nor a directory")
        files = sorted(p for p in root.rglob("*") if p.is_file())
    train, val, total = bytearray(), bytearray(), 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        name = str(f.relative_to(root)).encode()
        (val if zlib.crc32(name) % 20 == 0 else train).extend(data)
        total += len(data)
        if total >= max_bytes:
            break
    if len(train) < 4096 or len(val) < 1024:
        raise ConfigError(f"the corpus {spec!r} is too small ({len(train)} train / {len(val)} validation bytes)")
    desc = f"{spec} ({len(files)} files, {len(train) / 1e6:.1f} MB train, {len(val) / 1e6:.2f} MB validation)"
    return (torch.frombuffer(train, dtype=torch.uint8).clone(), torch.frombuffer(val, dtype=torch.uint8).clone(),
            desc)


def batch_at(data: torch.Tensor, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """The batch of step ``step``: a function of (seed, step) only, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    return torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
